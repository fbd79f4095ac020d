"""A decode step's layer in five GPU kernels: Pallas (Triton) projections that carry the
norms, biases, RoPE, the SiLU gate and the residual adds with them, around the decode
attention kernel (`decode_attention.py`).

At a few query rows XLA compiles each projection to a multiply-and-reduce fusion and leaves
every norm, bias, RoPE, gate and residual add in kernels of its own (about 15 a layer): it
will not fuse a norm into a reduction that reads each normed element once per output column.
Here each projection kernel recomputes what it reads (the norm of a few rows is cheap) and
finishes its outputs itself:

  1. `qkv`   RMSNorm -> x @ [wq | wk | wv] + biases -> RoPE on q and k: one program per head
  2. attention over the cache in place (`decode_attention.decode_attend`)
  3. `project` attn @ wo + x                        (the residual)
  4. `project` RMSNorm -> silu(x @ w_gate) * (x @ w_up)
  5. `project` act @ w_down + x

Weights are read in place in the training layout (no decode copy, none hoisted by XLA).
Each program computes a tile of 16 to 64 rows (a Triton dot's smallest tile, and a tile that
keeps its weights' reads few) and a block of output columns; a wide step (up to `MAX_ROWS`:
MR's candidate rows or TiDAR's k(1+k) at batch 8) has more row tiles, whose programs for one
column block are neighbours in the launch order (the row tile is the grid's first axis), so
their shared weight block is read from L2, not again from memory. Every array is read and
written unpadded, through masked tiles. Rounding follows the model's op for op (the 16-bit
casts where the model casts), so in float32 the layer equals the model's up to summation
order. `interpret=True` runs the kernels on the CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from paraflax.model.attention import resolve
from paraflax.model.decode_attention import decode_attend, supports
from paraflax.parallel import sharding

# the kernels' names, and which operands are their weights (`perf compile` costs them as
# matmuls: 2 x rows x the weights' size)
WEIGHTS = {"paraflax_qkv_matmul": (3, 4, 5), "paraflax_matmul": (1,),
           "paraflax_gated_matmul": (1, 2)}
MAX_ROWS = 1024  # query rows a layer call may have (B x T); wider calls take XLA's path
MIN_ROWS, TILE_ROWS = 16, 64  # a program's rows: a Triton dot's smallest tile, the largest
PROGRAMS = 64  # a projection's output columns go in blocks of 64, 32 or 16: the widest that
#                still makes this many programs (row tiles x column blocks) for the SMs
BLOCK_K = 128  # contraction elements per iteration of a projection's loop
_ANY = pl.BlockSpec(memory_space=pl.ANY)


def runs(cfg, x_shape, cached: bool, t_kv: int, attention: str, backend: str) -> bool:
  """Whether a layer call runs these kernels: a call over a cache whose attention resolves to
  the decode kernel ("gpu_decode"), on one device, of content rows only (no query stream),
  at most `MAX_ROWS` rows, heads of at least 32 (each RoPE half a dot's 16), no per-head
  norms (Qwen3's q/k norm)."""
  b, t, _ = x_shape
  mesh = sharding.context_mesh()
  return (cached and t_kv == t and b * t <= MAX_ROWS and not cfg.qk_norm
          and supports(cfg.dim_per_head // 2) and (mesh is None or mesh.size == 1)
          and resolve(attention, backend, cfg.compute_dtype, max_len=cfg.max_seq_len, rows=t,
                      cached=True) == "gpu_decode")


def _pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def row_tile(m: int) -> int:
  """A program's rows for a call of `m` rows (`MIN_ROWS` to `TILE_ROWS`, a power of two)."""
  return min(max(MIN_ROWS, _pow2(m)), TILE_ROWS)


def column_block(m: int, n: int) -> int:
  """A projection's output columns per program at `m` rows of `n` columns (`PROGRAMS`)."""
  tiles = pl.cdiv(m, row_tile(m))
  return next(c for c in (64, 32, 16) if tiles * pl.cdiv(n, c) >= PROGRAMS or c == 16)


def _call(kernel, grid, args, out_shape, interpret, name):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[_ANY] * len(args),
      out_specs=jax.tree.map(lambda _: _ANY, out_shape), out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret, name=name)(*args)


def _normed(x_ref, rows, real, k, scale_ref, eps, dt, zero):
  """`load(k0, n, cols)`: columns k0:k0+n of the rows `rows` of x (`cols` of them real),
  RMS-normed as `RMSNorm` does (float32 statistics, cast, times the scale cast), or as they
  are without `scale_ref`. `zero`: a traced 0 (a static slice past an end is refused)."""
  if scale_ref is None:
    return lambda k0, n, cols: plgpu.load(x_ref.at[rows, pl.ds(k0, n)],
                                          mask=real[:, None] & cols[None, :], other=0.)

  def square_sum(i, acc):
    cols = i * BLOCK_K + jnp.arange(BLOCK_K) < k
    x = plgpu.load(x_ref.at[rows, pl.ds(zero + i * BLOCK_K, BLOCK_K)],
                   mask=real[:, None] & cols[None, :], other=0.).astype(jnp.float32)
    return acc + (x * x).sum(-1)
  ss = jax.lax.fori_loop(0, pl.cdiv(k, BLOCK_K), square_sum,
                         jnp.zeros((real.shape[0],), jnp.float32))
  inv = jax.lax.rsqrt(ss / k + eps)

  def load(k0, n, cols):
    x = plgpu.load(x_ref.at[rows, pl.ds(k0, n)], mask=real[:, None] & cols[None, :], other=0.)
    s = plgpu.load(scale_ref.at[pl.ds(k0, n)], mask=cols, other=0.)
    return (x.astype(jnp.float32) * inv[:, None]).astype(dt) * s.astype(dt)
  return load


def _matvec(load, k, w_ref, index, dt, zero, real_cols=None):
  """The loop step `(i, acc) -> acc` adding the loaded rows times `w_ref.at[index(k0)]` (the
  contraction's `[BLOCK_K, n]` tiles, the last masked, and columns past `real_cols`)."""
  def step(i, acc):
    k0 = zero + i * BLOCK_K
    cols = i * BLOCK_K + jnp.arange(BLOCK_K) < k
    mask = cols[:, None] if real_cols is None else cols[:, None] & real_cols[None, :]
    w = plgpu.load(w_ref.at[index(k0)], mask=mask, other=0.)
    return acc + plgpu.dot(load(k0, BLOCK_K, cols), w.astype(dt))
  return step


def _loop(step, k, rows, n):
  return jax.lax.fori_loop(0, pl.cdiv(k, BLOCK_K), step, jnp.zeros((rows, n), jnp.float32))


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def qkv(x_MxD, positions_M, norm_scale, eps, wq, wk, wv, biases, inv_freq, *,
        interpret=False):
  """(q `[M, H, Dh]`, k, v `[M, Hkv, Dh]`): the attention's inputs of rows x, normed, projected,
  biased (`biases` (bq, bk, bv) or None) and rotated at `positions` (q and k, as
  `transformer.apply_rope`), in x's dtype. One program per (row tile, head of q, k or v)."""
  m, d = x_MxD.shape
  _, h, dh = wq.shape
  hkv, rows, dt = wk.shape[1], row_tile(m), x_MxD.dtype
  heads = (h, hkv, hkv)
  args = (x_MxD, positions_M, norm_scale, wq, wk, wv, jnp.asarray(inv_freq, jnp.float32),
          *(biases or ()))
  out = tuple(jax.ShapeDtypeStruct((m, n, dh), dt) for n in heads)
  kernel = functools.partial(_qkv_kernel, shape=(m, d, dh, rows, heads), eps=eps,
                             biased=biases is not None)
  return _call(kernel, (pl.cdiv(m, rows), sum(heads)), args, out, interpret, "paraflax_qkv_matmul")


def _qkv_kernel(x_ref, pos_ref, scale_ref, wq_ref, wk_ref, wv_ref, freq_ref, *refs, shape, eps,
                biased):
  m, d, dh, rows, heads = shape
  b_refs, o_refs = (refs[:3], refs[3:]) if biased else ((None,) * 3, refs)
  first, j = pl.program_id(0) * rows, pl.program_id(1)
  tile = pl.ds(first, rows)
  real = first + jnp.arange(rows) < m
  dt, half = o_refs[0].dtype, dh // 2
  zero = first * 0
  load = _normed(x_ref, tile, real, d, scale_ref, eps, dt, zero)
  pos = plgpu.load(pos_ref.at[tile], mask=real, other=0).astype(jnp.float32)
  angles = pos[:, None] * freq_ref[...][None, :]  # [rows, Dh/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)

  def head(w_ref, b_ref, o_ref, i, rotate):
    halves = []
    for lo in (0, half):  # the two halves RoPE pairs, as two tiles
      cols = pl.ds(zero + lo, half)
      index = lambda k0, c=cols: (pl.ds(k0, BLOCK_K), i, c)
      acc = _loop(_matvec(load, d, w_ref, index, dt, zero), d, rows, half).astype(dt)
      if b_ref is not None:
        acc = acc + b_ref[i, pl.ds(lo, half)].astype(dt)[None, :]
      halves.append(acc)
    if rotate:
      x1, x2 = (x.astype(jnp.float32) for x in halves)
      halves = [(x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt)]
    for lo, x in zip((0, half), halves):
      plgpu.store(o_ref.at[tile, i, pl.ds(zero + lo, half)], x, mask=real[:, None])

  h, hkv, _ = heads
  refs = list(zip((wq_ref, wk_ref, wv_ref), b_refs, o_refs))
  for n, (start, rotate) in enumerate(((0, True), (h, True), (h + hkv, False))):
    pl.when((j >= start) & (j < start + heads[n]))(
        lambda n=n, start=start, rotate=rotate: head(*refs[n], j - start, rotate))


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def project(x_MxK, w_KxN, *, residual=None, norm_scale=None, eps=0.0, gate=None,
            interpret=False):
  """`[M, N]` in x's dtype: x (RMS-normed by `norm_scale`, if given) times w, then
  `silu(x @ gate) * (x @ w)` when `gate` `[K, N]` is given, then `+ residual`.
  One program per (row tile, block of output columns)."""
  m, k = x_MxK.shape
  n, rows, dt = w_KxN.shape[1], row_tile(m), x_MxK.dtype
  cols = column_block(m, n)
  args = [x_MxK, w_KxN] + [a for a in (gate, residual, norm_scale) if a is not None]
  name = "paraflax_matmul" if gate is None else "paraflax_gated_matmul"
  kernel = functools.partial(_project_kernel, shape=(m, k, n, rows, cols), eps=eps,
                             has=(gate is not None, residual is not None, norm_scale is not None))
  return _call(kernel, (pl.cdiv(m, rows), pl.cdiv(n, cols)), args,
               jax.ShapeDtypeStruct((m, n), dt), interpret, name)


def _project_kernel(x_ref, w_ref, *refs, shape, eps, has):
  m, k, n, rows, cols = shape
  o_ref = refs[-1]
  refs = iter(refs[:-1])
  gate_ref, res_ref, scale_ref = (next(refs) if h else None for h in has)
  first, c0 = pl.program_id(0) * rows, pl.program_id(1) * cols
  tile, out_cols = pl.ds(first, rows), pl.ds(c0, cols)
  real = first + jnp.arange(rows) < m
  real_cols = c0 + jnp.arange(cols) < n
  dt, zero = o_ref.dtype, first * 0
  load = _normed(x_ref, tile, real, k, scale_ref, eps, dt, zero)

  def w_tile(ref):
    index = lambda k0: (pl.ds(k0, BLOCK_K), out_cols)
    return _loop(_matvec(load, k, ref, index, dt, zero, real_cols), k, rows, cols).astype(dt)
  out = w_tile(w_ref)
  if gate_ref is not None:
    g = w_tile(gate_ref)  # silu as jax.nn.silu: g * sigmoid(g), each rounded to the dtype
    out = g * jax.nn.sigmoid(g.astype(jnp.float32)).astype(dt) * out
  mask = real[:, None] & real_cols[None, :]
  if res_ref is not None:
    out = plgpu.load(res_ref.at[tile, out_cols], mask=mask, other=0.) + out
  plgpu.store(o_ref.at[tile, out_cols], out, mask=mask)


def block(layer, x_BxTxD, positions_BxT, mask_BxTxS, cache, inv_freq, *, interpret=False):
  """`(x, (k, v))` as `transformer.Block` returns them, in five kernels (module docstring):
  `layer` a `Block`, `cache` its `CacheLayer`, `mask` dense `[B, T, S+T]`."""
  b, t, d = x_BxTxD.shape
  attn, mlp = layer.attn, layer.mlp
  eps = layer.attn_norm.eps
  x = x_BxTxD.reshape(b * t, d)
  biases = (attn.bq[...], attn.bk[...], attn.bv[...]) if attn.cfg.qkv_bias else None
  q, k, v = qkv(x, positions_BxT.reshape(-1), layer.attn_norm.scale[...], eps, attn.wq[...],
                attn.wk[...], attn.wv[...], biases, inv_freq, interpret=interpret)
  split = lambda a: a.reshape(b, t, *a.shape[1:])
  k, v = split(k), split(v)
  out = decode_attend(split(q), k, v, mask_BxTxS, cache.k, cache.v, cache.layer,
                      interpret=interpret)
  wo = attn.wo[...]
  x = project(out.reshape(b * t, -1), wo.reshape(-1, wo.shape[-1]), residual=x,
              interpret=interpret)
  act = project(x, mlp.w_up[...], gate=mlp.w_gate[...], norm_scale=layer.mlp_norm.scale[...],
                eps=layer.mlp_norm.eps, interpret=interpret)
  x = project(act, mlp.w_down[...], residual=x, interpret=interpret)
  return x.reshape(b, t, d), (k, v)
