"""`paraflax perf train`: one training step per objective at a shape, warm: step time,
tokens/s, FLOPs per token and MFU, with the run control the step compiled with.

Each objective's shipped recipe (`RECIPES`) is resized to the shape (compute in `dtype`,
parameters float32), batch `batch` x `seq_len` tokens (halved until XLA's memory analysis
fits the device), fed a synthetic batch of its data source (`batches.synthetic_batch`), and
stepped by the trainer's own `jit_train_step` with `optim.optimizer`.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from paraflax.devices import peak_flops
from paraflax.model.run import FIELDS as RUN_FIELDS
from paraflax.perf.batches import row_args
from paraflax.perf.shapes import shape_fields
from paraflax.training.run import flops

# objective -> the recipe (`paraflax/recipes/<name>.py`) perf resizes
RECIPES = {"ar": "tiny_ar", "jacobi_forcing": "jacobi_forcing_r1", "tidar": "tidar_scratch",
           "deer_stage1": "deer_drafter_stage1", "deer_stage2": "deer_drafter", "asarm": "asarm"}
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class TrainPlan:
  shape: str = "qwen2.5-0.5b"
  layers: int | None = None
  dtype: str = "bfloat16"  # compute; parameters stay float32
  objectives: tuple = tuple(RECIPES)
  batch: int = 1
  seq_len: int = 4096  # halved until the step fits (not below 256)
  steps: int = 5  # timed steps (best of)
  attention: str | None = None  # run control; None: the recipe's ("auto")
  remat: str | None = None
  scan_layers: bool | str | None = None
  max_gib: float | None = None  # a step needing more is not run (None: the device's memory)
  profile: str | None = None  # a directory: one traced step per objective, its summary in the row


def recipe(objective: str, plan: TrainPlan, seq_len: int):
  """The objective's recipe at the plan's shape, batch, `seq_len` and run control."""
  from paraflax.training.config.train import apply_overrides, load_config
  sets = {f"model.{k}": v for k, v in shape_fields(plan.shape, plan.layers).items()}
  sets.update({"model.dtype": plan.dtype, "model.param_dtype": "float32",
               "data.seq_len": seq_len, "data.batch_size": plan.batch,
               **{f"run.{k}": getattr(plan, k) for k in RUN_FIELDS
                  if getattr(plan, k, None) is not None}})
  cfg = apply_overrides(load_config(RECIPES[objective]), sets)
  return cfg.with_fixed_args(row_args(cfg.data_source, seq_len))  # as a store fixes a run's


def run_control(cfg) -> dict:
  """The run control a training step of `cfg` compiles with, "auto" resolved."""
  from paraflax.training.objectives.head_loss import chunk_size
  d, run = cfg.data, cfg.run
  return {**run.resolved(cfg.model, d.seq_len),
          "loss_chunk": chunk_size(run.loss_chunk, d.batch_size, d.seq_len, cfg.model.vocab_size),
          "grad_accum": cfg.grad_accum}


def memory_limit_gib() -> float:
  """Memory one step may use: the device's limit, or half this host's RAM on a CPU."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] / GIB
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 / GIB


