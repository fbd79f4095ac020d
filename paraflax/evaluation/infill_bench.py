"""Any-subset benchmarks for AS-ARMs: sequential decoding vs ASSD on two tasks.

* "generate": held-out stdlib windows with 95% of the positions masked, filled by sampling
  (temperature 1); quality is the paper's Appendix E.4 pair: generative perplexity of each
  filled window under a judge AR model (lower is better) and the Shannon entropy of its token
  frequencies (bits; higher is more diverse), mean and standard error over windows, with a
  Welch test of each method against the sequential sampler.
* "line": HumanEval single-line infilling (the construction behind the paper's Table 2): each
  line of a canonical solution becomes a task whose hole has that line's token count and
  whose context is the rest of the prompt and solution; greedy fills are executed against the
  problem's tests (pass@1).

Speed: tokens per model call (draft and verify calls both count), tokens per iteration,
tokens/s warm, speedup vs the sequential sampler of the same model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paraflax.data.humaneval import Problem
from paraflax.decoding.any_order import AnyOrder
from paraflax.decoding.infill import infill
from paraflax.decoding.lattice import HOLE
from paraflax.model import masks


@dataclasses.dataclass(frozen=True)
class LineTask:
  """One single-line infilling task: `canvas` (tokens, HOLE on the line) and the texts that
  surround the line in the full program."""
  problem: Problem
  canvas: np.ndarray  # [L] int32
  prefix: str  # prompt + the solution lines before the hole
  line: str  # the reference line (not shown to the model)
  suffix: str  # the solution lines after it


def single_line_tasks(encode, problems: Sequence[Problem], length: int, pad_id: int
                      ) -> list[LineTask]:
  """Every non-blank solution line of `problems` as a task of exactly `length` tokens: the
  hole, as much left context as fits (three quarters of the room at least when there is a
  right context), the right context, then `pad_id` if the program is shorter."""
  tasks = []
  for prob in problems:
    lines = prob.canonical_solution.split("\n")
    for i, line in enumerate(lines):
      if not line.strip():
        continue
      prefix = prob.prompt + "".join(s + "\n" for s in lines[:i])
      suffix = "".join("\n" + s for s in lines[i + 1:])
      p, t, s = encode(prefix), encode(line), encode(suffix)
      room = length - len(t)
      if room < 1:
        continue  # a line longer than the window: no context left
      left = min(len(p), max(room - len(s), (3 * room) // 4))
      right = min(len(s), room - left)
      window = p[len(p) - left:] + [HOLE] * len(t) + s[:right]
      window += [pad_id] * (length - len(window))
      tasks.append(LineTask(prob, np.asarray(window, np.int32), prefix, line, suffix))
  return tasks


def line_program(task: LineTask, fill: str) -> str:
  """The program executed for a fill: prefix + fill + suffix, the tests, the check call."""
  return (task.prefix + fill + task.suffix + "\n\n" + task.problem.test + "\n\n"
          + f"check({task.problem.entry_point})\n")


def masked_windows(tokens_NxL: np.ndarray, rate: float, seed: int = 0) -> np.ndarray:
  """Each row with a `rate` share of its positions (at least one kept) set to HOLE."""
  rng = np.random.default_rng(seed)
  n, length = tokens_NxL.shape
  holes = rng.random((n, length)).argsort(1) < round(rate * length)
  holes[:, 0] &= holes[:, 1:].all(1) == 0  # never every position
  return np.where(holes, HOLE, tokens_NxL).astype(np.int32)


def entropy_bits(row: np.ndarray) -> float:
  """Shannon entropy (Eq. 22) of a sequence's token frequencies, in bits."""
  _, counts = np.unique(row, return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log2(p)).sum())


def generative_perplexity(judge, rows_NxL: np.ndarray, batch_size: int = 16) -> np.ndarray:
  """Per-row perplexity of `rows` under the causal judge: exp(mean NLL of tokens 1..L-1)."""
  n, length = rows_NxL.shape

  @jax.jit
  def nll(tokens):
    b = tokens.shape[0]
    logits, _ = judge(tokens, jnp.broadcast_to(jnp.arange(length), (b, length)),
                      masks.causal(jnp.full((b,), length, jnp.int32), length))
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0].mean(-1)

  out = []
  for i in range(0, n, batch_size):
    chunk = rows_NxL[i:i + batch_size]
    pad = np.repeat(chunk[-1:], batch_size - len(chunk), 0)
    out.append(np.asarray(nll(jnp.asarray(np.concatenate([chunk, pad]))))[:len(chunk)])
  return np.exp(np.concatenate(out))


def welch_p(a: np.ndarray, b: np.ndarray) -> float:
  """Two-sided p-value of Welch's t-test of equal means (normal approximation: fine for the
  dozens of windows a bench uses)."""
  va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
  if va + vb == 0:
    return 1.0 if a.mean() == b.mean() else 0.0
  return math.erfc(abs(a.mean() - b.mean()) / math.sqrt(2 * (va + vb)))


