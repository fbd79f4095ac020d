"""A greedy decode step's output head on a TPU in one Pallas (Mosaic) kernel: each row's argmax
over the vocabulary, without the logits reaching HBM.

XLA:TPU computes a wide step's head (`greedy_head.argmax_in_chunks`) as a few kernels per
vocabulary chunk: each chunk's logits, their maximum and first maximal column, and the
running pick. At TiDAR k=4's 160 rows that is about 80 kernels a step, as many as its 24
layers' 96. Here one kernel's grid walks the weight's blocks of vocabulary columns, so the
pipeline streams the weight through VMEM once while the rows stay there. Each step computes
its block's logits as the model's head does (the weight cast to the rows' dtype, float32
accumulation; TiDAR's mix `a * logits(x) + (1 - a) * logits(y)` as `greedy_head.mixed`),
and keeps, per row, the running maximum and the first column reaching it in its outputs,
which stay in VMEM from the first step to the last: a later block replaces the pick only
with a strictly larger logit, so the pick is the first maximal column, as `jnp.argmax`'s.

The weight is read in place, either layout: a tied embedding `[V, D]` or an output
projection `[D, V]`. A last block past V is masked by column. `interpret=True` runs the
kernel on the CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from paraflax.model import greedy_head
from paraflax.model.tpu_decode_layer import VMEM_LIMIT, WEIGHT_VMEM

KERNEL_NAME = "paraflax_tpu_argmax_matmul"  # its custom call's name (`perf compile`: a matmul)
BLOCKS_V = (2048, 1024, 512, 256, 128)  # vocabulary columns a grid step: the widest that fits
LOGITS_VMEM = 8 * 2**20  # ... a block's float32 logits of every source in this much VMEM


def runs(cfg, rows: int, attention: str, backend: str) -> bool:
  """Whether a greedy step's head of `rows` rows runs the kernel: where the model's decode
  steps run the TPU decode layer (16-bit compute on a TPU by default, or
  `attention="tpu_decode"`, then interpreted on a CPU), on one device, at most
  `greedy_head.MAX_ROWS` (`greedy_head.runs`' rule)."""
  return greedy_head.runs(cfg, rows, attention, backend, decode="tpu_decode")


def block_v(rows: int, sources: int, d: int, itemsize: int) -> int:
  """The vocabulary columns of a grid step: the widest of `BLOCKS_V` whose float32 logits,
  `[rows, block]` for each of `sources` (2 mixed), fit `LOGITS_VMEM`, and whose weight block
  of `d` x block elements of `itemsize` bytes fits `WEIGHT_VMEM` double-buffered."""
  return next((c for c in BLOCKS_V if sources * max(rows, 8) * c * 4 <= LOGITS_VMEM
               and 2 * d * c * itemsize <= WEIGHT_VMEM), BLOCKS_V[-1])


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("tied", "columns", "interpret"))
def argmax(x_MxD, w, *, tied: bool, mix=None, columns: int | None = None,
           interpret: bool = False):
  """int32 `[M]`: the first column of each row's maximal logit, the logits being
  `x @ w.T` (`tied`: w the embedding `[V, D]`) or `x @ w` (w `[D, V]`), w cast to x's dtype
  and accumulated in float32 (`transformer.logits`). `mix` (y `[M, D]`, a `[M]`): the logits
  are `a * logits(x) + (1 - a) * logits(y)` (TiDAR's target). `columns`: a grid step's
  vocabulary columns (default `block_v`'s)."""
  m, d = x_MxD.shape
  v = w.shape[0] if tied else w.shape[1]
  c = columns or block_v(m, 1 if mix is None else 2, d, w.dtype.itemsize)
  whole = lambda shape: pl.BlockSpec(shape, lambda j: (0, 0))  # noqa: E731
  specs = [whole((m, d)), pl.BlockSpec((c, d), lambda j: (j, 0)) if tied
           else pl.BlockSpec((d, c), lambda j: (0, j))]
  args = [x_MxD, w]
  if mix is not None:
    specs += [whole((m, d)), whole((m, 1))]
    args += [mix[0], mix[1].astype(jnp.float32).reshape(m, 1)]
  out_shape = (jax.ShapeDtypeStruct((m, 1), jnp.float32), jax.ShapeDtypeStruct((m, 1), jnp.int32))
  _, pick = pl.pallas_call(
      functools.partial(_kernel, v=v, block=c, tied=tied), grid=(pl.cdiv(v, c),),
      in_specs=specs, out_specs=(whole((m, 1)), whole((m, 1))), out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                           vmem_limit_bytes=VMEM_LIMIT),
      interpret=interpret, name=KERNEL_NAME)(*args)
  return pick[:, 0]


def _kernel(x_ref, w_ref, *refs, v, block, tied):
  y_ref, a_ref = refs[:2] if len(refs) == 4 else (None, None)
  best_ref, pick_ref = refs[-2:]
  j, dt = pl.program_id(0), x_ref.dtype
  w = w_ref[...].astype(dt)
  dims = (((1,), (1 if tied else 0,)), ((), ()))  # x @ w.T (the embedding) or x @ w
  def head(r):  # [M, block] float32
    return jax.lax.dot_general(r[...], w, dims, preferred_element_type=jnp.float32)
  out = head(x_ref)
  if y_ref is not None:
    a = a_ref[...]
    out = a * out + (1.0 - a) * head(y_ref)
  cols = j * block + jax.lax.broadcasted_iota(jnp.int32, out.shape, 1)
  out = jnp.where(cols < v, out, -jnp.inf)  # a last block's columns past V
  top = out.max(-1, keepdims=True)
  col = jnp.min(jnp.where(out == top, cols, v), -1, keepdims=True)  # the block's first

  @pl.when(j == 0)
  def _():
    best_ref[...], pick_ref[...] = top, col

  @pl.when(j > 0)
  def _():
    better = top > best_ref[...]
    best_ref[...] = jnp.where(better, top, best_ref[...])
    pick_ref[...] = jnp.where(better, col, pick_ref[...])
