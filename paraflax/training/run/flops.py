"""Training FLOPs per step, counted from each objective's real work, and MFU.

`train_flops(model_cfg, objective, batch, seq_len, args)` is the one count: the model FLOPs of
one optimizer step (forward + backward) of `batch` rows of `seq_len` data tokens. It counts the
matmuls (elementwise work, the embedding gather and the optimizer update are left out, as usual)
of what the objective feeds the model (`Work`: TiDAR's doubled row, Jacobi Forcing's packed
noisy + clean row, DEER's blocks, the AS-ARM's query stream), with
attention over the (query, key) pairs its mask allows: what an attention kernel that skips
masked keys must compute. Rematerialisation is not counted (model FLOPs, not hardware FLOPs),
so MFU compares run controls fairly.

Per row, D = d_model, Dq = n_heads x head_dim, Dkv = n_kv_heads x head_dim, F = d_ff:
    every row, per layer:            2 D Dq (q) + 2 Dq D (o) + 6 D F (gate, up, down)
    content rows, per layer:         4 D Dkv (k, v)
    each allowed (q, k) pair, layer: 4 Dq (scores and weighted values)
    head rows:                       2 D V
Training counts 3x the forward (the backward does two matmuls per forward matmul).

`comparison_flops_per_token` is the cross-run yardstick of issue 34's tables: 6 N + 6 L D T
per data token (N without the embedding lookup when untied). `mfu` divides achieved FLOP/s by
a device's bf16 dense peak (`devices.peak_flops`; None where unknown, e.g. CPU).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from paraflax.model.config import ModelConfig


def tflops_per_device(flops: float, seconds: float, devices: int = 1) -> float:
  """Achieved TFLOP/s per device: `flops` done by `devices` together in `seconds`."""
  return flops / max(seconds, 1e-12) / devices / 1e12


def mfu(flops: float, seconds: float, devices: int = 1, peak: float | None = None) -> float | None:
  """Model FLOPs utilisation flops / (seconds x devices x peak); None where `peak` is None."""
  return None if peak is None else tflops_per_device(flops, seconds, devices) * 1e12 / peak


def speed(flops_per_step: float | None, steps_per_s: float, devices: int = 1,
          peak: float | None = None) -> dict[str, float | None]:
  """A training log's `tflops_per_device` and `mfu` at `steps_per_s` (None where the step's
  FLOPs or the peak are unknown)."""
  if flops_per_step is None:
    return {"tflops_per_device": None, "mfu": None}
  seconds = 1.0 / max(steps_per_s, 1e-12)
  return {"tflops_per_device": tflops_per_device(flops_per_step, seconds, devices),
          "mfu": mfu(flops_per_step, seconds, devices, peak)}


@dataclasses.dataclass(frozen=True)
class Work:
  """What one row of the batch makes the model compute (per step, forward)."""

  rows: int  # rows through the layers: each runs q, o and the MLP
  kv_rows: int  # the content rows among them, which also make keys and values
  pairs: float  # (query, key) pairs the mask allows, summed over rows (expected, if drawn)
  head_rows: int  # rows through the output head


def forward_flops(cfg: ModelConfig, work: Work) -> float:
  """FLOPs of one row's forward, by the module formulas."""
  d, dh, v = cfg.d_model, cfg.dim_per_head, cfg.vocab_size
  dq, dkv = cfg.n_heads * dh, cfg.n_kv_heads * dh
  layer = work.rows * (4 * d * dq + 6 * d * cfg.d_ff) + work.kv_rows * 4 * d * dkv
  layer += work.pairs * 4 * dq
  return cfg.n_layers * layer + work.head_rows * 2 * d * v


def train_flops(cfg: ModelConfig, objective: str, batch: int, seq_len: int,
                args: Any = (), *, prompt_len: int = 0) -> float | None:
  """Model FLOPs of one training step (forward + backward) of `objective` (its `args` over its
  defaults) on `batch` rows of `seq_len`, or None for an objective with no `WORK` entry.

  `prompt_len`: the prompt part of Jacobi Forcing's packed rows and of DEER's teacher rows
  (a store's max_prompt_len; 0: all blocks / answer); Jacobi Forcing's and DEER Stage I's own
  `prompt_len` argument, where given, instead."""
  work = objective_work(cfg, objective, seq_len, args, prompt_len=prompt_len)
  if work is None:
    return None
  return batch * 3 * forward_flops(cfg, work)


def objective_work(cfg: ModelConfig, objective: str, seq_len: int, args: Any = (), *,
                   prompt_len: int = 0) -> Work | None:
  """One row's `Work` under `objective` with its `args` over the loss's defaults."""
  if objective not in WORK:
    return None
  from paraflax.training.objectives.protocol import objective as registered
  params = inspect.signature(registered(objective).loss).parameters
  defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
  return WORK[objective](cfg, seq_len, {**defaults, **dict(args)}, prompt_len)


def param_count(cfg: ModelConfig, embedding: bool = True) -> int:
  """Parameters of a `Transformer` of `cfg`; without `embedding`, less the input embedding
  table when it is not also the head (untied)."""
  d, dh, f, v = cfg.d_model, cfg.dim_per_head, cfg.d_ff, cfg.vocab_size
  dq, dkv = cfg.n_heads * dh, cfg.n_kv_heads * dh
  layer = 2 * d * dq + 2 * d * dkv + 3 * d * f + 2 * d  # q, o, k, v, MLP, two norms
  layer += (dq + 2 * dkv) * cfg.qkv_bias + 2 * dh * cfg.qk_norm
  table = v * d if embedding or cfg.tie_embeddings else 0
  return (cfg.n_layers * layer + table + d + v * d * (not cfg.tie_embeddings)
          + d * cfg.two_stream)


