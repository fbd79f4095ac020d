"""A decode step's layer on a TPU in four Pallas (Mosaic) kernels: three for the projections
and the MLP, carrying the norms, biases, RoPE, the SiLU gate and the residual adds, around
the attention kernel that reads the stacked cache in place (`tpu_decode_attention.py`).

At a few query rows XLA:TPU compiles each projection to a multiply-and-reduce fusion on the
vector unit and leaves each norm (two kernels), bias, RoPE half, residual add and softmax pass
in kernels of its own: about 22 a layer at batch 1. Here each kernel's grid walks its
weights' column blocks, so the pipeline streams them through VMEM once while the rows (at
most `MAX_ROWS`) stay there, and finishes its outputs itself:

  1. `qkv`      RMSNorm -> x @ wq | wk | wv + biases -> RoPE on q and k; k and v written in
                place into the step's stacked chunk keys and values (no per-layer stacking)
  2. attention over the cache and the chunk (`tpu_decode_attention.decode_attend`)
  3. `project`  attn @ wo + x                        (the residual)
  4. `mlp`      RMSNorm -> silu(x @ w_gate) * (x @ w_up) -> @ w_down + x, the hidden kept
                in VMEM a block of d_ff at a time

The rows stay flat, `[B T, D]`, from the first layer to the last: a TPU tiles 8 rows by 128
lanes, so `[B, T, D]` and `[B T, D]` are laid out differently (each reshape a copy). wq, wk
and wv are read transposed, `[H Dh, D]`, the layout XLA:TPU keeps them in (d_model, not the
heads' 64, on the lanes): read as they are stored, they are not copied every step. Rounding
follows the model's op for op (the 16-bit casts where the model casts), so in float32 the
layers equal the model's up to summation order. `interpret=True` runs the kernels on the CPU
(the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from paraflax.model.attention import resolve
from paraflax.model.tpu_decode_attention import decode_attend
from paraflax.parallel import sharding

MAX_ROWS = 1024  # query rows a layer call may have (B x T); wider calls take XLA's path
COLUMNS = (512, 256, 128)  # a weight's column blocks: the widest that divides it and fits
WEIGHT_VMEM = 16 * 2**20  # ... with its double buffers in this much VMEM
VMEM_LIMIT = 64 * 2**20  # a kernel's VMEM (a TPU v5e core has 128 MiB)
# the kernels' names, and which operands are their weights (`perf compile` costs them as
# matmuls: 2 x rows x the weights' size)
WEIGHTS = {"paraflax_tpu_qkv_matmul": (3, 4, 5), "paraflax_tpu_matmul": (1,),
           "paraflax_tpu_mlp_matmul": (1, 2, 3)}
NAMES = tuple(WEIGHTS)


def runs(cfg, x_shape, cached: bool, t_kv: int, attention: str, backend: str) -> bool:
  """Whether a layer call runs these kernels: a call over a cache whose attention resolves to
  "tpu_decode", on one device, of content rows only (no query stream), at most `MAX_ROWS`
  rows, no per-head norms (Qwen3's q/k norm)."""
  b, t, _ = x_shape
  mesh = sharding.context_mesh()
  return (cached and t_kv == t and b * t <= MAX_ROWS and not cfg.qk_norm
          and (mesh is None or mesh.size == 1)
          and resolve(attention, backend, cfg.compute_dtype, max_len=cfg.max_seq_len, rows=t,
                      cached=True) == "tpu_decode")


def columns(k: int, n: int, weights: int = 1, unit: int = 1) -> int:
  """A `[k, n]` weight's column block: the widest of `COLUMNS` that divides n, is a multiple
  of `unit` and whose `weights` double-buffered blocks fit `WEIGHT_VMEM`; else all n."""
  return next((c for c in COLUMNS if n % c == 0 and c % unit == 0
               and 2 * weights * k * c * 2 <= WEIGHT_VMEM), n)


def _params(semantics: str):
  return pltpu.CompilerParams(dimension_semantics=(semantics,), vmem_limit_bytes=VMEM_LIMIT)


def _normed(x_ref, scale_ref, eps, dt):
  """x's rows RMS-normed as `RMSNorm` does (float32 statistics, cast, times the scale cast)."""
  x = x_ref[...].astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (x * inv).astype(dt) * scale_ref[...].astype(dt)


def _dot(x, w_ref, dt, transposed=False):
  """x @ w (`transposed`: x @ w.T, w `[N, K]`) accumulated in float32, rounded to dt."""
  dims = (((1,), (1 if transposed else 0,)), ((), ()))
  return jax.lax.dot_general(x, w_ref[...].astype(dt), dims,
                             preferred_element_type=jnp.float32).astype(dt)


def _rope_lanes(inv_freq: np.ndarray, width: int) -> np.ndarray:
  """`[1, width]` float32: each lane's RoPE frequency, for heads of `2 len(inv_freq)` lanes
  side by side (a head's two halves take the same frequencies)."""
  return np.tile(np.concatenate([inv_freq, inv_freq]), width // (2 * len(inv_freq)))[None]


def qkv(x_MxD, positions_M, norm_scale, eps, wq, wk, wv, biases, inv_freq, kv, layer: int, *,
        interpret=False):
  """(q `[M, H * Dh]`, k, v): the attention's inputs of rows x, normed, projected, biased
  (`biases` (bq, bk, bv) or None) and rotated at `positions` (q and k, as
  `transformer.apply_rope`), in x's dtype; k and v are written into layer `layer` of `kv`,
  the stacked buffers `[L, M, Hkv * Dh]` (in place: they come back with that layer filled).
  One grid step per column block of wq, then wk, then wv: each weight's block index holds
  still outside its own steps, so the pipeline fetches every block once."""
  m, d = x_MxD.shape
  (_, h, dh), hkv, dt = wq.shape, wk.shape[1], x_MxD.dtype
  widths = (h * dh, hkv * dh, hkv * dh)
  blocks = tuple(columns(d, w, unit=dh) for w in widths)
  counts = tuple(w // c for w, c in zip(widths, blocks))
  starts = tuple(int(s) for s in np.cumsum((0,) + counts[:2]))
  # [out, D]: the layout XLA:TPU keeps them in (module docstring)
  flat = [jnp.moveaxis(w, 0, -1).reshape(-1, d) for w in (wq, wk, wv)]

  def at(n, rows=False):  # part n's block at grid step j: its own steps, else held at an end
    block = lambda j: jnp.clip(j - starts[n], 0, counts[n] - 1)
    return (lambda j: (block(j), 0)) if rows else (lambda j: (0, block(j)))
  full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))
  specs = [full((m, d)), full((m, 1)), full((1, d)),
           *(pl.BlockSpec((c, d), at(n, rows=True)) for n, c in enumerate(blocks)),
           *(full((1, c)) for c in blocks[:2])]
  args = [x_MxD, positions_M.reshape(m, 1), norm_scale.reshape(1, d), *flat,
          *(_rope_lanes(np.asarray(inv_freq, np.float32), c) for c in blocks[:2])]
  if biases is not None:
    specs += [pl.BlockSpec((1, c), at(n)) for n, c in enumerate(blocks)]
    args += [b_.reshape(1, -1) for b_ in biases]
  specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2  # the k, v stacks: written, not read
  args += list(kv)
  in_layer = lambda n: (lambda j: (layer, 0, at(n)(j)[1]))
  out_specs = (pl.BlockSpec((m, blocks[0]), at(0)),
               *(pl.BlockSpec((None, m, blocks[n]), in_layer(n)) for n in (1, 2)))
  out_shape = (jax.ShapeDtypeStruct((m, widths[0]), dt), *(jax.ShapeDtypeStruct(
      a.shape, a.dtype) for a in kv))
  kernel = functools.partial(_qkv_kernel, starts=starts, half=dh // 2, eps=eps,
                             biased=biases is not None)
  return pl.pallas_call(
      kernel, grid=(sum(counts),), in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
      compiler_params=_params("arbitrary"), interpret=interpret, name=NAMES[0])(*args)


def _qkv_kernel(x_ref, pos_ref, scale_ref, wq_ref, wk_ref, wv_ref, fq_ref, fk_ref, *refs,
                starts, half, eps, biased):
  b_refs, refs = (refs[:3], refs[3:]) if biased else ((None,) * 3, refs)
  o_refs = refs[2:]  # after the k, v stacks' inputs (aliased to the last two outputs)
  j, dt = pl.program_id(0), o_refs[0].dtype
  x = _normed(x_ref, scale_ref, eps, dt)

  def rotate(y, freq_ref):  # rotate-half RoPE on every head of the block's lanes
    y = y.astype(jnp.float32)
    angles = pos_ref[...].astype(jnp.float32) * freq_ref[...]  # [M, n]
    n = y.shape[-1]
    first = jax.lax.broadcasted_iota(jnp.int32, y.shape, 1) % (2 * half) < half
    pair = jnp.where(first, -pltpu.roll(y, n - half, 1), pltpu.roll(y, half, 1))
    return (y * jnp.cos(angles) + pair * jnp.sin(angles)).astype(dt)

  def part(w_ref, b_ref, o_ref, freq_ref):
    y = _dot(x, w_ref, dt, transposed=True)
    if b_ref is not None:
      y = y + b_ref[...].astype(dt)
    o_ref[...] = y if freq_ref is None else rotate(y, freq_ref)

  parts = zip((wq_ref, wk_ref, wv_ref), b_refs, o_refs, (fq_ref, fk_ref, None))
  ends = (*starts[1:], None)
  for (w_ref, b_ref, o_ref, f_ref), start, end in zip(parts, starts, ends):
    inside = j >= start if end is None else (j >= start) & (j < end)
    pl.when(inside)(functools.partial(part, w_ref, b_ref, o_ref, f_ref))


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("interpret",))
def project(x_MxK, w_KxN, residual, *, interpret=False):
  """`[M, N]` in x's dtype: x @ w + residual. One grid step per column block of w
  (`columns`); x stays in VMEM throughout."""
  m, k = x_MxK.shape
  n, dt = w_KxN.shape[1], x_MxK.dtype
  c = columns(k, n)
  cols = lambda rows: pl.BlockSpec((rows, c), lambda j: (0, j))  # noqa: E731
  return pl.pallas_call(
      _project_kernel, grid=(n // c,),
      in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)), cols(k), cols(m)], out_specs=cols(m),
      out_shape=jax.ShapeDtypeStruct((m, n), dt), compiler_params=_params("parallel"),
      interpret=interpret, name=NAMES[1])(x_MxK, w_KxN, residual)


