"""Device meshes and the one rules table from logical axis names to mesh axes.

Params name their dims with logical axes (`embed`, `heads`, `kv_heads`, `mlp`, `vocab`; see
`model/transformer.py`); batches and caches use `batch`. `RULES` maps each name to mesh axes of the
`(data, fsdp, tensor)` mesh: batch over data x fsdp (data parallel + FSDP), params' `embed`
over fsdp (FSDP), heads / kv heads / mlp / vocab over tensor (tensor parallel). A dim whose
size the mesh axes do not divide is replicated rather than refused (e.g. 2 kv heads on an
8-way tensor axis), so any model runs on any mesh; only the mesh itself must fit the devices.

Meshes (`meshes.py`, re-exported here): every entry point takes the mesh users make
(Explicit or Auto axes, their own axis names through `axis_rules`, or an enclosing
`jax.set_mesh`) and runs on `resolve_mesh`'s Auto (data, fsdp, tensor) mesh over the same
devices, so the rules below apply unchanged.

Decoder states declare the logical axes of every field (`axes`, `subtree`: dataclass field
metadata, as `KV_NAMES` does for the cache); inside `use_mesh(mesh)` `constrain` pins a state
to the specs built from those declarations (`state_specs`), and outside it is a no-op.

Multi-host: every process calls the same functions with the same host values (params built
from one seed, the same batch); `put` hands each process's devices their slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from paraflax.parallel.meshes import (  # noqa: F401
  AXES,
  MeshConfig,
  make_mesh,
  resolve_mesh,
  returned_on,
  use_mesh,
)

# logical axis -> mesh axes (in order; a prefix whose sizes divide the dim is used)
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
)

KV_NAMES = (None, "batch", None, "kv_heads", None)  # cache k/v [layers, B, S, Hkv, Dh]


def _sizes(mesh) -> dict[str, int]:
  return dict(mesh.shape)


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh,
                 rules=RULES) -> P:
  """The PartitionSpec of a `shape` array whose dims have logical `names`.

  Each dim takes the longest prefix of its rule's mesh axes whose sizes divide it (size-1
  axes and axes already used by an earlier dim are skipped); a dim nothing divides is
  replicated. `mesh` may be a Mesh or an AbstractMesh.
  """
  if len(names) != len(shape):
    raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
  table, sizes, used, out = dict(rules), _sizes(mesh), set(), []
  for name, dim in zip(names, shape):
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    kept, prod = [], 1
    for axis in table[name]:
      if sizes.get(axis, 1) == 1 or axis in used:
        continue
      if dim % (prod * sizes[axis]):
        break
      prod *= sizes[axis]
      kept.append(axis)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def _names(v: nnx.Variable, ndim: int) -> tuple:
  names = v.get_metadata().get("out_sharding")
  return tuple(names) if names else (None,) * ndim


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(tree: Any, mesh, rules=RULES) -> Any:
  """NamedShardings for an NNX state (params, or optimizer state holding Param copies).

  Variables are sharded by their `out_sharding` names; other arrays (step counts) are
  replicated. The result is a prefix of `tree` (one sharding per Variable), as `jax.jit`
  and `jax.device_put` accept. Works on abstract trees (`nnx.eval_shape`, `jax.eval_shape`).
  """
  def one(x):
    if _is_var(x):
      value = x.get_value() if hasattr(x, "get_value") else x[...]
      return NamedSharding(mesh, logical_spec(_names(x, value.ndim), value.shape, mesh, rules))
    return NamedSharding(mesh, P())
  return jax.tree.map(one, tree, is_leaf=_is_var)


def abstract_state(tree: Any, mesh, rules=RULES) -> Any:
  """`tree` with every array as a `ShapeDtypeStruct` carrying its sharding on `mesh`: the
  target orbax restores into (a checkpoint from any mesh lands sharded on this one)."""
  shardings = state_shardings(tree, mesh, rules)
  return jax.tree.map(
      lambda s, v: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), v),
      shardings, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(shape: Sequence[int], mesh, rules=RULES) -> NamedSharding:
  """Leading dim over the `batch` axes (when they divide it), the rest replicated."""
  names = ("batch",) + (None,) * (len(shape) - 1) if len(shape) else ()
  return NamedSharding(mesh, logical_spec(names, shape, mesh, rules))


def _on_explicit_axes(x: jax.Array) -> bool:
  """Whether `x` lives on a mesh with Explicit axes (its type then carries that mesh)."""
  s = x.sharding
  return isinstance(s, NamedSharding) and any(t == AxisType.Explicit for t in s.mesh.axis_types)


def put(x, sharding: NamedSharding):
  """Place `x` at `sharding`, also across processes.

  A host value (numpy, or a single-device array) must be the same on every process: each
  process supplies its devices' slices of it. A global array is resharded. An array already
  placed so (on Auto axes) is returned as is; otherwise the result is a copy that shares no
  buffer with `x` (so donating it cannot delete `x`).
  """
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding),
                                    impl=jax.random.key_impl(x))
  if (isinstance(x, jax.Array) and not _on_explicit_axes(x)
      and x.sharding.is_equivalent_to(sharding, x.ndim)):
    return x
  if isinstance(x, jax.Array) and (sharding.is_fully_addressable or not x.is_fully_addressable):
    # copy first: device_put (even with may_alias=False, jax 0.10) reuses x's buffer as the
    # shard on x's own device, and donating the result would then delete x
    return jax.device_put(jnp.copy(x), sharding)
  if sharding.is_fully_addressable:
    return jax.device_put(np.asarray(x), sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_state(tree: Any, mesh, rules=RULES) -> Any:
  """`tree` (an NNX state) placed by `state_shardings`."""
  shardings = state_shardings(tree, mesh, rules)
  return jax.tree.map(lambda s, v: jax.tree.map(lambda a: put(a, s), v), shardings, tree,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def shard_batch(batch: Any, mesh, rules=RULES) -> Any:
  """Every array of `batch` (a pytree of [B, ...] host arrays, the same global batch on every
  process) split over the batch axes of `mesh`."""
  return jax.tree.map(lambda x: put(x, batch_sharding(np.shape(x), mesh, rules)), batch)


# ------------------------------------------------------------- decoder states (inside jit)

_DECLARED = "logical_axes"  # dataclass field metadata key
_SUBTREE = "subtree"


def axes(*names: str | None, **field_kwargs):
  """A state dataclass field holding one array (or None) whose dims have logical `names`
  (None: not split; no names: a scalar or PRNG key, replicated):
  `tokens: jax.Array = sharding.axes("batch", None)  # [B, N]`."""
  return dataclasses.field(metadata={_DECLARED: tuple(names)}, **field_kwargs)


def subtree(**field_kwargs):
  """A state dataclass field holding declared state dataclasses (or None), e.g. a cache."""
  return dataclasses.field(metadata={_DECLARED: _SUBTREE}, **field_kwargs)


def state_specs(state: Any, mesh, rules=RULES) -> Any:
  """PartitionSpecs for a decoder state, from the logical axes its dataclasses declare with
  `axes` / `subtree` (`state` may hold tracers or ShapeDtypeStructs). A field that declares
  nothing is a TypeError: no state is sharded by guessing from shapes."""
  if state is None:
    return None
  if not dataclasses.is_dataclass(state) or isinstance(state, type):
    raise TypeError(f"a decoder state holds {type(state).__name__} where a dataclass declaring "
                    "its fields' logical axes (sharding.axes / sharding.subtree) belongs")
  specs = {}
  for f in dataclasses.fields(state):
    if not f.metadata.get("pytree_node", True):
      continue  # static
    names, value = f.metadata.get(_DECLARED), getattr(state, f.name)
    if names is None:
      raise TypeError(f"{type(state).__name__}.{f.name} declares no logical axes: write "
                      "`= sharding.axes(...)` (an array) or `= sharding.subtree()` (nested state)")
    if names == _SUBTREE:
      specs[f.name] = state_specs(value, mesh, rules)
    else:
      specs[f.name] = None if value is None else logical_spec(names, np.shape(value), mesh, rules)
  return dataclasses.replace(state, **specs)


def context_mesh():
  """The mesh `use_mesh` set while tracing (Auto axes named like this module's); else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(AXES) <= set(mesh.axis_names):
    return None
  if any(t != AxisType.Auto for t in mesh.axis_types):
    return None
  return mesh


def constrain(state):
  """Inside jit under `use_mesh`: pin a declared state (a cache, a decoder state) to
  `state_specs`; elsewhere the identity."""
  mesh = context_mesh()
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_specs(state, mesh))