def measure_step(cfg, steps: int, max_gib: float, compiled=None, profile=None) -> dict:
  """Init, compile (unless `compiled`, the step already compiled for these shapes) and run
  `steps` training steps of `cfg` on a synthetic batch: the figures (`step_s`: the fastest
  step), or {"skipped": why} when XLA needs more than `max_gib`. With `profile` (a directory)
  one more step is traced there: `trace` is its summary (`perf.trace.profiled`), whose
  `device_events` are the kernels the step ran."""
  import jax

  from paraflax.perf.batches import synthetic_batch
  from paraflax.training.objectives.protocol import objective
  from paraflax.training.run import optim
  from paraflax.training.run.dry_run import memory_report
  from paraflax.training.run.step import (init_opt_state, init_params, jit_train_step,
                                          stack_params)
  graphdef, params = init_params(cfg.model, seed=0, run=cfg.run)
  params = stack_params(params)  # the layout `train` keeps (`training/run/layout.py`)
  tx = optim.optimizer(cfg.optim, cfg.schedule_steps)
  opt_state = jax.block_until_ready(init_opt_state(tx, params))
  batch = {k: jax.numpy.asarray(v) for k, v in synthetic_batch(cfg).items()}
  key = jax.random.key(0)
  step = jit_train_step(graphdef, objective(cfg.objective).bind(cfg.objective_args), tx)
  t0 = time.perf_counter()
  fresh = compiled is None
  compiled = compiled or step.lower(params, opt_state, batch, key).compile()
  report = {"params": int(sum(x.size for x in jax.tree.leaves(params))),
            "compile_s": time.perf_counter() - t0 if fresh else None}
  need = memory_report(compiled).get("total_bytes", 0) / GIB
  report["xla_gib"] = need
  if need > max_gib:
    return {**report, "skipped": f"XLA needs {need:.1f} GiB > {max_gib:.1f}"}
  before = [np.asarray(x.ravel()[:256]) for x in jax.tree.leaves(params)]
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    params, opt_state, metrics = jax.block_until_ready(compiled(params, opt_state, batch, key))
    times.append(time.perf_counter() - t0)
    if len(times) == 1:  # the first step's effect: parameters moved, loss and grad norm
      moved = sum(not np.array_equal(a, np.asarray(x.ravel()[:256]))
                  for a, x in zip(before, jax.tree.leaves(params)))
      first = {k: float(v) for k, v in jax.device_get(metrics).items()}
  if profile:
    from pathlib import Path

    from paraflax.perf.trace import profiled
    state = [params, opt_state]

    def one_step():  # the step donates its state: carry the new one
      state[:] = compiled(*state, batch, key)[:2]
      return state
    report["trace"] = profiled(one_step, Path(profile), f"train_{cfg.objective}")
  return {**report, "step_s": min(times), "first_step_s": times[0], "loss": first["loss"],
          "grad_norm": first["grad_norm"], "params_moved": f"{moved}/{len(before)}",
          "finite": bool(np.isfinite(first["loss"]) and np.isfinite(first["grad_norm"]))}


def run(plan: TrainPlan, add, log) -> list[str]:
  """One row per objective (`add` takes each as it is measured); the errors of the
  objectives that failed or fit at no length (the others still run)."""
  import jax

  from paraflax.training.run.dry_run import fit_to_device
  unknown = [o for o in plan.objectives if o not in RECIPES]
  if unknown:
    raise ValueError(f"unknown objective {unknown[0]!r}: pick from {', '.join(RECIPES)}")
  shape_fields(plan.shape)  # an unknown shape: one line before any work
  device = jax.devices()[0].device_kind
  max_gib = plan.max_gib or memory_limit_gib()
  errors = []
  for name in plan.objectives:
    seq = plan.seq_len
    try:
      while True:
        t0 = time.perf_counter()
        cfg, _, compiled = fit_to_device(recipe(name, plan, seq))  # "auto" memory choices
        fit_s = time.perf_counter() - t0
        r = measure_step(cfg, plan.steps, max_gib, compiled, plan.profile)
        if compiled is not None:  # compiled while fitting: every candidate counted
          r["compile_s"] = fit_s
        if "skipped" not in r or seq <= 256:
          break
        log(f"[train] {name} at {seq} tokens: {r['skipped']}; halving")
        seq //= 2
    except Exception as e:  # one objective's failure is a finding; the others still run
      errors.append(f"train: {name}: {type(e).__name__}: {e}"[:400])
      log(errors[-1])
      continue
    if "skipped" in r:
      errors.append(f"train: {name} fits at no length down to {seq}: {r['skipped']}")
      log(errors[-1])
      continue
    tokens_per_s = plan.batch * seq / r["step_s"]
    per_token = flops.comparison_flops_per_token(cfg.model, seq)
    real = flops.train_flops(cfg.model, cfg.objective, 1, seq, cfg.objective_args) / seq
    peak = peak_flops(device)
    row = add({"kind": "train", "shape": plan.shape, "dtype": plan.dtype,
               "layers": cfg.model.n_layers, "objective": name,
               "recipe": RECIPES[name], "batch": plan.batch, "seq_len": seq,
               "defaults": all(getattr(plan, k) is None for k in ("attention", "remat",
                                                                   "scan_layers")),
               **run_control(cfg), **r, "tokens_per_s": tokens_per_s,
               "flops_per_token": per_token, "tflops_per_s": per_token * tokens_per_s / 1e12,
               "mfu": flops.mfu(per_token * tokens_per_s, 1.0, peak=peak),
               "real_flops_per_token": real,
               "mfu_real": flops.mfu(real * tokens_per_s, 1.0, peak=peak)})
    log(f"[train] {name}: {row['step_s']:.3f} s/step, {tokens_per_s:.0f} tokens/s, "
        f"MFU {'-' if row['mfu'] is None else format(row['mfu'], '.1%')}")
  return errors