def _project_kernel(x_ref, w_ref, res_ref, o_ref):
  o_ref[...] = res_ref[...] + _dot(x_ref[...], w_ref, o_ref.dtype)


# jitted: a program of many layers and steps traces and lowers each distinct kernel once
@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def mlp(x_MxD, w_gate, w_up, w_down, norm_scale, eps, *, interpret=False):
  """`[M, D]`: x + the model's MLP of RMSNorm(x), `(silu(xn @ w_gate) * (xn @ w_up)) @ w_down`,
  in one kernel whose grid walks d_ff's blocks (`columns`): each step's slice of the hidden
  `[M, block]` stays in VMEM and adds its product with w_down's rows to a float32
  accumulator, so the hidden never goes to HBM (at MR's 512 rows 10 MB a layer, written and
  read again by a second kernel)."""
  m, d = x_MxD.shape
  f, dt = w_gate.shape[1], x_MxD.dtype
  c = columns(d, f, weights=3)
  whole = pl.BlockSpec((m, d), lambda j: (0, 0))
  cols = pl.BlockSpec((d, c), lambda j: (0, j))
  return pl.pallas_call(
      functools.partial(_mlp_kernel, eps=eps, last=f // c - 1), grid=(f // c,),
      in_specs=[whole, cols, cols, pl.BlockSpec((c, d), lambda j: (j, 0)),
                pl.BlockSpec((1, d), lambda j: (0, 0))],
      out_specs=whole, out_shape=jax.ShapeDtypeStruct((m, d), dt),
      scratch_shapes=[pltpu.VMEM((m, d), jnp.float32)], compiler_params=_params("arbitrary"),
      interpret=interpret, name=NAMES[2])(x_MxD, w_gate, w_up, w_down, norm_scale.reshape(1, d))


def _mlp_kernel(x_ref, gate_ref, up_ref, down_ref, scale_ref, o_ref, acc_ref, *, eps, last):
  j, dt = pl.program_id(0), o_ref.dtype

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
  x = _normed(x_ref, scale_ref, eps, dt)
  g = _dot(x, gate_ref, dt)  # silu as jax.nn.silu: g * sigmoid(g), each rounded to the dtype
  hidden = g * jax.nn.sigmoid(g.astype(jnp.float32)).astype(dt) * _dot(x, up_ref, dt)
  acc_ref[...] += jnp.dot(hidden, down_ref[...].astype(dt), preferred_element_type=jnp.float32)

  @pl.when(j == last)
  def _():
    o_ref[...] = x_ref[...] + acc_ref[...].astype(dt)


def layers(blocks, x_BxTxD, positions_BxT, mask_BxTxS, cache, inv_freq, *, interpret=False):
  """`(x, (k, v))` as the model's layer loop returns them (k, v `[L, B, T, Hkv, Dh]`), each
  layer a `transformer.Block` in four kernels (module docstring) over the stacked `cache`
  (`KVCache`); `mask` dense `[B, T, S+T]`. The chunk's keys and values go straight into
  stacked buffers, layer by layer in place (no per-layer copy into a stack)."""
  b, t, d = x_BxTxD.shape
  attn = blocks[0].attn
  _, hkv, dh = attn.wk.shape
  kv = tuple(jnp.zeros((len(blocks), b * t, hkv * dh), x_BxTxD.dtype) for _ in range(2))
  x, positions = x_BxTxD.reshape(b * t, d), positions_BxT.reshape(-1)
  for i, layer in enumerate(blocks):
    x, kv = _block(layer, i, x, positions, mask_BxTxS, cache, inv_freq, kv, interpret)
  # the chunk's keys and values only once every layer has read the cache: a commit of them
  # then follows every read, so XLA writes the cache in place (no copy of it for the reads)
  x, kv = jax.lax.optimization_barrier((x, kv))
  return x.reshape(b, t, d), tuple(a.reshape(len(blocks), b, t, hkv, dh) for a in kv)


def _block(layer, i, x_MxD, positions_M, mask_BxTxS, cache, inv_freq, kv, interpret):
  attn = layer.attn
  biases = (attn.bq[...], attn.bk[...], attn.bv[...]) if attn.cfg.qkv_bias else None
  q, *kv = qkv(x_MxD, positions_M, layer.attn_norm.scale[...], layer.attn_norm.eps,
               attn.wq[...], attn.wk[...], attn.wv[...], biases, inv_freq, kv, i,
               interpret=interpret)
  out = decode_attend(q, *kv, mask_BxTxS, cache.k, cache.v, i, interpret=interpret)
  wo = attn.wo[...]
  x = project(out, wo.reshape(-1, wo.shape[-1]), x_MxD, interpret=interpret)
  return mlp(x, layer.mlp.w_gate[...], layer.mlp.w_up[...], layer.mlp.w_down[...],
             layer.mlp_norm.scale[...], layer.mlp_norm.eps, interpret=interpret), tuple(kv)
