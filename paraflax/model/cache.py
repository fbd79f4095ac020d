"""Fixed-shape KV cache and the one operation that writes it: `commit`.

The slots past the capacity are spares: rows that keep nothing (finished rows, rejected
candidates' padding) write there, so no `where` over the whole cache is ever needed. Masks
built from `lengths` never let a query see a slot at or past a row's length, so what a
commit leaves there is never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.model.config import ModelConfig
from paraflax.parallel.sharding import KV_NAMES, axes, constrain

# a TPU cache's spare slots: a commit of up to this many entries a row (every decoder's step:
# Jacobi's 16-token block is the widest) writes its window at the row's length without reading
# it first (`commit`); XLA:TPU tiles the slots by 128, so 2,048 + 16 take what 2,049 took
TPU_SPARE = 16


@struct.dataclass
class ChunkKV:
  """Keys/values of one forward's chunk, as returned by the model."""
  k: jax.Array = axes(*KV_NAMES)  # [layers, B, T, Hkv, Dh]
  v: jax.Array = axes(*KV_NAMES)  # [layers, B, T, Hkv, Dh]


@struct.dataclass
class KVCache:
  k: jax.Array = axes(*KV_NAMES)  # [layers, B, S, Hkv, Dh]; slot S-1 is the spare
  v: jax.Array = axes(*KV_NAMES)  # [layers, B, S, Hkv, Dh]
  lengths: jax.Array = axes("batch")  # [B] int32: slots [0, lengths) hold committed keys
  # commit each row's window of slots by dynamic slices, not a scatter (a TPU's: `commit`)
  slices: bool = struct.field(pytree_node=False, default=False)

  @property
  def spare(self) -> int:
    """Slots past the capacity (`spares`)."""
    return spares(self.slices)

  @property
  def slots(self) -> int:
    """S, including the spares."""
    return self.k.shape[2]

  @property
  def capacity(self) -> int:
    """Usable slots per row (S minus the spares): a row's length never passes it."""
    return self.slots - self.spare


@struct.dataclass
class CacheLayer:
  """Layer `layer` of a stacked cache, not sliced out: a kernel reads it in place
  (`decode_attention`), the other paths take `kv()`."""
  k: jax.Array  # [layers, B, S, Hkv, Dh]
  v: jax.Array
  layer: int = struct.field(pytree_node=False)

  def kv(self) -> tuple[jax.Array, jax.Array]:
    """The layer's (k, v) `[B, S, Hkv, Dh]`."""
    return self.k[self.layer], self.v[self.layer]


def init_cache(cfg: ModelConfig, batch: int, capacity: int,
               backend: str | None = None) -> KVCache:
  """An empty cache with `capacity` usable slots per row and one spare, for a model that runs
  on `backend`. A TPU's commits are dynamic slices (`slices`, `commit`) and it has
  `TPU_SPARE` spares, so that a step's window of up to that many slots starts at the row's
  length.

  Under `sharding.use_mesh` (inside jit) it is sharded: batch over (data, fsdp), kv heads
  over tensor, each only where the axis sizes divide it.
  """
  shape = (cfg.n_layers, batch, cache_slots(capacity, backend), cfg.n_kv_heads,
           cfg.dim_per_head)
  return constrain(KVCache(k=jnp.zeros(shape, cfg.compute_dtype),
                           v=jnp.zeros(shape, cfg.compute_dtype),
                           lengths=jnp.zeros((batch,), jnp.int32), slices=backend == "tpu"))


def cache_slots(capacity: int, backend: str | None = None) -> int:
  """S of a cache with `capacity` usable slots for `backend` (`init_cache`)."""
  return capacity + spares(backend == "tpu")


def spares(tpu: bool) -> int:
  """Slots past a cache's capacity: `TPU_SPARE` for a TPU's (its commits are slices), else one."""
  return TPU_SPARE if tpu else 1


def commit(cache: KVCache, chunk: ChunkKV, src_BxN: jax.Array, count_B: jax.Array) -> KVCache:
  """Append chunk rows `src[b, :count[b]]` at each row's length; advance lengths by count.

  One gather of n rows per batch row and one scatter into the cache (in place inside a
  loop). Entries i >= count[b] go to the last slot, a spare.

  A cache with `slices` (a TPU's) writes each row's window of n slots from its length with a
  dynamic slice instead: XLA:TPU lays a scatter's cache out slots-major, attention reads it
  slots-minor, and the loop copied the whole cache between the two every step. Each row's
  entries are gathered from its own chunk row (a gather over all rows relaid out the chunk's
  K and V every step). Where the cache has at least n spares (`TPU_SPARE`: every step of a
  decode loop) the window starts at the row's length and is written whole: its slots past the
  kept entries are past the new length, where nothing reads. Otherwise (a prefill's commit)
  the window holds the row's kept entries and, elsewhere, what its slots held (a window that
  would run past the last slot starts earlier, over committed slots it leaves as they were;
  entries that do not fit are dropped, as the scatter drops them into the spare slot). Every
  commit needs each row's new length within the capacity, as the decoders size their caches.
  """
  b, n = src_BxN.shape
  lengths = cache.lengths + count_B.astype(jnp.int32)
  if cache.slices:
    k, v = cache.k, cache.v
    for r in range(b):
      start = jnp.clip(cache.lengths[r], 0, cache.slots - n)
      entry = start + jnp.arange(n) - cache.lengths[r]  # [N] the entry each slot would take
      kept = None if n <= cache.spare else (entry >= 0) & (entry < count_B[r])
      row = lambda x: x[:, r:r + 1, src_BxN[r]].astype(cache.k.dtype)  # [layers, 1, N, Hkv, Dh]
      k = _write_window(k, row(chunk.k), r, start, entry, kept)
      v = _write_window(v, row(chunk.v), r, start, entry, kept)
    return cache.replace(k=k, v=v, lengths=lengths)
  rows = jnp.arange(b)[:, None]  # [B, 1]
  new_k = chunk.k[:, rows, src_BxN].astype(cache.k.dtype)  # [layers, B, N, Hkv, Dh]
  new_v = chunk.v[:, rows, src_BxN].astype(cache.v.dtype)
  keep = jnp.arange(n)[None, :] < count_B[:, None]  # [B, N]
  dst = jnp.where(keep, cache.lengths[:, None] + jnp.arange(n)[None, :], cache.slots - 1)
  return cache.replace(k=cache.k.at[:, rows, dst].set(new_k),
                       v=cache.v.at[:, rows, dst].set(new_v), lengths=lengths)


def _write_window(x, new_Lx1xNxHxD, r: int, start, entry_N, kept_N):
  """`x` with row r's slots [start, start + N) holding new[entry] where kept, else as they
  were; with `kept` None the window starts at the row's length and takes `new` in order (one
  entry through the gather all the same: written directly, XLA:TPU's AR step at batch 1 had
  33 more copies)."""
  n = new_Lx1xNxHxD.shape[2]
  at = (0, r, start, 0, 0)
  if kept_N is None and n > 1:
    return jax.lax.dynamic_update_slice(x, new_Lx1xNxHxD, at)
  entries = jnp.take(new_Lx1xNxHxD, jnp.clip(entry_N, 0, n - 1), axis=2)
  if kept_N is not None:
    window = jax.lax.dynamic_slice(x, at, (x.shape[0], 1, n, *x.shape[3:]))
    entries = jnp.where(kept_N[None, None, :, None, None], entries, window)
  return jax.lax.dynamic_update_slice(x, entries, at)
