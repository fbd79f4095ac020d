"""`paraflax bench`: every method on the same prompts, warm, in one process.

Per method: tokens per forward (generated tokens / all target forwards, prefill included),
drafts accepted per decoding step (mean and max; "acc" / "max"), target and drafter forwards,
tokens/s (warm; compile time reported separately), speedup vs the AR baseline (the base model;
methods may run other weights of the same architecture, such as a Jacobi Forcing model), and
greedy exact match vs greedy AR of the weights the method ran. Writes the JSON of DESIGN.md §6
(one object per method).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from paraflax.decoding.autoregressive import AR
from paraflax.decoding.generate import generate


@dataclasses.dataclass(frozen=True)
class Method:
  name: str
  decoder: object
  settings: str = ""
  draft_model: object = None
  model: object = None  # None: the bench's base model
  weights: str = "base"  # a name for `model`, shown in the table


@dataclasses.dataclass(frozen=True)
class Row:
  method: str
  settings: str
  weights: str
  tokens: int
  forwards: int
  draft_forwards: int
  tokens_per_forward: float
  tokens_per_second: float
  compile_seconds: float
  speedup_vs_ar: float
  exact_match_vs_ar: float | None  # fraction of rows identical to greedy AR (greedy only)
  accepted_histogram: list[int]  # [i]: decoding steps that emitted i tokens (i >= 1)
  mean_accepted: float  # drafts accepted per decoding step (emitted - 1), mean
  max_accepted: int  # drafts accepted in one step, most


def _batches(prompts, batch_size):
  for i in range(0, len(prompts), batch_size):
    chunk = prompts[i:i + batch_size]
    yield chunk + [chunk[-1]] * (batch_size - len(chunk)), len(chunk)  # fixed batch shape


def _run(model, prompts, method, max_new_tokens, batch_size, eos_id, max_prompt_len):
  """All prompts through one method; returns (token rows, totals, seconds, tokens emitted per
  decoding step of every row)."""
  outs, tokens, forwards, drafts, seconds, steps = [], 0, 0, 0, 0.0, []
  for batch, real in _batches(prompts, batch_size):
    t0 = time.perf_counter()
    out = generate(model, batch, decoder=method.decoder, max_new_tokens=max_new_tokens,
                   rng=jax.random.key(len(outs)), eos_id=eos_id, draft_model=method.draft_model,
                   max_prompt_len=max_prompt_len)
    out = jax.device_get(out)
    seconds += time.perf_counter() - t0
    for r in range(real):
      outs.append(out.tokens[r, :out.lengths[r]].tolist())
    tokens += int(out.lengths[:real].sum())
    forwards += int(out.forwards[:real].sum() + out.prefill_forwards[:real].sum())
    drafts += int(out.draft_forwards[:real].sum())
    acc = np.asarray(out.accepted[:real]).ravel()
    steps.append(acc[acc > 0])
  return outs, tokens, forwards, drafts, seconds, np.concatenate(steps)


def run_bench(model, prompts: Sequence[Sequence[int]], methods: Sequence[Method],
              max_new_tokens: int = 64, batch_size: int = 4,
              eos_id: int | Sequence[int] | None = None,
              max_prompt_len: int | None = None) -> list[Row]:
  """Bench `methods` (AR first is added if missing) on tokenised `prompts`; rows end at any
  id of `eos_id` (one id or several, e.g. `tok.eos_ids`)."""
  if not methods or methods[0].name != "ar":
    methods = [Method("ar", AR(), "greedy")] + list(methods)
  max_prompt_len = max_prompt_len or max(len(p) for p in prompts)
  run = lambda m, ps: _run(m.model or model, ps, m, max_new_tokens, batch_size, eos_id,
                           max_prompt_len)
  rows, ar_outs, ar_tps = [], {}, None  # ar_outs: greedy AR tokens per weights
  for method in methods:
    t0 = time.perf_counter()  # warm-up on the first batch: compile (and one run)
    run(method, prompts[:batch_size])
    warm = time.perf_counter() - t0
    outs, tokens, forwards, drafts, seconds, steps = run(method, prompts)
    tps = tokens / seconds
    ar_tps = ar_tps or tps
    if isinstance(method.decoder, AR) and method.decoder.sampler.greedy:
      ar_outs.setdefault(method.weights, outs)
    greedy = getattr(getattr(method.decoder, "sampler", None), "greedy", True)
    exact = None
    if greedy:
      if method.weights not in ar_outs:  # the reference of these weights, not shown as a row
        ar_outs[method.weights] = run(Method("ar", AR(), model=method.model), prompts)[0]
      exact = float(np.mean([a == b for a, b in zip(outs, ar_outs[method.weights])]))
    rows.append(Row(method.name, method.settings, method.weights, tokens, forwards, drafts,
                    tokens / forwards, tps, max(warm - seconds * batch_size / len(prompts), 0.0),
                    tps / ar_tps, exact, np.bincount(steps).tolist(), float(steps.mean() - 1),
                    int(steps.max() - 1)))
  return rows


def format_table(rows: Sequence[Row]) -> str:
  head = (f"{'method':<18} {'settings':<18} {'weights':<8} {'tok/fwd':>8} {'acc':>5} "
          f"{'max':>4} {'fwd':>6} {'draft fwd':>9} {'tok/s':>9} {'speedup':>8} {'exact':>6} "
          f"{'compile s':>9}")
  lines = [head, "-" * len(head)]
  for r in rows:
    exact = "-" if r.exact_match_vs_ar is None else f"{r.exact_match_vs_ar:.2f}"
    lines.append(f"{r.method:<18} {r.settings:<18} {r.weights:<8} {r.tokens_per_forward:>8.2f} "
                 f"{r.mean_accepted:>5.2f} {r.max_accepted:>4d} {r.forwards:>6d} "
                 f"{r.draft_forwards:>9d} {r.tokens_per_second:>9.1f} {r.speedup_vs_ar:>7.2f}x "
                 f"{exact:>6} {r.compile_seconds:>9.1f}")
  return "\n".join(lines)


def write_json(rows: Sequence[Row], path: str | Path, meta: dict | None = None,
               by_weights: dict[str, dict] | None = None) -> Path:
  """One object per row, plus `meta` on every row and `by_weights[row.weights]` on its rows."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  by_weights = by_weights or {}
  path.write_text(json.dumps([{**dataclasses.asdict(r), **(meta or {}),
                               **by_weights.get(r.weights, {})} for r in rows], indent=2))
  return path


