"""The meshes users make, and the one mesh the library runs on.

`MeshConfig` / `make_mesh` build a mesh from (data, fsdp, tensor) sizes. `resolve_mesh` takes
any mesh a user makes: `jax.make_mesh` with Explicit axes (JAX's default) or Auto axes, with
the library's axis names or their own (`axis_rules={"tensor": "model"}` says which axis plays
which library axis), or the mesh of an enclosing `jax.set_mesh`, and returns the same devices
on Auto axes named (data, fsdp, tensor): XLA's sharding propagation then runs the unmodified
model, objectives and decoders (Explicit axes would make every einsum with a sharded
contraction ask for an `out_sharding`), and the rules of `sharding.py` apply unchanged. A mesh
it cannot use is a one-line ValueError, raised on the host before any device work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")


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
  cfg = MeshConfig.of(MeshConfig(data=-1) if spec is None else spec, axis_rules)
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
