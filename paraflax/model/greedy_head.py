"""A greedy decode step's output head in one GPU kernel: the argmax over the vocabulary of
each row's logits, without writing the logits.

A verifying step's rows each need only their argmax, but XLA's head writes float32 logits
`[rows, V]` and a reduction reads them back: at 512 rows of a 151,936-token vocabulary that is
311 MB each way, more than half the weights' 1 GB. Here one Pallas (Triton) program per (tile
of rows, block of `BLOCK_V` vocabulary columns) computes its block of logits as the model's
head does (the weight cast to the rows' dtype, float32 accumulation), and writes only its
block's maximum and the first column reaching it; a small XLA reduction then picks, per row,
the first block reaching the row's maximum: the first maximal column, as `jnp.argmax` picks.

The weight is read in place, either layout: a tied embedding `[V, D]` or an output
projection `[D, V]`. Row tiles are the grid's first axis, so the programs sharing a weight
block are neighbours in the launch order and read it once from memory. `interpret=True` runs
the kernel on the CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from paraflax.model.attention import resolve
from paraflax.model.decode_layer import BLOCK_K, row_tile
from paraflax.parallel import sharding

KERNEL_NAME = "paraflax_argmax_matmul"  # its custom call's name (`perf compile`: a matmul)
TPU_ROWS = 64  # a TPU step this wide, outside `tpu_greedy_head.runs`, takes `argmax_in_chunks`
CHUNK_V = 8192  # its vocabulary columns a chunk
MAX_ROWS = 1024  # rows a call may have; wider calls take XLA's head
BLOCK_V = 128  # vocabulary columns per program (rows and contraction tiled as the decode layer)
_ANY = pl.BlockSpec(memory_space=pl.ANY)


def runs(cfg, rows: int, attention: str, backend: str, decode: str = "gpu_decode") -> bool:
  """Whether a greedy step's head of `rows` rows runs the kernel: where the model's decode
  steps run the GPU decode kernels (16-bit compute on a GPU by default, or
  `attention="gpu_decode"`, then interpreted on a CPU), on one device, at most `MAX_ROWS`.
  `decode`: the decode attention whose steps run a head kernel (`tpu_greedy_head.runs`
  passes "tpu_decode")."""
  mesh = sharding.context_mesh()
  return (rows <= MAX_ROWS and (mesh is None or mesh.size == 1)
          and resolve(attention, backend, cfg.compute_dtype, max_len=cfg.max_seq_len, rows=1,
                      cached=True) == decode)


def mixed(logits_BxTxV, mix):
  """Logits mixed across rows (`Transformer.argmax`'s `mix`: other `[B, T]`, a `[B, T]`):
  row t's are `a * logits[t] + (1 - a) * logits[other]`; None: as they are."""
  if mix is None:
    return logits_BxTxV
  a = mix[1][..., None]
  return a * logits_BxTxV + (1.0 - a) * jnp.take_along_axis(logits_BxTxV, mix[0][..., None], 1)


def argmax_in_chunks(x_BxTxD, w, *, tied: bool, mix=None, columns: int = CHUNK_V):
  """int32 `[B, T]`: `jnp.argmax` of the head's logits (`mix` as `Transformer.argmax` mixes
  them), computed by XLA `columns` vocabulary columns at a time (static slices of the weight,
  one after the other), so a wide TPU step that the TPU kernel does not take
  (`tpu_greedy_head.runs`: float32, or a mesh) never holds `[B, T, V]` float32 logits in HBM:
  each chunk's logits, their maximum and its first column, then the first chunk reaching the
  row's maximum (a last chunk that would run past V starts earlier; its repeated columns
  change no pick)."""
  v = w.shape[0] if tied else w.shape[1]
  t = x_BxTxD.shape[1]
  columns = min(columns, v)
  rows = x_BxTxD
  if mix is not None:  # the rows mixed in beside their own: one gather of hidden states, not
    rows = jnp.concatenate(  # one of each chunk's logits
        [rows, jnp.take_along_axis(rows, mix[0][..., None], 1)], 1)
  best = pick = None
  for start in sorted({min(c, v - columns) for c in range(0, v, columns)}):
    part = w[start:start + columns] if tied else w[:, start:start + columns]
    out = jnp.einsum("btd,cd->btc" if tied else "btd,dc->btc", rows,
                     part.astype(x_BxTxD.dtype), preferred_element_type=jnp.float32)
    if mix is not None:
      a = mix[1][..., None]
      out = a * out[:, :t] + (1.0 - a) * out[:, t:]
    top, col = out.max(-1), start + jnp.argmax(out, -1).astype(jnp.int32)
    if best is None:
      best, pick = top, col
    else:
      better = top > best
      best, pick = jnp.where(better, top, best), jnp.where(better, col, pick)
  return pick


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("tied", "interpret"))
def argmax(x_MxD, w, *, tied: bool, mix=None, interpret: bool = False):
  """int32 `[M]`: the first column of each row's maximal logit, the logits being
  `x @ w.T` (`tied`: w the embedding `[V, D]`) or `x @ w` (w `[D, V]`), w cast to x's dtype
  and accumulated in float32 (`transformer.logits`). `mix` (y `[M, D]`, a `[M]` float32):
  the logits are `a * logits(x) + (1 - a) * logits(y)` (TiDAR's target, weighing its AR
  rows against its diffusion rows), as XLA computes them from the two rows' logits."""
  m, d = x_MxD.shape
  v = w.shape[0] if tied else w.shape[1]
  rows = row_tile(m)
  blocks = pl.cdiv(v, BLOCK_V)
  args = (x_MxD, w) if mix is None else (x_MxD, w, mix[0], mix[1].astype(jnp.float32))
  kernel = functools.partial(_kernel, shape=(m, d, v, rows), tied=tied)
  out = (jax.ShapeDtypeStruct((m, blocks), jnp.float32),
         jax.ShapeDtypeStruct((m, blocks), jnp.int32))
  best, at = pl.pallas_call(
      kernel, grid=(pl.cdiv(m, rows), blocks), in_specs=[_ANY] * len(args),
      out_specs=(_ANY, _ANY), out_shape=out,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret, name=KERNEL_NAME)(*args)
  block = jnp.argmax(best, -1)  # the first block reaching the row's maximum
  return jnp.take_along_axis(at, block[:, None], 1)[:, 0]