def comparison_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Issue 34's yardstick per data token: 6 N + 6 L D T (N = `param_count` without
  the embedding lookup when untied, L layers, D = d_model, T = seq_len)."""
  return 6 * param_count(cfg, embedding=False) + 6 * cfg.n_layers * cfg.d_model * seq_len


# ---- each objective's work (module docstring; `masks.py` for the masks counted) ----

def _causal_pairs(n: float) -> float:
  return n * (n + 1) / 2


def _ar(cfg, t, args, prompt_len):
  """Causal rows of T tokens (packed rows are full); the head on the T-1 that have a target."""
  return Work(t, t, _causal_pairs(t), t - 1)


def _tidar(cfg, t, args, prompt_len):
  """The doubled row [clean | mask copy]: 2T rows, the head on all; the clean half causal;
  mask block j (size s_j, start j b) sees itself and the j b clean tokens before it; block
  sizes drawn uniformly from `block_size`."""
  sizes = np.atleast_1d(args["block_size"])
  pairs = [sum(min(b, t - s) * (min(b, t - s) + s) for s in range(0, t, b)) for b in sizes]
  return Work(2 * t, 2 * t, _causal_pairs(t) + float(np.mean(pairs)), 2 * t)


def _jacobi_forcing(cfg, t, args, prompt_len):
  """[prompt P, noisy stream, clean stream] of T: the prompt causal; each of the two streams of
  M = (T - P) // 2 tokens sees the prompt and itself causally; a padding row the prompt and
  itself. The head on the prompt region's P rows and both streams' (the clean rows' logits are
  the soft consistency's teacher: no row projected twice)."""
  p = prompt_len if args["prompt_len"] is None else args["prompt_len"]
  m = (t - p) // 2
  pairs = _causal_pairs(p) + 2 * (m * p + _causal_pairs(m)) + (t - p - 2 * m) * (p + 1)
  return Work(t, t, pairs, p + 2 * m)


def _asarm(cfg, n, args, prompt_len):
  """Two streams of N rows (the query stream makes no keys/values; the head reads it). With m
  prompt tokens, the prompt rows of both streams see the m prompt keys and the i-th target
  the prompt and i (content) or i - 1 (query) targets: 2 m N + (N - m)^2 pairs
  (`masks.lattice`), averaged over masking rates uniform in `rate_end` (the curriculum's end,
  where runs spend their steps; m = round((1 - r) N) in [1, N-1], as `asarm.lattice_visible`)."""
  lo, hi = args["rate_end"]
  rates = lo + (hi - lo) * (np.arange(1024) + 0.5) / 1024
  m = np.clip(np.round((1.0 - rates) * n), 1, n - 1)
  return Work(2 * n, n, float(np.mean(2 * m * n + (n - m) ** 2)), n)


def _cuts(w: int, prompt_len: int, r: int) -> tuple[float, float]:
  """(E[c], E[c^2]) of a cut c = P + u, u uniform in 0..A-r (A = W - P answer tokens)."""
  k = w - prompt_len - r
  mean_u, mean_u2 = k / 2, k * (2 * k + 1) / 6
  return prompt_len + mean_u, prompt_len ** 2 + 2 * prompt_len * mean_u + mean_u2


def _deer_stage1(cfg, w, args, prompt_len):
  """Rows of W + 1 (SEP inserted) cut after c = P + u tokens, u uniform in 0..A-1 (full rows):
  the prefix causal (bidirectional drafter: c^2), the W + 1 - c block rows see every key."""
  c, c2 = _cuts(w, prompt_len if args["prompt_len"] is None else args["prompt_len"], 1)
  prefix = c2 if cfg.drafter_prefix == "bidirectional" else (c2 + c) / 2
  return Work(w + 1, w + 1, prefix + (w + 1) * (w + 1 - c), w + 1)


def _deer_stage2(cfg, w, args, prompt_len):
  """Full rows of W clean tokens (causal) + `blocks` blocks of S = max_masked + 1 slots; a
  block of R ~ U(1..min(max_masked, A)) masks after a cut c = P + U(0..A-R): each of its S
  slots sees the c clean tokens and the R + 1 valid slots, a padding slot itself too
  (`masks.tidar`). A bidirectional drafter gets one row of W + S per block instead: its c
  clean tokens see each other, the W - c padding ones those c and themselves."""
  nb, s = args["blocks"], args["max_masked"] + 1
  rs = np.arange(1, min(args["max_masked"], w - prompt_len) + 1)
  c = np.array([_cuts(w, prompt_len, r)[0] for r in rs])
  block = float(np.mean(s * (c + rs + 1) + s - rs - 1))
  if cfg.drafter_prefix == "bidirectional":
    clean = float(np.mean((w - 1) * c + w))  # c^2 + (W - c)(c + 1): linear in c
    return Work(nb * (w + s), nb * (w + s), nb * (clean + block), nb * (w + s))
  rows = w + nb * s
  return Work(rows, rows, _causal_pairs(w) + nb * block, rows)


WORK: dict[str, Callable[[ModelConfig, int, Mapping, int], Work]] = {
    "ar": _ar, "tidar": _tidar, "jacobi_forcing": _jacobi_forcing, "asarm": _asarm,
    "deer_stage1": _deer_stage1, "deer_stage2": _deer_stage2}
