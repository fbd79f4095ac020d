"""`train --dry-run`: compile one training step of a config on its mesh with abstract shapes
and report XLA's memory analysis, without allocating weights or opening any data.

Params (`nnx.eval_shape`), optimizer state (`jax.eval_shape(tx.init)`), the batch (the data
source's fields at `data.batch_size` x `data.seq_len`, `source.batch_shapes`, plus `"step"`
when the objective reads it) and the key are `jax.ShapeDtypeStruct`s carrying their shardings
on the config's mesh; `jit_train_step(...).lower(...).compile()` is the step `train` runs.
No store, `init_from` or workdir is read or written, so a 7B dry run fits a laptop.

    report = dry_run(cfg)   # {"params", "devices", "argument_bytes", "temp_bytes", ...}

Byte figures are per device (what one device holds of the sharded step); `flops_per_step` is
the whole step's model FLOPs (`flops.train_flops`, all devices together; None for an objective
it does not know).
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
from flax import nnx

from paraflax.data.source import batch_shapes
from paraflax.model.transformer import Transformer
from paraflax.parallel import sharding
from paraflax.training.config.train import TrainConfig, apply_overrides, load_config
from paraflax.training.objectives.protocol import STEP, objective
from paraflax.training.run import fit, flops, layout, optim
from paraflax.training.run.step import jit_train_step

# report key -> CompiledMemoryStats attribute
MEMORY = {"argument_bytes": "argument_size_in_bytes", "output_bytes": "output_size_in_bytes",
          "temp_bytes": "temp_size_in_bytes", "alias_bytes": "alias_size_in_bytes",
          "generated_code_bytes": "generated_code_size_in_bytes"}


def _abstract(shape, dtype, sharding_):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)


def abstract_batch(cfg: TrainConfig, mesh=None) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch `train` feeds its step, as shapes: the source's fields (`batch_shapes`) and
  `"step"` (int32 [B]) when the objective reads it; split over the mesh's batch axes."""
  shapes = dict(batch_shapes(cfg.source, cfg.data))
  if objective(cfg.objective).needs_step:
    shapes[STEP] = ((cfg.data.batch_size,), np.dtype(np.int32))
  place = (lambda s: None) if mesh is None else (lambda s: sharding.batch_sharding(s, mesh))
  return {k: _abstract(s, d, place(s)) for k, (s, d) in shapes.items()}


def abstract_state(cfg: TrainConfig, mesh=None):
  """(graphdef, params, tx, opt_state) with every array a `ShapeDtypeStruct` (sharded on
  `mesh` as `train` shards them), params and optimizer state stacked by layer as `train`
  keeps them (`layout.py`): nothing allocated."""
  graphdef, params = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), run=cfg.run)), nnx.Param)
  params = jax.eval_shape(layout.stack, params)
  tx = optim.optimizer(cfg.optim, cfg.schedule_steps)
  opt_state = jax.eval_shape(tx.init, params)
  if mesh is not None:
    params, opt_state = (sharding.abstract_state(t, mesh) for t in (params, opt_state))
  return graphdef, params, tx, opt_state


def memory_report(compiled) -> dict[str, int]:
  """Bytes per device of a compiled function (`MEMORY` keys the backend reports) and
  `total_bytes` = arguments + outputs - aliased (donated) + temporaries."""
  stats = compiled.memory_analysis()
  memory = {k: int(getattr(stats, a)) for k, a in MEMORY.items()
            if stats is not None and getattr(stats, a, None) is not None}
  if {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"} <= set(memory):
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"]
                             - memory["alias_bytes"] + memory["temp_bytes"])
  return memory


def lower_step(cfg: TrainConfig, mesh=None):
  """(the lowered training step of `cfg` on `mesh` (None: one device), its abstract params,
  its abstract batch): `jit_train_step(...).lower(...)` on `ShapeDtypeStruct`s. `mesh` may be
  one of a compile target's abstract devices (`perf compile`)."""
  graphdef, params, tx, opt_state = abstract_state(cfg, mesh)
  batch = abstract_batch(cfg, mesh)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = _abstract(key.shape, key.dtype, None if mesh is None else sharding.replicated(mesh))
  step = jit_train_step(graphdef, objective(cfg.objective).bind(cfg.objective_args), tx, mesh,
                        params, opt_state, cfg.grad_accum)
  return step.lower(params, opt_state, batch, key), params, batch


def fit_to_device(cfg: TrainConfig, mesh=None, capacity: int | None = None,
                  compiler_options: dict | None = None):
  """(`cfg` with its "auto" memory choices made by `fit.fitted`, the candidates tried, the
  chosen step compiled or None): each candidate compiled on `mesh` with abstract shapes (and
  XLA's `compiler_options`, `jax.stages.Lowered.compile`'s), against `capacity` bytes per
  device (None: this process's device; on the CPU, which reports none, `cfg` is returned as
  it is)."""
  compiled = []  # (candidate, its compiled step)

  def memory_of(c):
    compiled.append((c, lower_step(c, mesh)[0].compile(compiler_options)))
    return memory_report(compiled[-1][1])
  cfg, tried = fit.fitted(cfg, memory_of, fit.device_memory() if capacity is None else capacity)
  return cfg, tried, next((step for c, step in reversed(compiled) if c == cfg), None)


def dry_run(cfg: TrainConfig) -> dict:
  """Compile one training step of `cfg` (abstract shapes, on its mesh) and return its
  report: params (count), devices, mesh, objective, batch_size, seq_len, memory per device
  (`MEMORY` keys, bytes, from `compiled.memory_analysis()`; `total_bytes` = arguments +
  outputs - aliased (donated) + temporaries), the run control with "auto" resolved (on an
  accelerator by `fit_to_device`: `fit` lists the candidates tried), flops_per_step, lower_s
  and compile_s (fitting, lowering and XLA compilation)."""
  mesh = None if cfg.mesh is None else sharding.resolve_mesh(cfg.mesh)  # fits the devices?
  t0 = time.perf_counter()
  cfg = cfg.with_row_args(missing_ok=True)  # the rows' layout, where a store gives it
  cfg, tried, compiled = fit_to_device(cfg, mesh)
  lowered, params, batch = lower_step(cfg, mesh)
  t1 = time.perf_counter()
  compiled = compiled or lowered.compile()
  t2 = time.perf_counter()
  return {"objective": cfg.objective, "data_source": cfg.data_source,
          "params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
          "devices": 1 if mesh is None else mesh.size,
          "mesh": None if mesh is None else dict(mesh.shape),
          "platform": jax.devices()[0].platform,
          "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
          "grad_accum": cfg.grad_accum,
          "batch": {k: [list(v.shape), str(v.dtype)] for k, v in batch.items()},
          "model_dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype,
          **memory_report(compiled),
          "run_control": {**cfg.run.resolved(cfg.model, cfg.data.seq_len),
                          "loss_chunk": cfg.run.loss_chunk}, "fit": tried,
          "flops_per_step": flops.train_flops(cfg.model, cfg.objective, cfg.data.batch_size,
                                              cfg.data.seq_len, cfg.objective_args),
          "lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t0, 3)}


def dry_run_from_config_path(config_path, overrides: dict | None = None) -> dict:
  """`dry_run` of a config file's `get_config()` with dotted `overrides` applied."""
  return dry_run(apply_overrides(load_config(config_path), overrides))