def _kernel(x_ref, w_ref, *refs, shape, tied):
  m, d, v, rows = shape
  y_ref, a_ref = refs[:-2] if len(refs) == 4 else (None, None)
  best_ref, at_ref = refs[-2:]
  first, v0 = pl.program_id(0) * rows, pl.program_id(1) * BLOCK_V
  tile = pl.ds(first, rows)
  real = first + jnp.arange(rows) < m
  cols = v0 + jnp.arange(BLOCK_V)
  zero, dt = first * 0, x_ref.dtype
  sources = (x_ref,) if y_ref is None else (x_ref, y_ref)

  def step(i, accs):
    k = i * BLOCK_K + jnp.arange(BLOCK_K) < d
    k0 = zero + i * BLOCK_K
    xs = [plgpu.load(r.at[tile, pl.ds(k0, BLOCK_K)], mask=real[:, None] & k[None, :], other=0.)
          for r in sources]
    if tied:  # [BLOCK_V, BLOCK_K] of the embedding
      w = plgpu.load(w_ref.at[pl.ds(v0, BLOCK_V), pl.ds(k0, BLOCK_K)],
                     mask=(cols < v)[:, None] & k[None, :], other=0.).astype(dt)
      return tuple(acc + plgpu.dot(x, w, trans_b=True) for acc, x in zip(accs, xs))
    w = plgpu.load(w_ref.at[pl.ds(k0, BLOCK_K), pl.ds(v0, BLOCK_V)],
                   mask=k[:, None] & (cols < v)[None, :], other=0.).astype(dt)
    return tuple(acc + plgpu.dot(x, w) for acc, x in zip(accs, xs))

  accs = jax.lax.fori_loop(0, pl.cdiv(d, BLOCK_K), step,
                           tuple(jnp.zeros((rows, BLOCK_V), jnp.float32) for _ in sources))
  logits = accs[0]
  if y_ref is not None:
    a = plgpu.load(a_ref.at[tile], mask=real, other=1.)[:, None]
    logits = a * accs[0] + (1.0 - a) * accs[1]
  logits = jnp.where((cols < v)[None, :], logits, -jnp.inf)
  block = pl.program_id(1)
  plgpu.store(best_ref.at[tile, block], logits.max(-1), mask=real)
  plgpu.store(at_ref.at[tile, block], v0 + jnp.argmax(logits, -1).astype(jnp.int32), mask=real)
