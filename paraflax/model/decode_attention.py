"""Attention of a decode step in one GPU kernel per layer: a Pallas (Triton) kernel that reads
the layer's keys and values in place from the stacked cache and the step's own chunk, under
the step's dense mask.

`decode_attend(q, k, v, mask, cache_k, cache_v, layer)`: queries `[B, T, H, D]` attend the
keys [cache slots S | chunk tokens T'] under the bool mask `[B, T, S+T']`, grouped-query
(H = G * Hkv). `cache_k`, `cache_v` are the whole stacked cache `[L, B, S, Hkv, D]` and
`layer` the static layer index: the kernel loads layer `layer`'s slots itself, so no step
copies a cache slice out or concatenates the chunk to it (the dense path's per-layer slice,
its float32 scores `[B, Hkv, G, T, S]` and their softmax passes are one kernel here).

One program per (row, kv head, tile of query rows): its G query heads x T rows (a tile of
powers of two, at least 16 in all, at most `MAX_ROWS` per program, as a tile of its dots)
run an online softmax over the cache in blocks of `BLOCK_K` slots, up to the last slot its
rows can see (the filled part: a short context reads a few blocks; the mask's cache part,
a few bytes a row, is read first to find it), then over the chunk. The
queries, the chunk, the mask and the output are read and written unpadded, through masked
tiles (no pad or slice kernels around the call).
Scores of masked pairs are the float32 minimum, as on the dense path: a row with no visible
key gets the mean of every value, as there (its output is ignored: padding queries).
`interpret=True` runs the same kernel on the CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_K = 64  # cache slots per iteration of the kernel's loop
MIN_ROWS = 16  # the smallest tile a Triton dot takes
MAX_ROWS = 64  # the largest: a wider step's rows split over more programs
KERNEL_NAME = "paraflax_decode_attention"  # its custom call's name (`perf compile` costs it)
_NEG = jnp.finfo(jnp.float32).min


def supports(head_dim: int) -> bool:
  """Whether the kernel takes heads of `head_dim`: a Triton dot's power of two, >= 16."""
  return head_dim >= MIN_ROWS and head_dim == _pow2(head_dim)


