"""The programs `perf compile` compiles for a target, on abstract inputs placed on the
target's devices: a training step (`train --dry-run`'s `lower_step`) and a generate loop
(`pf.generate_fn`). Each returns the compiled program's HLO text, XLA's memory analysis and
what its rows need to read the text."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from paraflax.parallel import sharding
from paraflax.perf.compile import targets


@dataclasses.dataclass(frozen=True)
class Compiled:
  text: str  # the optimised HLO module
  memory: dict  # XLA's memory analysis, bytes per device (`dry_run.memory_report`)
  compile_s: float  # lowering and compilation
  fit: tuple = ()  # a training step's memory candidates tried, least recompute first (`fit`)


def mesh_of(target: targets.Target, fsdp: bool = True) -> Mesh:
  """The (data, fsdp, tensor) mesh over the target's devices: FSDP over all of them (a
  training step), or data parallel (`fsdp=False`: a decode loop's rows)."""
  devs = np.array(targets.devices(target))
  shape = (1, devs.size, 1) if fsdp else (devs.size, 1, 1)
  return Mesh(devs.reshape(shape), sharding.AXES, axis_types=(AxisType.Auto,) * 3)


def _compile(lower, target: targets.Target, mesh: Mesh | None = None) -> Compiled:
  """Lower (under `mesh`, when given) and compile for `target`."""
  from paraflax.training.run.dry_run import memory_report
  t0 = time.perf_counter()
  with targets.compiling_for(target), sharding.use_mesh(mesh):
    compiled = lower().compile(targets.compiler_options(target))
  memory = memory_report(compiled)
  return Compiled(compiled.as_text(), memory, time.perf_counter() - t0)


def train_step(cfg, target: targets.Target):
  """(the compiled training step of `cfg` on the target's mesh, the config it compiled:
  its run control resolved for the target's platform, its "auto" memory choices made by
  XLA's memory analysis against the target's memory, `dry_run.fit_to_device`, whose
  candidates are `Compiled.fit`). The compile time counts every candidate the fit compiled."""
  from paraflax.training.run.dry_run import fit_to_device, lower_step, memory_report
  mesh = mesh_of(target)  # the step is traced on it (`jit_train_step`)
  t0 = time.perf_counter()
  with targets.compiling_for(target):
    options = targets.compiler_options(target)
    cfg, tried, compiled = fit_to_device(cfg, mesh, target.capacity, options)
    compiled = compiled or lower_step(cfg, mesh)[0].compile(options)
  return Compiled(compiled.as_text(), memory_report(compiled), time.perf_counter() - t0,
                  tuple(tried)), cfg


def abstract_model(cfg, run):
  """A model of `cfg` with abstract weights (`nnx.eval_shape`)."""
  from flax import nnx

  from paraflax.model.transformer import Transformer
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), run=run))


def decode_loop(model, decoder, batch: int, prompt_len: int, new_tokens: int,
                steps_per_iter: int, target: targets.Target, draft_model=None) -> Compiled:
  """`pf.generate_fn`'s loop of `decoder` for `batch` rows of `prompt_len` prompt tokens and
  `new_tokens` new ones, `steps_per_iter` steps per loop iteration, weights in the compute
  dtype, on the target's devices (rows split over them)."""
  from flax import nnx

  from paraflax.decoding.core import generate_fn
  mesh = mesh_of(target, fsdp=False)
  fn = generate_fn(model, decoder, new_tokens, eos_id=None, draft_model=draft_model,
                   steps_per_iter=steps_per_iter)

  def weights(m):
    return None if m is None else sharding.abstract_state(nnx.state(m), mesh)

  def lower():
    batch_spec = sharding.batch_sharding((batch, prompt_len), mesh)
    args = (weights(model), jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32,
                                                 sharding=batch_spec),
            jax.ShapeDtypeStruct((batch,), jnp.int32,
                                 sharding=sharding.batch_sharding((batch,), mesh)),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh)),
            weights(draft_model))
    return jax.jit(fn).lower(*args)

  return _compile(lower, target, mesh)
