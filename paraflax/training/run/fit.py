"""The run control's memory choices made by XLA's memory analysis of the step actually trained.

On an accelerator, `fitted(cfg, memory_of, capacity)` compiles the training step of `cfg`
(abstract shapes: `dry_run.lower_step`) with each candidate in turn, least recompute first,
and keeps the first whose memory (arguments + outputs - donated + temporaries, per device)
fits `HEADROOM` of the device's memory (a step XLA refuses to compile for want of memory, as
XLA:TPU does, fits not):

  1. remat "none", the loss head over the whole row (`WHOLE_ROW`) at once, then in chunks
     (`loss_chunk` auto: `head_loss.chunk_size`; `weighted_nll`'s chunks recompute nothing,
     Jacobi Forcing's recompute each chunk's logits in the backward pass);
  2. the same two with remat "save_matmuls", then "full"; where "full" is the first that
     fits and no remat compiled but did not fit, "full" on the first k layers only
     (`RunControl.remat_layers`), k estimated from the two steps' memory, is compiled and
     kept if it fits (TiDAR on a TPU v5e: no remat 14.6 GiB of the 14.4 allowed);
  3. none fits: twice the micro-batches (`grad_accum`), the candidates again.

Only what the config leaves "auto" (`run.remat`, `run.loss_chunk` None) is chosen; a set
value is kept. Micro-batches change no update (`accumulate.py`). On the CPU (no memory figure)
and when nothing is "auto" the config is returned as it is, so "auto" keeps its static rules
(`RunControl.remat_policy`, `head_loss.chunk_size`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import jax

from paraflax.model.run import RunControl
from paraflax.training.config.train import TrainConfig

HEADROOM = 0.9  # of the device memory: room for what XLA's analysis does not count (workspaces)
WHOLE_ROW = 2**30  # a loss chunk longer than any row: the head over the whole row at once
REMATS = ("none", "save_matmuls", "full")  # least recompute first


def candidates(run: RunControl) -> Iterator[RunControl]:
  """The run controls to try, least recompute first (module docstring); "auto" fields only."""
  remats = REMATS if run.remat == "auto" else (run.remat,)
  chunks = (WHOLE_ROW, None) if run.loss_chunk is None else (run.loss_chunk,)
  for remat in remats:
    for chunk in chunks:
      yield dataclasses.replace(run, remat=remat, loss_chunk=chunk)


def _partial(cfg: TrainConfig, full: TrainConfig, tried: list[dict],
             limit: float) -> TrainConfig | None:
  """Remat "full" on the first k layers only, where `full` (remat "full" on every layer) is
  the first candidate that fits and no remat compiled at this micro-batch count but did not
  fit: k from the two totals as if each layer's share were equal (one compile checks it),
  with no remat's loss chunk. None where there is nothing to estimate from or k is every
  layer."""
  if full.run.remat != "full" or full.run.remat_layers is not None:
    return None
  none = [t for t in tried if t["remat"] == "none" and t["grad_accum"] == full.grad_accum
          and t["total_bytes"] is not None]
  if not none:
    return None
  t0, t1, n = none[-1]["total_bytes"], tried[-1]["total_bytes"], cfg.model.n_layers
  k = math.ceil(n * (t0 - limit) / (t0 - t1)) if t0 > t1 else n
  if k >= n:
    return None
  run = dataclasses.replace(full.run, remat_layers=k, loss_chunk=none[-1]["loss_chunk"])
  return dataclasses.replace(full, run=run)


def out_of_memory(error: Exception) -> bool:
  """Whether a compile failed for want of device memory (XLA:TPU's compile-time OOM)."""
  return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def device_memory() -> int | None:
  """Bytes of memory of the first local device; None where the backend reports none (CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else stats.get("bytes_limit")


def fitted(cfg: TrainConfig, memory_of: Callable[[TrainConfig], dict],
           capacity: int | None) -> tuple[TrainConfig, list[dict]]:
  """(`cfg` with its "auto" memory choices made, the candidates tried: run control, grad_accum,
  total bytes, fits). `memory_of(cfg)` compiles cfg's step and returns its memory report
  (`dry_run.memory_report`: `total_bytes`); `capacity` is the device's bytes (None: keep
  `cfg`). Raises a one-line ValueError when not even one row per micro-batch fits."""
  if capacity is None or (cfg.run.remat != "auto" and cfg.run.loss_chunk is not None):
    return cfg, []
  tried, accum = [], cfg.grad_accum
  rows, limit = cfg.data.batch_size, HEADROOM * capacity

  def fits(trial: TrainConfig) -> bool:
    try:
      total = memory_of(trial)["total_bytes"]
    except Exception as e:  # XLA:TPU refuses to compile a step that cannot fit
      if not out_of_memory(e):
        raise
      total = None
    run = trial.run
    tried.append({"remat": run.remat, "remat_layers": run.remat_layers,
                  "loss_chunk": run.loss_chunk, "grad_accum": trial.grad_accum,
                  "total_bytes": total, "fits": total is not None and total <= limit})
    return tried[-1]["fits"]

  while True:
    for run in candidates(cfg.run):
      trial = dataclasses.replace(cfg, run=run, grad_accum=accum)
      if fits(trial):
        partial = _partial(cfg, trial, tried, limit) if cfg.run.remat == "auto" else None
        return (partial if partial is not None and fits(partial) else trial), tried
    if rows % (2 * accum):
      need = tried[-1]["total_bytes"]
      need = "more" if need is None else f"{need / 2**30:.1f} GiB"
      raise ValueError(f"the training step does not fit {HEADROOM:.0%} of "
                       f"{capacity / 2**30:.1f} GiB per device even with remat "
                       f"'{tried[-1]['remat']}' and {accum} micro-batches of "
                       f"{rows // accum} rows: {need}")
    accum *= 2
