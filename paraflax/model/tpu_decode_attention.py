"""Attention of a decode step on a TPU in one Pallas (Mosaic) kernel per layer, reading the
layer's keys and values in place from the stacked cache, in the layout XLA:TPU keeps it in.

`decode_attend(q, k, v, mask, cache_k, cache_v, layer)`: the step's query rows `[B T, H * D]`
attend the keys [cache slots S | chunk tokens T] under the mask `[B, T, S+T]`, grouped-query
(H = G * Hkv), and the outputs are `[B T, H * D]`: the TPU decode layer's projections'
(`tpu_decode_layer.py`) rows as they are (a reshape to `[B, T, ...]` would be a relayout on
a TPU, whose tiles are 8 rows by 128 lanes). XLA:TPU lays the stacked cache `[L, B, S, Hkv, D]`
out with the slots minor (the lanes: `{2,4,3,1,0}`), so the kernel takes it as `[L, B, Hkv,
D, S]`, a view of the same bytes: K^T and V^T of each head, whose products with the queries
and the probabilities are plain matmuls. One program per batch row reads its row's slots of
layer `layer` (the pipeline fetches the next row's while it computes) and computes every
query head of its T rows over them and the chunk with one softmax, as the
dense path does (`attention._dense`: float32 scores, masked pairs the float32 minimum, the
probabilities rounded to the compute dtype before their product with the values), so in
float32 it equals the dense path up to summation order. `interpret=True` runs it on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

KERNEL_NAME = "paraflax_tpu_decode_attention"  # its custom call's name (`perf compile` costs it)
VMEM_LIMIT = 64 * 2**20
_NEG = jnp.finfo(jnp.float32).min


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("layer", "interpret"))
def decode_attend(q_MxHD, k_LxMxKD, v_LxMxKD, mask_BxTxS, cache_k, cache_v, layer: int, *,
                  interpret: bool = False):
  """`[B T, H * D]` attention of the step's query rows (B rows of T, flat) over layer `layer`
  of the stacked cache `[L, B, S, Hkv, D]` and of the chunk's keys and values, layer `layer`
  of their stacks `[L, B T, Hkv * D]` (module docstring)."""
  b, t, _ = mask_BxTxS.shape
  m, hd = q_MxHD.shape
  _, _, s, hkv, d = cache_k.shape
  dt = q_MxHD.dtype
  slots = lambda c: jnp.moveaxis(c, 2, -1)  # [L, B, Hkv, D, S]: the cache's own layout
  whole = lambda n: pl.BlockSpec((m, n), lambda i: (0, 0))  # every row: one fetch, one write
  chunk = pl.BlockSpec((None, m, hkv * d), lambda i: (layer, 0, 0))
  row = lambda n: pl.BlockSpec((None, t, n), lambda i: (i, 0, 0))
  cache = pl.BlockSpec((None, None, hkv, d, s), lambda i: (layer, i, 0, 0, 0))
  kernel = functools.partial(_kernel, heads=(hd // d, hkv), d=d, scale=d ** -0.5)
  return pl.pallas_call(
      kernel, grid=(b,),
      in_specs=[whole(hd), chunk, chunk, row(s), row(t), cache, cache],
      out_specs=whole(hd), out_shape=jax.ShapeDtypeStruct((m, hd), dt),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                           vmem_limit_bytes=VMEM_LIMIT),
      interpret=interpret, name=KERNEL_NAME,
  )(q_MxHD, k_LxMxKD.astype(dt), v_LxMxKD.astype(dt), *seen(mask_BxTxS, s),
    slots(cache_k).astype(dt), slots(cache_v).astype(dt))


def seen(mask_BxTxS, s: int):
  """The mask's cache and chunk parts, int32 (a kernel's operands hold no bools)."""
  return (mask_BxTxS[..., :s].astype(jnp.int32), mask_BxTxS[..., s:].astype(jnp.int32))


def _kernel(q_ref, kn_ref, vn_ref, seen_ref, seen_chunk_ref, kc_ref, vc_ref, o_ref, *, heads,
            d, scale):
  """Batch row i: its T query rows, every head, over the cache's K^T, V^T `[Hkv, D, S]` and
  the chunk. Its rows of the flat `[B T, ...]` operands are taken, and its outputs put back,
  by matmuls with a 0/1 selection (exact; a TPU loads no rows at an offset it cannot prove
  a multiple of its tile)."""
  h, hkv = heads
  g, dt = h // hkv, o_ref.dtype
  m, t = q_ref.shape[0], seen_chunk_ref.shape[-1]
  nt, tn = (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))  # a @ b.T, a.T @ b
  mine = (jax.lax.broadcasted_iota(jnp.int32, (t, m), 1)
          == pl.program_id(0) * t + jax.lax.broadcasted_iota(jnp.int32, (t, m), 0))
  select = (lambda a: a) if m == t else (
      lambda a: jnp.dot(mine.astype(a.dtype), a, preferred_element_type=jnp.float32
                        ).astype(a.dtype))
  seen, seen_chunk = seen_ref[...] != 0, seen_chunk_ref[...] != 0  # [T, S], [T, T]
  outs = []
  for i in range(h):
    kv = i // g
    q = select(q_ref[:, pl.ds(i * d, d)])  # [T, D]
    kn, vn = (select(ref[:, pl.ds(kv * d, d)]) for ref in (kn_ref, vn_ref))
    cached = jnp.dot(q, kc_ref[kv], preferred_element_type=jnp.float32)  # [T, S]
    chunk = jax.lax.dot_general(q, kn, nt, preferred_element_type=jnp.float32)  # [T, T]
    cached = jnp.where(seen, cached * scale, _NEG)
    chunk = jnp.where(seen_chunk, chunk * scale, _NEG)
    top = jnp.maximum(cached.max(-1, keepdims=True), chunk.max(-1, keepdims=True))
    e_cached, e_chunk = jnp.exp(cached - top), jnp.exp(chunk - top)
    total = e_cached.sum(-1, keepdims=True) + e_chunk.sum(-1, keepdims=True)
    out = jax.lax.dot_general((e_cached / total).astype(dt), vc_ref[kv], nt,
                              preferred_element_type=jnp.float32).astype(dt)
    outs.append(out + jnp.dot((e_chunk / total).astype(dt), vn,
                              preferred_element_type=jnp.float32).astype(dt))
  out = jnp.concatenate(outs, axis=-1)  # [T, H D]
  if m == t:
    o_ref[...] = out
    return

  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += jax.lax.dot_general(mine.astype(dt), out, tn,
                                    preferred_element_type=jnp.float32).astype(dt)
