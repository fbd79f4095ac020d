"""Filling a store on a mesh: which rows of each batch this process writes, and the barriers.

A collection (`trajectories.collect`, `teacher.collect`) runs the model sharded by the rules of
`sharding.py` and each batch's prompts split over the mesh's batch axes (data x fsdp,
`sharding.batch_sharding`). Outputs come back replicated (a few int32 per row, next to a
model's forward passes).

Multi-host (`jax.process_count() > 1`), every process runs the same program on the same host
prompts (drawn from one seed), and:
  - process 0 alone creates (or checks) the store and holds its lock; the others open it
    after a barrier (`open_store`, `writing`);
  - each process writes only the rows of each batch its own devices computed (a row held by
    several processes' devices, e.g. a replicated batch: the lowest process), disjoint row
    slices of the shared zarr arrays. Two processes may write rows of one chunk file:
    tensorstore's optimistic concurrency (a conditional read-modify-write) makes that safe;
  - after every batch a barrier (`sync`), then process 0 alone appends that batch's checksums
    and advances progress.json (`store.fill`): a batch counts as done only once every process
    has written its rows, so a killed run resumes at the first batch some process had not
    finished, on any number of processes or devices.
One process with many devices takes the same path: it owns every row, the barriers are trivial.
Without a mesh, a process collects alone on one device (no barriers, every row its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from etils.epath import Path
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from paraflax.parallel import sharding
from paraflax.training.stores import store


def owned_rows(index_map: Mapping, n: int, process: int) -> list[tuple[int, int]]:
  """The row ranges of `[0, n)` that `process` writes: those of the slices in `index_map`
  ({device: index tuple}, leading dim = rows) whose lowest holding process is `process`,
  merged and sorted."""
  owner: dict[tuple[int, int], int] = {}
  for device, index in index_map.items():
    lo, hi, _ = index[0].indices(n) if index else (0, n, 1)
    owner[lo, hi] = min(owner.get((lo, hi), device.process_index), device.process_index)
  out: list[tuple[int, int]] = []
  for lo, hi in sorted(r for r, p in owner.items() if p == process):
    if out and out[-1][1] == lo:
      out[-1] = (out[-1][0], hi)
    else:
      out.append((lo, hi))
  return out


@dataclasses.dataclass(frozen=True)
class Share:
  """This process's part in filling a store of `batch_size`-row batches on `mesh` (None: one
  device)."""
  mesh: Mesh | None
  batch_size: int

  def __post_init__(self):
    if self.mesh is not None and jax.process_count() > 1 and len(
        {d.process_index for d in self.mesh.devices.flat}) != jax.process_count():
      raise ValueError("a multi-host collection needs a mesh over every process's devices")

  @property
  def primary(self) -> bool:
    """Whether this process writes the store's own files (without a mesh: every process)."""
    return self.mesh is None or jax.process_index() == 0

  def rows(self, n: int) -> list[tuple[int, int]]:
    """The row ranges of a batch's first `n` rows (fewer in a padded last batch) this
    process writes."""
    if self.mesh is None:
      return [(0, n)]
    s = sharding.batch_sharding((self.batch_size,), self.mesh)
    rows = owned_rows(s.devices_indices_map((self.batch_size,)), self.batch_size,
                      jax.process_index())
    return [(lo, min(hi, n)) for lo, hi in rows if lo < n]

  def sync(self, name: str) -> None:
    """A barrier across processes (every process passes the same `name`; trivial on one,
    none without a mesh: each process then runs alone)."""
    if self.mesh is not None:
      multihost_utils.sync_global_devices(name)

  def place(self, model):
    """`model` with its params sharded by the rules (as is without a mesh)."""
    if self.mesh is None:
      return model
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, sharding.shard_state(params, self.mesh))

  def batch(self, *host_arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """[B, ...] host arrays (the same on every process) split over the batch axes."""
    if self.mesh is None:
      return tuple(jnp.asarray(a) for a in host_arrays)
    return tuple(sharding.shard_batch(host_arrays, self.mesh))

  def whole(self, x):
    """`x` (the same on every process, e.g. a PRNG key) replicated over the mesh."""
    return x if self.mesh is None else sharding.put(x, sharding.replicated(self.mesh))

  def writing(self, out: Path, *, what: str):
    """The store's lock, held by process 0."""
    return store.writing(out, what=what) if self.primary else contextlib.nullcontext()

  def open_store(self, out: Path, meta: dict, shapes: Mapping[str, tuple], tokenizer, *,
                 what: str) -> tuple[dict, int]:
    """`store.open_store` on process 0; the others open what it made after a barrier."""
    if self.primary:
      arrays, done = store.open_store(out, meta, shapes, tokenizer, what=what)
    self.sync(f"open {out}")
    if not self.primary:
      arrays = {k: store.open_array(out, k) for k in shapes}
      done = store.read_progress(out)
    return arrays, done