def constrain_batch(x_BxN):
  """Inside jit under a mesh context: split an activation's leading batch dim over the batch
  axes (data x fsdp), the rest replicated; elsewhere the identity. Pinning the residual stream
  this way makes FSDP gather each layer's weights rather than every row's activations."""
  mesh = context_mesh()
  if mesh is None:
    return x_BxN
  names = ("batch",) + (None,) * (x_BxN.ndim - 1)
  return jax.lax.with_sharding_constraint(x_BxN, logical_spec(names, x_BxN.shape, mesh))


def batch_shards(b: int) -> int:
  """Into how many parts `constrain_batch` splits `b` rows under the context mesh (1 outside
  one): the rows each device holds are b / batch_shards(b)."""
  mesh = context_mesh()
  if mesh is None:
    return 1
  spec = logical_spec(("batch",), (b,), mesh)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes]))


def traced_on(mesh, fn):
  """`fn` traced under `mesh`'s abstract mesh (so `constrain*` apply inside it), or `fn`
  itself when `mesh` is None: wrap a function before `jax.jit`."""
  if mesh is None:
    return fn

  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return traced


def constrain_replicated(tree):
  """Inside jit under `use_mesh`: make outputs whole on every device (and every process)."""
  mesh = context_mesh()
  if mesh is None:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def shard_decode_state(state, mesh, rules=RULES):
  """A decoder state placed by `state_specs` (for stepping it outside a while loop)."""
  specs = state_specs(state, mesh, rules)
  return jax.tree.map(lambda s, x: put(x, NamedSharding(mesh, s)), specs, state,
                      is_leaf=lambda x: isinstance(x, P))