def plot(rows: Sequence[Row], out_dir: str | Path) -> list[Path]:
  """PNGs: tokens/forward and speedup vs AR per method, and a histogram of tokens emitted
  per decoding step per method."""
  from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  names = [f"{r.method}\n({r.weights})" if r.weights != "base" else r.method for r in rows]
  fig = Figure(figsize=(max(8, 1.1 * len(rows)), 4))
  axes = fig.subplots(1, 2)
  for ax, key, label in ((axes[0], "tokens_per_forward", "tokens per forward"),
                         (axes[1], "speedup_vs_ar", "speedup vs AR (tokens/s)")):
    ax.bar(range(len(rows)), [getattr(r, key) for r in rows], color="C0")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(label)
  fig.tight_layout()
  speed = out_dir / "bench_speed.png"
  fig.savefig(speed, dpi=120)
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  for r in rows:
    counts = np.asarray(r.accepted_histogram, float)
    if counts.sum() and r.method != "ar":
      ax.plot(np.arange(len(counts))[1:], counts[1:] / counts.sum(), marker="o", ms=3,
              label=f"{r.method} ({r.settings}, {r.weights})")
  ax.set_xlabel("tokens emitted in one decoding step")
  ax.set_ylabel("share of steps")
  ax.set_yscale("log")  # the long tail is the interesting part
  ax.legend(fontsize=6)
  fig.tight_layout()
  hist = out_dir / "bench_accepted.png"
  fig.savefig(hist, dpi=120)
  return [speed, hist]