@dataclasses.dataclass(frozen=True)
class InfillRow:
  method: str
  task: str  # "generate" or "line"
  settings: str
  tokens: int  # holes filled
  calls: int  # model calls (draft + verify)
  iterations: int  # draft calls
  tokens_per_forward: float  # tokens per model call
  tokens_per_iteration: float
  tokens_per_second: float
  compile_seconds: float
  speedup_vs_ar: float  # vs the sequential any-order sampler of the same model
  exact_match_vs_ar: float | None  # greedy: rows identical to sequential greedy
  gen_ppl: float | None = None  # "generate": mean, standard error, Welch p vs sequential
  gen_ppl_se: float | None = None
  gen_ppl_p: float | None = None
  entropy: float | None = None
  entropy_se: float | None = None
  entropy_p: float | None = None
  pass_at_1: float | None = None  # "line"
  weights: str = "asarm"  # the model the rows ran (the bench's JSON keys quality by weights)


def _fill(model, canvases, decoder, batch_size, seed):
  """All canvases through `infill` in fixed-shape batches: (filled [N, L], calls, iterations,
  seconds)."""
  outs, calls, iters, seconds = [], 0, 0, 0.0
  for i in range(0, len(canvases), batch_size):
    chunk = canvases[i:i + batch_size]
    real = len(chunk)
    batch = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, 0)])
    t0 = time.perf_counter()
    out = jax.device_get(infill(model, batch, decoder, rng=jax.random.key(seed + i)))
    seconds += time.perf_counter() - t0
    outs.append(out.tokens[:real])
    calls += int(out.calls[:real].sum())
    iters += int(out.iterations[:real].sum())
  return np.concatenate(outs), calls, iters, seconds


def run_infill_bench(model, methods, task: str, canvases: np.ndarray, *, judge=None,
                     line_tasks: Sequence[LineTask] | None = None, decode=None,
                     batch_size: int = 8, seed: int = 0) -> list[InfillRow]:
  """Bench `methods` ((name, settings, decoder); the sequential sampler first) on one task."""
  holes = canvases == HOLE
  rows, base_tps, ref_fill, ref_quality = [], None, None, None
  for name, settings, dec in methods:
    t0 = time.perf_counter()
    _fill(model, canvases[:batch_size], dec, batch_size, seed)  # compile + one batch
    warm = time.perf_counter() - t0
    filled, calls, iters, seconds = _fill(model, canvases, dec, batch_size, seed)
    tokens = int(holes.sum())
    tps = tokens / seconds
    base_tps = base_tps or tps
    exact = None
    if dec.sampler.greedy:
      if isinstance(dec, AnyOrder) and ref_fill is None:
        ref_fill = filled
      if ref_fill is not None:
        exact = float(np.mean(np.all(filled == ref_fill, 1)))
    extra = {}
    if task == "generate":
      ppl = generative_perplexity(judge, filled)
      ent = np.array([entropy_bits(r) for r in filled])
      ref_quality = ref_quality or (ppl, ent)
      ref_ppl, ref_ent = ref_quality
      se = lambda x: float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0
      extra = {"gen_ppl": float(ppl.mean()), "gen_ppl_se": se(ppl),
               "gen_ppl_p": welch_p(ppl, ref_ppl), "entropy": float(ent.mean()),
               "entropy_se": se(ent), "entropy_p": welch_p(ent, ref_ent)}
    elif task == "line":
      from paraflax.evaluation.humaneval import passes
      fills = [decode(row[h].tolist()) for row, h in zip(filled, holes)]
      ok = [passes(line_program(t, f)) for t, f in zip(line_tasks, fills)]
      extra = {"pass_at_1": float(np.mean(ok))}
    rows.append(InfillRow(name, task, settings, tokens, calls, iters, tokens / calls,
                          tokens / iters, tps, max(warm - seconds * batch_size / len(canvases), 0),
                          tps / base_tps, exact, **extra))
  return rows


def format_infill_table(rows: Sequence[InfillRow]) -> str:
  """One line per row; p(PPL,H): Welch p-values of gen-PPL and entropy vs the sequential
  sampler (large: no detectable change)."""
  head = (f"{'method':<12} {'task':<9} {'settings':<14} {'tok/call':>8} {'tok/iter':>8} "
          f"{'calls':>6} {'tok/s':>8} {'speedup':>8} {'exact':>6} {'gen-PPL':>14} "
          f"{'entropy':>12} {'p(PPL,H)':>10} {'pass@1':>7}")
  lines = [head, "-" * len(head)]
  for r in rows:
    exact = "-" if r.exact_match_vs_ar is None else f"{r.exact_match_vs_ar:.2f}"
    ppl = "-" if r.gen_ppl is None else f"{r.gen_ppl:.1f}±{r.gen_ppl_se:.1f}"
    ent = "-" if r.entropy is None else f"{r.entropy:.2f}±{r.entropy_se:.2f}"
    p1 = "-" if r.pass_at_1 is None else f"{r.pass_at_1:.2f}"
    welch = "-" if r.gen_ppl_p is None else f"{r.gen_ppl_p:.2f},{r.entropy_p:.2f}"
    lines.append(f"{r.method:<12} {r.task:<9} {r.settings:<14} {r.tokens_per_forward:>8.2f} "
                 f"{r.tokens_per_iteration:>8.2f} {r.calls:>6d} {r.tokens_per_second:>8.1f} "
                 f"{r.speedup_vs_ar:>7.2f}x {exact:>6} {ppl:>14} {ent:>12} {welch:>10} {p1:>7}")
  return "\n".join(lines)
