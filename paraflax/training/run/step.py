"""The pure training step and what builds it: fresh params and optimizer state (sharded on a
mesh when given), the jitted step, the validation loss."""

from __future__ import annotations

import dataclasses
import functools

import jax
import optax
from flax import nnx

from paraflax.model.config import ModelConfig
from paraflax.model.run import RunControl
from paraflax.model.transformer import Block, Transformer
from paraflax.parallel import sharding
from paraflax.training.run import layout
from paraflax.training.run.accumulate import accumulated


def train_step(graphdef, params, opt_state, batch, rng, *, loss_fn, tx, accum: int = 1):
  """One optimizer update. Pure: returns (params, opt_state, metrics of scalars). `accum` > 1
  sums the gradients of that many micro-batches of `batch` (`accumulate.py`): the same update
  as the whole batch at once. `params` and `opt_state` may be stacked by layer (`layout.py`,
  what `train` keeps: the same update in a few kernels) or per layer; they stay as given."""
  if accum > 1:
    loss, metrics, grads = accumulated(getattr(loss_fn, "parts", loss_fn), graphdef, params,
                                       batch, rng, accum)
  else:
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: loss_fn(layout.model_of(graphdef, p), batch, rng), has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}


def eval_step(graphdef, params, batch, rng, *, loss_fn):
  """The objective's loss on one batch (no gradients); `params` in either layout."""
  return loss_fn(layout.model_of(graphdef, params), batch, rng)[0]


def evaluate(model: nnx.Module, batches, loss_fn, rng: jax.Array) -> float:
  """Mean loss of `model` over equally sized `batches` (what validation logs)."""
  graphdef, params = nnx.split(model, nnx.Param)
  step = jax.jit(functools.partial(eval_step, graphdef, loss_fn=loss_fn))
  return mean_loss(step, params, batches, rng)


def mean_loss(step, params, batches, rng) -> float:
  """Mean of `step(params, batch, rng)` over `batches`."""
  total = sum(step(params, b, rng) for b in batches)
  return float(total) / len(batches)


def init_params(model_cfg: ModelConfig, seed: int, mesh=None, run: RunControl = RunControl()):
  """(graphdef, params) of a freshly initialised Transformer computed as `run` says, directly
  sharded on `mesh` when given (the same values as on one device).

  Two programs, each compiled once: the parameters outside the layers (and the layer keys),
  then one layer's initialiser, called once per layer: one layer's samplers are compiled
  whatever the depth, and no stacked copy of the layers is made. The key is threefry, as
  training's: the same values on every backend and mesh, each device drawing its own shard
  (rbg draws whole arrays on every device; at Qwen2.5-0.5B shape on XLA:CPU it compiled ~20%
  faster but ran ~2x slower).
  """
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0), run=run)), nnx.Param)
  out = None if mesh is None else nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))

  def outside(key):
    k_top, k_layers = jax.random.split(key)
    one_layer = dataclasses.replace(model_cfg, n_layers=1)
    tree = nnx.to_pure_dict(nnx.state(Transformer(one_layer, rngs=nnx.Rngs(params=k_top)),
                                      nnx.Param))
    del tree["layers"]  # built and dropped: XLA removes its work
    return tree, jax.random.split(k_layers, model_cfg.n_layers)

  def layer(keys, i):
    return nnx.to_pure_dict(nnx.state(Block(model_cfg, nnx.Rngs(params=keys[i])), nnx.Param))

  tree, keys = jax.jit(outside, out_shardings=out and (
      {k: v for k, v in out.items() if k != "layers"}, sharding.replicated(mesh)))(
          jax.random.key(seed))
  draw_layer = jax.jit(layer, out_shardings=out and out["layers"][0])
  tree["layers"] = {i: draw_layer(keys, i) for i in range(model_cfg.n_layers)}
  params = jax.tree.map(lambda x: x, abstract)  # a fresh State to fill
  nnx.replace_by_pure_dict(params, tree)
  return graphdef, params


def stack_params(params, mesh=None):
  """`layout.stack(params)`, the layout `train` keeps (one array per kind of layer
  parameter), sharded by `sharding.state_shardings` when `mesh` is given."""
  out = None if mesh is None else sharding.state_shardings(
      jax.eval_shape(layout.stack, params), mesh)
  return jax.jit(layout.stack, out_shardings=out)(params)


def init_opt_state(tx: optax.GradientTransformation, params, mesh=None):
  """`tx.init(params)`, sharded like the params it mirrors when `mesh` is given."""
  if mesh is None:
    return tx.init(params)
  out = sharding.state_shardings(jax.eval_shape(tx.init, params), mesh)
  return jax.jit(tx.init, out_shardings=out)(params)


def jit_train_step(graphdef, loss_fn, tx, mesh=None, params=None, opt_state=None, accum=1):
  """`train_step` jitted with params and optimizer state donated; on a mesh their output
  shardings are pinned to those of `params` / `opt_state` (so every step compiles alike) and
  it is traced under the mesh (activations split over the batch axes)."""
  out = None
  if mesh is not None:
    out = (sharding.state_shardings(params, mesh), sharding.state_shardings(opt_state, mesh),
           sharding.replicated(mesh))
  step = functools.partial(train_step, graphdef, loss_fn=loss_fn, tx=tx, accum=accum)
  return jax.jit(sharding.traced_on(mesh, step), donate_argnums=(0, 1), out_shardings=out)


def keys(seed: int):
  """(per-step training, validation) keys, derived from the seed."""
  return jax.random.split(jax.random.key(seed), 2)
