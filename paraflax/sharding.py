"""Device meshes and the one rules table from logical axis names to mesh axes.

Params name their dims with logical axes (`embed`, `heads`, `kv_heads`, `mlp`, `vocab`; see
`model.py`); batches and caches use `batch`. `RULES` maps each name to mesh axes of the
`(data, fsdp, tensor)` mesh: batch over data x fsdp (data parallel + FSDP), params' `embed`
over fsdp (FSDP), heads / kv heads / mlp / vocab over tensor (tensor parallel). A dim whose
size the mesh axes do not divide is replicated rather than refused (e.g. 2 kv heads on an
8-way tensor axis), so any model runs on any mesh; only the mesh itself must fit the devices.

Any mesh users make works: `resolve_mesh` turns a `jax.make_mesh` mesh (Explicit axes, JAX's
default, or Auto), a `MeshConfig`, or the mesh of an enclosing `jax.set_mesh` into the mesh
the library runs on: the same devices on Auto axes named (data, fsdp, tensor), so XLA's
sharding propagation runs the unmodified model, objectives and decoders (Explicit axes would
make every einsum with a sharded contraction ask for an `out_sharding`). Axes with other
names play a library axis through `axis_rules`, e.g. `{"tensor": "model"}`; an axis of size
> 1 with no role, or devices that are not this run's, is a one-line ValueError.

Decoder states declare the logical axes of every field (`axes`, `subtree`: dataclass field
metadata, as `KV_NAMES` does for the cache); inside `use_mesh(mesh)` `constrain` pins a state
to the specs built from those declarations (`state_specs`), and outside it is a no-op.

Multi-host: every process calls the same functions with the same host values (params built
from one seed, the same batch); `put` hands each process's devices their slices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")

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


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the (data, fsdp, tensor) mesh axes; one of them may be -1: the rest.

  `axis_rules` ({library axis: mesh axis name}, e.g. {"tensor": "model"}) names the mesh's
  axes as your own code does; stored as sorted pairs so the config stays hashable.
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  axis_rules: Any = ()  # Mapping[str, str] or pairs -> tuple[tuple[str, str], ...]

  def __post_init__(self):
    sizes = self.sizes
    if any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) or (s < 1 and s != -1)
           for s in sizes):
      raise ValueError(f"mesh axis sizes must be ints >= 1 or -1 (the rest), got {self}")
    if sizes.count(-1) > 1:
      raise ValueError(f"at most one mesh axis may be -1 (the rest), got {self}")
    rules = self.axis_rules
    try:
      rules = dict(rules.items() if isinstance(rules, Mapping) else rules)
    except (TypeError, ValueError):
      raise ValueError(f"mesh axis_rules must map library axes {AXES} to mesh axis names, "
                       f"got {rules!r}") from None
    for lib, name in rules.items():
      if lib not in AXES or not isinstance(name, str) or not name:
        raise ValueError(f"mesh axis_rules must map library axes {AXES} to mesh axis names "
                         f"(strings), got {lib!r}: {name!r}")
    object.__setattr__(self, "axis_rules", tuple(sorted(rules.items())))
    names = self.axis_names
    if len(set(names)) < len(names):
      raise ValueError(f"mesh axis_rules {dict(rules)} give two mesh axes one name: {names}")

  @property
  def sizes(self) -> tuple[int, int, int]:
    return (self.data, self.fsdp, self.tensor)

  @property
  def axis_names(self) -> tuple[str, str, str]:
    """The mesh's names of the (data, fsdp, tensor) axes."""
    rules = dict(self.axis_rules)
    return tuple(rules.get(a, a) for a in AXES)

  @classmethod
  def of(cls, spec: MeshConfig | Sequence[int] | Mapping[str, Any],
         axis_rules: Mapping[str, str] | None = None) -> MeshConfig:
    """From a MeshConfig, (data, fsdp, tensor) sizes, or a mapping of axis sizes keyed by
    library axis names (or by the names `axis_rules` gives them; "axis_rules" may be a key)."""
    if isinstance(spec, MeshConfig):
      return spec if axis_rules is None else dataclasses.replace(spec, axis_rules=axis_rules)
    if isinstance(spec, Mapping):
      spec = dict(spec)
      rules = spec.pop("axis_rules", ()) if axis_rules is None else axis_rules
      spec.pop("axis_rules", None)
      named = cls(axis_rules=rules)  # validates the rules
      lib_of = {**{a: a for a in AXES}, **{n: a for a, n in named.axis_rules}}
      sizes = {}
      for key, size in spec.items():
        if key not in lib_of:
          raise ValueError(f"unknown mesh axis {key!r} in {spec}: the axes are {AXES} (map your "
                           f"own names with axis_rules, e.g. axis_rules={{'tensor': {key!r}}})")
        if lib_of[key] in sizes:
          raise ValueError(f"mesh axis {lib_of[key]!r} is given twice in {spec}")
        sizes[lib_of[key]] = size
      return cls(**sizes, axis_rules=named.axis_rules)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
      raise ValueError(f"a mesh spec is a MeshConfig, {len(AXES)} sizes {AXES} or a mapping of "
                       f"axis sizes, got {spec!r}")
    spec = tuple(spec)
    if len(spec) != len(AXES):
      raise ValueError(f"a mesh spec needs {len(AXES)} sizes {AXES}, got {spec}")
    return cls(*spec, axis_rules=() if axis_rules is None else axis_rules)

  def shape(self, n_devices: int) -> tuple[int, int, int]:
    """The concrete (data, fsdp, tensor) sizes for `n_devices` devices."""
    sizes = self.sizes
    known = math.prod(s for s in sizes if s != -1)
    desc = " x ".join(f"{a}={s}" for a, s in zip(self.axis_names, sizes))
    if -1 in sizes:
      if n_devices % known:
        raise ValueError(f"mesh {desc}: the fixed axes ({known} devices) do not divide the "
                         f"{n_devices} available devices")
      sizes = tuple(n_devices // known if s == -1 else s for s in sizes)
    elif known != n_devices:
      raise ValueError(f"mesh {desc} needs {known} devices, but {n_devices} are available: "
                       "the axis sizes must multiply to the device count (or use -1 for one "
                       "axis)")
    return sizes


def make_mesh(spec: MeshConfig | Sequence[int] | Mapping[str, Any] | None = None,
              devices: Sequence[jax.Device] | None = None, *,
              axis_rules: Mapping[str, str] | None = None) -> Mesh:
  """An Auto-axes mesh over `devices` (default: all, every process's) with the (data, fsdp,
  tensor) sizes of `spec` (`MeshConfig.of`; None: all devices on data). Its axes are named
  data/fsdp/tensor, or as `axis_rules` renames them (pass the same `axis_rules` with it)."""
  cfg = MeshConfig(data=-1) if spec is None else MeshConfig.of(spec, axis_rules)
  devices = jax.devices() if devices is None else list(devices)
  return jax.make_mesh(cfg.shape(len(devices)), cfg.axis_names,
                       axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def _enclosing_mesh() -> Mesh | None:
  """The concrete mesh of an enclosing `jax.set_mesh`, if any."""
  get = getattr(jax.sharding, "get_mesh", None)
  mesh = None if get is None else get()
  return None if mesh is None or mesh.empty else mesh


def resolve_mesh(mesh: Mesh | MeshConfig | Sequence[int] | Mapping[str, Any] | None,
                 axis_rules: Mapping[str, str | Sequence[str]] | None = None) -> Mesh | None:
  """The mesh the library runs on for a user's `mesh`: the same devices, laid out on Auto
  axes named (data, fsdp, tensor), so XLA propagates shardings through the model.

  mesh: a `jax.sharding.Mesh` with Explicit or Auto axes (`jax.make_mesh`), a `MeshConfig`
  or sizes (`make_mesh`), or None: the mesh of an enclosing `jax.set_mesh`, else None (one
  device). axis_rules: {library axis: the mesh axis (or tuple of axes) that plays it}, e.g.
  {"tensor": "model"}; an axis named like a library axis plays it unless remapped. Raises a
  one-line ValueError, before any device work, for a mesh that cannot be used: an axis of
  size > 1 with no role, an unknown name, devices that are not this run's.
  """
  if mesh is None:
    mesh = _enclosing_mesh()
    if mesh is None:
      if axis_rules:
        raise ValueError("axis_rules= needs a mesh= (or an enclosing jax.set_mesh)")
      return None
  if isinstance(mesh, AbstractMesh):
    raise ValueError(f"mesh= needs devices, got an AbstractMesh {mesh}: pass a "
                     "jax.sharding.Mesh (jax.make_mesh)")
  if not isinstance(mesh, Mesh):
    cfg = MeshConfig.of(mesh, axis_rules)
    mesh, axis_rules = make_mesh(cfg), dict(cfg.axis_rules)
  names, sizes = tuple(mesh.axis_names), dict(mesh.shape)
  roles = {a: (a,) for a in AXES if a in names}
  if axis_rules is not None and not isinstance(axis_rules, Mapping):
    raise ValueError(f"axis_rules must be a mapping such as {{'tensor': 'model'}}, got "
                     f"{axis_rules!r}")
  for lib, target in (axis_rules or {}).items():
    if lib not in AXES:
      raise ValueError(f"axis_rules key {lib!r} is not a library axis: keys are {AXES}, "
                       "values the mesh's axis names, e.g. {'tensor': 'model'}")
    target = (target,) if isinstance(target, str) else tuple(target)
    missing = [t for t in target if t not in names]
    if missing:
      raise ValueError(f"axis_rules maps {lib!r} to {missing[0]!r}, which the mesh (axes "
                       f"{names}) does not have")
    roles[lib] = target
  order = [a for lib in AXES for a in roles.get(lib, ())]
  twice = sorted({a for a in order if order.count(a) > 1})
  if twice:
    raise ValueError(f"mesh axis {twice[0]!r} plays two library axes "
                     f"({[lib for lib in roles if twice[0] in roles[lib]]}); give each one")
  idle = [a for a in names if a not in order and sizes[a] > 1]
  if idle:
    raise ValueError(f"mesh axis {idle[0]!r} (size {sizes[idle[0]]}) has no role: map it onto a "
                     f"library axis with axis_rules, e.g. axis_rules={{'tensor': {idle[0]!r}}} "
                     "(data: batch; fsdp: batch and params; tensor: heads, mlp, vocab)")
  known = set(jax.devices())
  stray = [d for d in mesh.devices.flat if d not in known]
  if stray:
    raise ValueError(f"mesh device {stray[0]} is not one of this run's jax.devices() "
                     f"({jax.devices()[0].platform} x {len(known)})")
  if names == AXES and all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  order += [a for a in names if a not in order]  # size-1 axes without a role
  devices = np.transpose(mesh.devices, [names.index(a) for a in order])
  shape = tuple(math.prod(sizes[a] for a in roles.get(lib, ())) for lib in AXES)
  # jax.sharding.Mesh keeps this exact device layout (jax.make_mesh may reorder devices)
  return Mesh(devices.reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def returned_on(tree: Any, mesh, resolved: Mesh | None) -> Any:
  """Replicated outputs of a run on `resolved` (from `resolve_mesh(mesh)`), placed replicated
  on the user's own `mesh` (given or enclosing) when that differs, so that the user's code
  under it (Explicit axes, other names) can take them."""
  mesh = _enclosing_mesh() if mesh is None else mesh
  if not isinstance(mesh, Mesh) or resolved is None or mesh == resolved:
    return tree
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), tree)


def use_mesh(mesh: Mesh | None):
  """Context in which jitted code sees `mesh` (from `resolve_mesh`; a no-op for None)."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


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
  placed so (on Auto axes) is returned as is; otherwise the result is a copy that shares no buffer with `x`
  (so donating it cannot delete `x`).
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


def kv_spec(shape: Sequence[int], mesh, rules=RULES) -> P:
  """Cache k/v `[layers, B, S, Hkv, Dh]`: batch over (data, fsdp), kv heads over tensor."""
  return logical_spec(KV_NAMES, shape, mesh, rules)


def _context_mesh():
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
  mesh = _context_mesh()
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_specs(state, mesh))


def constrain_replicated(tree):
  """Inside jit under `use_mesh`: make outputs whole on every device (and every process)."""
  mesh = _context_mesh()
  if mesh is None:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def shard_decode_state(state, mesh, rules=RULES):
  """A decoder state placed by `state_specs` (for stepping it outside a while loop)."""
  specs = state_specs(state, mesh, rules)
  return jax.tree.map(lambda s, x: put(x, NamedSharding(mesh, s)), specs, state,
                      is_leaf=lambda x: isinstance(x, P))