def _pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("layer", "interpret"))
def decode_attend(q_BxTxHxD, k_BxUxKxD, v_BxUxKxD, mask_BxTxS, cache_k, cache_v, layer: int, *,
                  interpret: bool = False):
  """`[B, T, H, D]` attention of the step's queries over layer `layer` of the stacked cache
  `[L, B, S, Hkv, D]` and the chunk's keys `[B, T', Hkv, D]` (module docstring)."""
  b, t, h, d = q_BxTxHxD.shape
  u, hkv = k_BxUxKxD.shape[1], k_BxUxKxD.shape[2]
  s, g, dt = cache_k.shape[2], h // hkv, q_BxTxHxD.dtype
  gp = _pow2(g)
  tp = max(_pow2(t), MIN_ROWS // gp)  # the rows: tp x gp
  tq = min(tp, max(1, MAX_ROWS // gp))  # a program's rows: tq x gp
  kernel = functools.partial(_kernel, layer=layer, slots=s, shape=(t, g, u, tq, gp),
                             scale=d ** -0.5)
  anywhere = pl.BlockSpec(memory_space=pl.ANY)  # tiles past the arrays' ends: masked loads
  out = pl.pallas_call(
      kernel,
      grid=(b, hkv, tp // tq),
      in_specs=[anywhere] * 6,  # q, chunk k, v, mask, the stacked cache (read in place)
      out_specs=anywhere,
      out_shape=jax.ShapeDtypeStruct((b, t, hkv, g, d), dt),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name=KERNEL_NAME,
  )(q_BxTxHxD.reshape(b, t, hkv, g, d), k_BxUxKxD.astype(dt), v_BxUxKxD.astype(dt), mask_BxTxS,
    cache_k, cache_v)
  return out.reshape(b, t, h, d)


def _kernel(q_ref, kn_ref, vn_ref, mask_ref, k_ref, v_ref, o_ref, *, layer: int, slots: int,
            shape: tuple, scale: float):
  """One (row, kv head, tile of query rows): its query heads x rows as one tile
  `[tq * gp, D]`, an online softmax over the cache's blocks, then over the chunk. Every
  array is read and written unpadded, through masked tiles."""
  t, g, chunk, tq, gp = shape
  bi, hi, lay = pl.program_id(0), pl.program_id(1), jnp.int32(layer)
  d, up, rows = q_ref.shape[-1], max(_pow2(chunk), MIN_ROWS), tq * gp
  first = pl.program_id(2) * tq
  zero = first * 0  # a traced start: a static slice past an array's end is refused
  tile_rows, heads = pl.ds(first, tq), pl.ds(zero, gp)
  real_rows = first + jnp.arange(tq) < t
  real_q = real_rows[:, None, None] & (jnp.arange(gp) < g)[None, :, None]  # [tq, gp, 1]
  q = plgpu.load(q_ref.at[bi, tile_rows, hi, heads, :], mask=real_q,
                 other=0.).reshape(rows, d)

  def update(carry, scores, values):
    acc, m, l = carry
    m_next = jnp.maximum(m, scores.max(-1))
    p = jnp.exp(scores - m_next[:, None])
    correction = jnp.exp(m - m_next)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(values.dtype), values)
    return acc, m_next, l * correction + p.sum(-1)

  def scores_of(keys, cols, real):  # [R, n] float32, masked as the dense path masks
    n = real.shape[-1]
    seen = plgpu.load(mask_ref.at[bi, tile_rows, cols], mask=real_rows[:, None] & real[None, :],
                      other=False)
    seen = jnp.broadcast_to(seen[:, None, :], (tq, gp, n)).reshape(rows, n)  # G heads alike
    x = plgpu.dot(q, keys, trans_b=True) * scale
    return jnp.where(real[None, :], jnp.where(seen, x, _NEG), -jnp.inf)

  def load(ref, real):  # [n, D] keys or values, rows past `real` zero
    return plgpu.load(ref, mask=real[:, None], other=0.)

  def block(i, carry):
    cols = pl.ds(i * BLOCK_K, BLOCK_K)
    real = i * BLOCK_K + jnp.arange(BLOCK_K) < slots
    keys = load(k_ref.at[lay, bi, cols, hi, :], real)
    values = load(v_ref.at[lay, bi, cols, hi, :], real)
    return update(carry, scores_of(keys, cols, real), values)

  carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  def last_seen(i, top):  # 1 + the last cache slot a row of the tile sees
    at = i * BLOCK_K + jnp.arange(BLOCK_K)
    seen = plgpu.load(mask_ref.at[bi, tile_rows, pl.ds(i * BLOCK_K, BLOCK_K)],
                      mask=real_rows[:, None] & (at < slots)[None, :], other=False)
    return jnp.maximum(top, jnp.max(jnp.where(seen, at[None, :] + 1, 0)))
  # the mask's cache part (a few bytes a row) first: then only the blocks the tile sees
  filled = jax.lax.fori_loop(0, pl.cdiv(slots, BLOCK_K), last_seen, jnp.int32(0))
  carry = jax.lax.fori_loop(0, pl.cdiv(filled, BLOCK_K), block, carry)
  real = jnp.arange(up) < chunk
  keys, values = (load(ref.at[bi, pl.ds(zero, up), hi, :], real) for ref in (kn_ref, vn_ref))
  acc, _, l = update(carry, scores_of(keys, pl.ds(zero + slots, up), real), values)
  out = (acc / l[:, None]).astype(o_ref.dtype).reshape(tq, gp, d)
  plgpu.store(o_ref.at[bi, tile_rows, hi, heads, :], out, mask=real_q)
