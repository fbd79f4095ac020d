"""The training state stacked by layer: one `[L, ...]` array per kind of layer parameter.

The model's parameter tree keeps one entry per layer (`layers.<i>.attn.wq` `[D, H, Dh]`);
the training state stacks them (`layers.attn.wq` `[L, D, H, Dh]`, and so the optimizer's
moments), so the optimizer updates a dozen arrays rather than a dozen per layer (each one
its own GPU kernels) and XLA casts a kind's weights to the compute dtype in one kernel.
The step unstacks inside the jit (`per_layer`: slices, fused into those casts); checkpoints,
exports and all else outside the step keep the per-layer tree (`Checkpoints` converts).

    stacked = stack(params)      # unstack(stacked) == params; also (params, opt_state)
    per_layer(params)            # the per-layer tree, whichever layout `params` has

A stacked Param's `out_sharding` names gain a leading None: the layer axis is not split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

LAYERS = "layers"


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _is_state(x) -> bool:
  return isinstance(x, nnx.State)


def _names(v: nnx.Variable):
  return v.get_metadata().get("out_sharding")


def _stack_vars(*vs: nnx.Variable) -> nnx.Variable:
  """L per-layer Variables -> one whose value is `[L, ...]`."""
  names = _names(vs[0])
  value = jnp.stack([v.get_value() for v in vs])
  return vs[0].replace(value, out_sharding=None if names is None else (None, *names))


def _layer_var(v: nnx.Variable, value) -> nnx.Variable:
  """One layer (`value`) of a stacked Variable."""
  names = _names(v)
  return v.replace(value, out_sharding=None if names is None else names[1:])


@jax.custom_vjp
def _layers(x) -> tuple:
  """`(x[0], x[1], ...)`: the layers of a stacked array. Their cotangents are stacked back
  (a concatenate, which XLA fuses into each consumer) rather than transposed slice by slice
  (a sum of pads, which XLA writes out as a stacked float32 gradient: +4 GB a step at
  Qwen2.5-0.5B shape)."""
  return tuple(x[i] for i in range(x.shape[0]))


_layers.defvjp(lambda x: (_layers(x), None), lambda _, cts: (jnp.stack(cts),))


def _over_states(fn, tree):
  """`fn` applied to every `nnx.State` of `tree` (params; an optimizer state's moments)."""
  return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, tree, is_leaf=_is_state)


def is_stacked(params) -> bool:
  """Whether `params` is an `nnx.State` holding its layers stacked (not one entry per layer;
  False for any other tree)."""
  layers = params.raw_mapping.get(LAYERS) if _is_state(params) else None
  return layers is not None and not all(isinstance(k, int) for k in layers)


def _stack_one(params: nnx.State) -> nnx.State:
  tree = dict(params.raw_mapping)
  layers = tree[LAYERS]
  tree[LAYERS] = jax.tree.map(_stack_vars, *(layers[i] for i in range(len(layers))),
                              is_leaf=_is_var)
  return nnx.State(tree)


def _unstack_one(params: nnx.State, split) -> nnx.State:
  tree = dict(params.raw_mapping)
  leaves, treedef = jax.tree.flatten(tree[LAYERS], is_leaf=_is_var)
  per_leaf = [[_layer_var(v, x) for x in split(v.get_value())] for v in leaves]
  tree[LAYERS] = {i: treedef.unflatten([layers[i] for layers in per_leaf])
                  for i in range(len(per_leaf[0]))}
  return nnx.State(tree)


def stack(tree):
  """Every per-layer params tree in `tree` (params, an optimizer state, a tuple of both)
  stacked: `layers.<i>.<path>` `[...]` -> `layers.<path>` `[L, ...]`; the rest as it is."""
  return _over_states(_stack_one, tree)


def unstack(tree, split=_layers):
  """The inverse of `stack`; `split(value)` gives the layers of a stacked value."""
  return _over_states(lambda s: _unstack_one(s, split), tree)


def per_layer(tree):
  """`tree` with its params trees per layer: `unstack`ed when stacked, else as it is."""
  return _over_states(lambda s: _unstack_one(s, _layers) if is_stacked(s) else s, tree)


def model_of(graphdef, params) -> nnx.Module:
  """The model of `params` in either layout: inside a jit the unstacking slices fuse into the
  layers' weight casts."""
  return nnx.merge(graphdef, per_layer(params))


def _layer_sharding(s):
  """The sharding of one layer of an array sharded `s` (its unsplit layer axis dropped)."""
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
  return s


def unstacked_like(tree):
  """The per-layer tree of a stacked `tree` (arrays or ShapeDtypeStructs) as
  ShapeDtypeStructs, each layer placed like its stack (e.g. a restore target)."""
  def split(x):
    layer = jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=_layer_sharding(x.sharding))
    return [layer] * x.shape[0]
  return unstack(tree, split)


def layer_ndim(params):
  """Each leaf's rank in one layer (a stacked leaf's without its layer axis)."""
  ndim = jax.tree.map(lambda x: x.ndim, params)
  if not is_stacked(params):
    return ndim
  tree = dict(ndim.raw_mapping)
  tree[LAYERS] = jax.tree.map(lambda n: n - 1, tree[LAYERS])
  return nnx.State(tree)
