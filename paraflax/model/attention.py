"""Masked attention: one function with pluggable implementations behind the explicit mask.

`attend(q, k, v, mask, attention=..., cache_kv=...)`: queries `[B, T, H, D]` attend the
keys [cache slots S | chunk tokens] under the mask `[B, T, S+T]` (query may attend key),
grouped-query: H = G * Hkv, query head h reads kv head h // G. The mask is a bool array or
a `mask_structure.Structured` (fields and a rule): a kernel takes a causal structure as its
own causal mask (`kernel_mask`: it skips the blocks above the diagonal), any other as the
dense bool mask. The `attention` setting (`RunControl.attention`, checked there) names an
implementation:

  xla          dense einsum scores `[B, Hkv, G, T, S+T]` float32; the reference. The cache is
               read in place (no concatenation); memory quadratic in length.
  xla_chunked  tokamax's chunked XLA attention (online softmax over key chunks of 1024 and
               query chunks of 512, each chunk rematerialised): every backend, memory linear.
  mosaic       tokamax Pallas kernels: TPU splash attention / Mosaic GPU (sm90+). Splash
               attention tiles queries and keys in blocks of `KERNEL_BLOCK` (128): other
               lengths are padded to its multiple (`_padded`; padding keys are never seen).
  triton       tokamax Pallas Triton flash attention (GPU).
  gpu_decode   paraflax's Pallas Triton decode kernel (`decode_attention.py`) for a call over a
               cache with at most `GPU_DECODE_ROWS` query rows: one kernel per layer, the cache
               read in place; any other call resolves as "auto" would. On the CPU it runs
               interpreted (tests); under a mesh of several devices, or for heads
               narrower than 16 (`decode_attention.supports`), it is dense xla. Where
               `decode_layer.runs` says so (up to `decode_layer.MAX_ROWS` rows, heads of
               32 and wider), the whole layer is then five kernels (`decode_layer.py`).
  tpu_decode   the TPU's decode layer for a call over a cache with at most `TPU_DECODE_ROWS`
               query rows: four Pallas Mosaic kernels a layer, the attention kernel reading
               the stacked cache in place in XLA:TPU's layout (`tpu_decode_attention.py`)
               and three for the projections and the MLP, carrying the norms, biases, RoPE,
               the gate and the residuals (`tpu_decode_layer.py`); where that layer does not
               run (a mesh, the query stream, q/k norms) dense xla. Any other call resolves
               as "auto" would. On the CPU it runs interpreted (tests).
  cudnn        cuDNN flash attention through `jax.nn.dot_product_attention` (GPU); a dense
               mask becomes its additive bias `[B, 1, T, K]` (quadratic memory, one kernel);
               lengths padded to multiples of `CUDNN_BLOCK`, as splash attention's.
  auto         `resolve`: static in (backend, compute dtype, max_seq_len) plus the decode
               rule; what it picks per backend, and where a device verified it:
               docs/kernels.md.

Under a mesh (`sharding.use_mesh` / `traced_on`, more than one device) the kernels run in a
`jax.shard_map` (XLA cannot partition a custom kernel call): rows split over the batch axes,
heads over "tensor" when it divides the kv heads (a query head stays with its kv head), the
rest replicated; xla and xla_chunked are partitioned by XLA itself.

xla and xla_chunked honour `jax_default_matmul_precision` (float32 exactness); the
accelerator kernels do not promise to, so "auto" never picks them for float32 compute.
A query row whose mask is all False (padding; its output is ignored) gets the mean of all
values (uniform weights) on every implementation: finite, never NaN (cuDNN's bias and
splash attention's mask value are the float32 minimum, as here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from paraflax.model import decode_attention, mask_structure
from paraflax.model.cache import CacheLayer
from paraflax.model.decode_attention import decode_attend
from paraflax.model.mask_structure import Structured
from paraflax.parallel import sharding

IMPLEMENTATIONS = ("auto", "xla", "xla_chunked", "mosaic", "triton", "cudnn", "gpu_decode",
                   "tpu_decode")
ACCELERATED = ("mosaic", "triton", "cudnn")  # kernels that do not run on CPU
# "auto" thresholds, from CPU measurements (docs/scaling.md, Attention; at model level
# `paraflax perf slots` / `perf train --attention xla|xla_chunked` measure the same choice):
DECODE_ROWS = 64  # a call over a cache with at most this many query rows runs dense xla
# ... or, on a GPU in 16-bit, the decode kernel up to this many: TiDAR k=8's 72 rows and the
# released MR loop's 80 (a kernel that tiles its rows: no cache copy, no K/V repeat)
GPU_DECODE_ROWS = 128
# ... and on a TPU, dense xla up to this many: splash attention would copy the cache in front
# of the chunk and derive its block layout from the dense mask in every layer (TiDAR k=8 at
# batch 8: 3,948 kernels a target forward, performance.md section 12)
TPU_DECODE_ROWS = 128
DENSE_MAX_LEN = 1024  # on CPU / float32, models with max_seq_len up to this run dense xla
KERNEL_BLOCK = 128  # TPU splash attention's query and key block (tokamax's default config)
# splash's backward over a static mask (causal, or none) writes a float32 partial dq per key
# block, summed after it (over a dense mask it sums them in the kernel): its key blocks up to
# this long there (tokamax's default, 128, wrote 32 of them at 4,096 keys: a third of the TPU
# v5e AR step's HBM bytes)
SPLASH_BWD_KEYS = 512
CUDNN_BLOCK = 64  # cuDNN's backward declines lengths such as 257 ("vjp not implemented")

_NEG = jnp.finfo(jnp.float32).min  # masked score: a fully masked row stays finite (uniform)


def resolve(attention: str, backend: str, dtype, *, max_len: int | None = None,
            rows: int = 0, cached: bool = False) -> str | tuple[str, ...]:
  """The implementation the `attention` setting stands for: static (backend, dtype, the
  model's `max_len`; query `rows` and whether there is a cache, for the decode rule).

  "auto", in order: (1) decode rule: a call over a cache with <= `GPU_DECODE_ROWS` query
  rows runs "gpu_decode" on a GPU with 16-bit compute (one kernel per layer); on a TPU one
  with <= `TPU_DECODE_ROWS` runs "tpu_decode" with 16-bit compute, else "xla"; elsewhere one
  with <= `DECODE_ROWS` runs "xla" (reads the cache in place, memory linear in S for few
  rows);
  (2) on CPU or with float32 compute (float32 exactness, DESIGN invariant 1, needs a path
  that honours the matmul precision) "xla" for a model with max_seq_len <= `DENSE_MAX_LEN`,
  else "xla_chunked"; (3) with 16-bit compute, on GPU "cudnn" (cuDNN's fused flash
  attention, forward and backward one kernel each), on TPU "mosaic" (splash attention, its
  blocks padded), falling back to "xla_chunked" for a shape the kernel declines.
  So one `generate` call runs one implementation for its prefill and every step wider than
  the decode rule's width, and the decode rule's for steps up to it.
  """
  if attention not in IMPLEMENTATIONS:
    raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}; got {attention!r}")
  bits16 = jnp.dtype(dtype) != jnp.float32
  gpu16, tpu16 = backend == "gpu" and bits16, backend == "tpu" and bits16
  decode = cached and rows <= (GPU_DECODE_ROWS if gpu16 or attention == "gpu_decode"
                               else TPU_DECODE_ROWS if backend == "tpu"
                               or attention == "tpu_decode" else DECODE_ROWS)
  if attention in ("gpu_decode", "tpu_decode") and not decode:
    attention = "auto"
  if attention != "auto":
    if attention in ACCELERATED and backend == "cpu":
      raise ValueError(f"attention={attention!r} needs a GPU or TPU; this backend is cpu "
                       "(use 'auto', 'xla' or 'xla_chunked')")
    return attention
  if decode:
    return "gpu_decode" if gpu16 else "tpu_decode" if tpu16 else "xla"
  if backend == "cpu" or jnp.dtype(dtype) == jnp.float32:
    return "xla" if max_len is not None and max_len <= DENSE_MAX_LEN else "xla_chunked"
  return "cudnn" if backend == "gpu" else ("mosaic", "xla_chunked")


def attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxS, *, attention: str = "xla",
           cache_kv=None, max_len: int | None = None, backend: str | None = None):
  """Masked attention `[B, T, H, D]` over keys [cache slots | chunk]: k, v `[B, T', Hkv, D]`
  (T' = T, or fewer for two-stream calls), `cache_kv` None, (k, v) `[B, S, Hkv, D]` or a
  `CacheLayer` of the stacked cache (cast to q's dtype), mask `[B, T, S+T']` (bool or
  `Structured`). `attention`, `max_len` and `backend` (the platform to resolve for; None:
  the default backend): see `resolve`. A kernel under a mesh runs in a shard_map
  (`_shard_mapped`)."""
  q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = map(jnp.asarray, (q_BxTxHxD, k_BxTxKxD, v_BxTxKxD))
  if isinstance(cache_kv, tuple):
    cache_kv = CacheLayer(cache_kv[0][None], cache_kv[1][None], 0)
  s = 0 if cache_kv is None else cache_kv.k.shape[2]
  t, dt = q_BxTxHxD.shape[1], q_BxTxHxD.dtype
  backend = backend or jax.default_backend()
  impl = resolve(attention, backend, dt, max_len=max_len, rows=t, cached=cache_kv is not None)
  mesh = sharding.context_mesh()
  if (impl == "gpu_decode" and (mesh is None or mesh.size == 1)
      and decode_attention.supports(q_BxTxHxD.shape[-1])):
    return decode_attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, dense_mask(mask_BxTxS), cache_kv.k,
                         cache_kv.v, cache_kv.layer, interpret=backend == "cpu")
  cache_kv = None if cache_kv is None else cache_kv.kv()
  if impl in ("gpu_decode", "tpu_decode"):  # under a mesh (a call XLA cannot partition),
    impl = "xla"  # heads the GPU kernel declines, calls the TPU layer does not take
  kernel = set((impl,) if isinstance(impl, str) else impl) & set(ACCELERATED)
  if impl == "xla":
    return _dense(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, dense_mask(mask_BxTxS), cache_kv)
  k, v = k_BxTxKxD, v_BxTxKxD
  if s:  # the kernels take one key array: copy the cache in front of the chunk
    k = jnp.concatenate([cache_kv[0].astype(dt), k], axis=1)
    v = jnp.concatenate([cache_kv[1].astype(dt), v], axis=1)
  if kernel:
    splash = "mosaic" in kernel
    calls = kernel_calls(mask_BxTxS, t, lengths=not splash, windows=not splash)
  else:  # xla_chunked
    calls = [(0, t, None, False, {"mask": dense_mask(mask_BxTxS)})]
  return _kernel(q_BxTxHxD, k, v, impl, kernel, calls, mask_BxTxS, tpu=backend == "tpu")


def _kernel(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, impl, kernel: set, calls: list, mask=None,
            tpu: bool = False):
  """The kernel `impl` over each of `calls` (`kernel_calls`), its outputs in row order; on a
  TPU, splash over a static mask with its backward's key blocks of `splash_keys` (`_splash`).
  A splash call with a dense mask runs in a name scope `splash_tiles_{run}_of_{tiles}`
  (`splash_tiles`), which the compile rows' costing reads."""
  block = KERNEL_BLOCK if "mosaic" in kernel else CUDNN_BLOCK if "cudnn" in kernel else 1
  mesh = sharding.context_mesh() if kernel else None
  outs = []
  for r0, r1, keys, causal, arrays in calls:
    tiles = (splash_tiles(mask, r0, r1, keys, k_BxSxKxD.shape[1])
             if "mosaic" in kernel and "mask" in arrays else None)
    q, k, v = q_BxTxHxD[:, r0:r1], keys_of(k_BxSxKxD, keys), keys_of(v_BxSxKxD, keys)
    if "mask" in arrays:
      arrays = {**arrays, "mask": jnp.broadcast_to(arrays["mask"], (*q.shape[:2], k.shape[1]))}

    def call(q, k, v, arrays, causal=causal):
      t = q.shape[1]
      q, k, v, arrays = _padded(q, k, v, causal, arrays, block)
      if "mask" in arrays:
        arrays = {**arrays, "mask": arrays["mask"][:, None]}  # [B, 1, T, K]: every head alike
      chosen = impl
      if tpu and "mosaic" in kernel and "mask" not in arrays:
        splash = _splash(k.shape[1])
        chosen = [splash if i == "mosaic" else i
                  for i in ((impl,) if isinstance(impl, str) else impl)]
      out = tokamax_module().dot_product_attention(q, k, v, is_causal=causal,
                                                   implementation=chosen, **arrays)
      return out[:, :t]

    if mesh is not None and mesh.size > 1:  # XLA cannot partition a kernel's custom call
      call = _shard_mapped(call, mesh, k.shape, arrays)
    with jax.named_scope("" if tiles is None else "splash_tiles_{}_of_{}".format(*tiles)):
      outs.append(call(q, k, v, arrays))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, 1)


def splash_tiles(mask, r0: int, r1: int, keys: tuple | None, s: int) -> tuple[int, int] | None:
  """(tiles run, tiles) of splash attention's call over query rows `r0:r1` of `mask` and the
  key segments `keys` (None: all `s`), in `KERNEL_BLOCK` tiles after `_padded`'s padding. Splash
  skips the tiles of a dense mask that hold no pair. A tile counts as empty when the mask's
  structure leaves it empty for every row: a query sees no key outside its window's segments
  and, under a `SUBCAUSAL` rule or in a window under the kernel's causal mask, none after its
  own index. Only a mask whose every row keeps a key (`_rows_keep_a_key`) can say so: a row
  with no key would see every key once padded. None for any other mask (every tile counts)."""
  if not isinstance(mask, Structured) or not _rows_keep_a_key(mask):
    return None
  run = tile_map(mask.windows, r0, r1, keys, s, mask.rule in mask_structure.SUBCAUSAL)
  return int(run.sum()), run.size


def _rows_keep_a_key(mask: Structured) -> bool:
  """Whether every row of `mask`, each window under the kernel's causal mask where the window
  says so, sees some key: a rule under which every row sees its own (`SEES_SELF`; for two
  streams, each stream's), or a window under the causal mask (`Structured.subcausal`: no row
  is left without a key)."""
  if not isinstance(mask.rule, mask_structure.Streams):
    return mask.rule in mask_structure.SEES_SELF
  rules = (mask.rule.first, mask.rule.second)
  return all(rule in mask_structure.SEES_SELF or causal
             for rule, (*_, causal) in zip(rules, mask.windows, strict=True))


def splash_keys(s: int) -> int:
  """The key block of splash's backward over `s` keys (a multiple of `KERNEL_BLOCK`) under a
  static mask: the longest multiple of `KERNEL_BLOCK` up to `SPLASH_BWD_KEYS` dividing `s`."""
  return max(b for b in range(KERNEL_BLOCK, SPLASH_BWD_KEYS + 1, KERNEL_BLOCK) if s % b == 0)


def _splash(s: int):
  """tokamax's splash attention op over `s` keys, its backward over key blocks of
  `splash_keys(s)` (tokamax exports no name for its backward's config)."""
  from tokamax._src.ops.attention import pallas_mosaic_tpu, pallas_mosaic_tpu_vjp  # noqa: PLC0415
  config = pallas_mosaic_tpu_vjp.Config(block_q_dkv=KERNEL_BLOCK, block_kv_dkv=splash_keys(s),
                                        block_kv_dkv_compute=KERNEL_BLOCK)
  return pallas_mosaic_tpu.PallasMosaicTpuFlashAttention(
      vjp=pallas_mosaic_tpu_vjp.PallasMosaicTpuFlashAttentionVjp(config=config))


@functools.lru_cache(maxsize=32)
def tile_map(windows: tuple, r0: int, r1: int, keys: tuple | None, s: int,
             subcausal: bool) -> np.ndarray:
  """`splash_tiles`' tiles `[query tiles, key tiles]`: True where a pair may be."""
  orig = np.arange(s) if keys is None else np.concatenate([np.arange(a, b) for a, b in keys])
  tp, sp = (-(-n // KERNEL_BLOCK) * KERNEL_BLOCK for n in (r1 - r0, len(orig)))
  sees = np.zeros((tp, sp), bool)
  sees[:, :len(orig)] = True  # rows no window covers, and padding rows: every real key
  inside = lambda idx, segments: (np.ones(idx.shape, bool) if segments is None else
                                  np.any([(a <= idx) & (idx < b) for a, b in segments], 0))
  for w0, w1, segments, causal in windows or ((r0, r1, None, False),):
    a, b = max(w0, r0), min(w1, r1)
    if a >= b:
      continue
    rows = np.arange(a, b)[:, None]
    window = inside(orig, segments)[None] & (orig[None] <= rows if subcausal else True)
    if causal:  # the kernel's causal mask over every key, from the window's first row
      window = window & (orig[None] <= rows - w0)
    window = window | ~inside(rows, segments)  # its own key not in the call: sees them all
    sees[a - r0:b - r0, :len(orig)] = window
  blocks = sees.reshape(tp // KERNEL_BLOCK, KERNEL_BLOCK, sp // KERNEL_BLOCK, KERNEL_BLOCK)
  return blocks.any((1, 3))


def _causal_windows(mask: Structured, r0: int, r1: int) -> jax.Array:
  """Rows `r0:r1` of `mask` dense over every key, each window the mask flags causal under the
  kernel's causal mask, as its own call would have it (a two-stream call's query rows: only
  rows nothing reads lose keys, `Structured.subcausal`)."""
  dense = mask.window(r0, r1, None).dense()
  for w0, w1, segments, causal in mask.windows:
    a, b = max(w0, r0), min(w1, r1)
    if causal and a < b:
      if segments is not None:
        raise ValueError("a window under the causal mask takes every key in one splash call")
      sees = jnp.arange(dense.shape[2])[None] <= jnp.arange(a - w0, b - w0)[:, None]
      dense = dense.at[:, a - r0:b - r0].set(dense[:, a - r0:b - r0] & sees)
  return dense


def kernel_calls(mask, t: int, lengths: bool = True, windows: bool = True) -> list[tuple]:
  """The kernel calls that attend `t` query rows under `mask`, each (first row, end row, keys
  (None: all; else the key segments ((k0, k1), ...) it attends, `keys_of`), is_causal, the
  mask's arrays). A `Structured` mask whose first `causal_rows` queries see exactly the keys
  up to their own index (TiDAR's clean half) takes a call for those rows over their own keys
  with the kernel's causal mask, which skips the tiles above the diagonal, then the other rows
  with the rest of the mask dense: in one call, or one per window over the window's keys
  (`Structured.windows`: TiDAR's mask half; a two-stream call's streams,
  `mask_structure.two_stream`, the query rows' under the causal mask where `subcausal`),
  unless `windows` is False: a kernel that skips a dense mask's empty tiles itself (splash
  attention) gains nothing from them, and each call of it derives its own tile layout; it
  takes those rows in one call over every key (no copy of a subset; `splash_tiles` counts the
  tiles it runs), a window flagged causal under the causal mask there too
  (`_causal_windows`). Any other mask takes one (`kernel_mask`)."""
  r = getattr(mask, "causal_rows", 0)
  split = getattr(mask, "windows", ())
  if not (0 < r < t or split):
    return [(0, t, None, *kernel_mask(mask, lengths))]
  if split and (split[0][0] != r or split[-1][1] != t or any(
      a[1] != b[0] for a, b in zip(split, split[1:]))):
    raise ValueError(f"windows {[w[:2] for w in split]} do not tile rows {r}..{t}")
  head = [(0, r, ((0, r),), True, {})] if r else []
  if not windows:  # the rest in one call over every key
    return head + [(r, t, None, False, {"mask": _causal_windows(mask, r, t)})]
  return head + [(r0, r1, keys, causal, {"mask": mask.window(r0, r1, keys).dense()})
                 for r0, r1, keys, causal in split or ((r, t, None, False),)]


def keys_of(kv_BxSxKxD, segments: tuple | None):
  """The keys (or values) of a call's key `segments` ((k0, k1), ...), in order; all: None."""
  if segments is None:
    return kv_BxSxKxD
  parts = [kv_BxSxKxD[:, k0:k1] for k0, k1 in segments]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, 1)


def kernel_mask(mask, lengths: bool = True) -> tuple[bool, dict]:
  """(is_causal, the mask's arrays) as a kernel takes them: a causal `Structured` as its
  causal mask (with `key_value_seq_lengths` for rows with padding, where the kernel takes
  `lengths`), a `SUBCAUSAL` one (Jacobi Forcing's streams) dense under the causal mask (the
  kernel skips the tiles above the diagonal), anything else as the dense `mask`.

  Without `lengths` (splash attention) a causal mask with padding is the kernel's causal mask
  alone. Its rows are right-padded (`causal`: a row's real tokens come first), so a real
  query's keys are all real and its output is exact; a padding query also sees the padding
  keys before it, and no real row reads a padding row (its keys come after every real query),
  so only padding rows' outputs, which nothing reads (masked losses, cache slots past a
  row's length), differ from the dense mask's. A dense mask there would make splash
  attention derive its block layout from the array in every call (on TPU v5e at batch 8 that
  derivation fails to compile: XLA:TPU "Reshape should have supported layout")."""
  if isinstance(mask, Structured) and mask.rule is mask_structure.full_causal_rule:
    return True, {}
  if isinstance(mask, Structured) and mask.rule is mask_structure.causal_rule:
    if not lengths:
      return True, {}
    return True, {"key_value_seq_lengths": mask.keys["valid"].sum(1, dtype=jnp.int32)}
  subcausal = isinstance(mask, Structured) and (mask.subcausal
                                                or mask.rule in mask_structure.SUBCAUSAL)
  return subcausal and mask.shape[1] == mask.shape[2], {"mask": dense_mask(mask)}


def dense_mask(mask):
  """A mask as the dense bool array `[B, T, K]` (a `Structured` one expanded)."""
  return mask.dense() if isinstance(mask, Structured) else mask


def _padded(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal: bool, arrays: dict, block: int):
  """q, k, v and the mask's arrays with T and S padded to multiples of `block`: padding
  keys are seen by no real query (masked out, or after every real query's keys when causal
  over T = S keys). A row with no key (padding queries, whose outputs are dropped, and fully
  masked rows) becomes a zero query over every real key: uniform weights, as on the dense
  path."""
  t, s = q_BxTxHxD.shape[1], k_BxSxKxD.shape[1]
  tp, sp = -(-t // block) * block, -(-s // block) * block
  if (tp, sp) == (t, s):
    return q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, arrays
  if causal and not arrays and t != s:
    raise ValueError(f"a causal mask over {s} keys for {t} queries cannot be padded")
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  q = pad(q_BxTxHxD, tp)
  if "mask" in arrays:  # a row with no key (padding queries too): a zero query on every real key
    mask = jnp.pad(arrays["mask"], [(0, 0), (0, tp - t), (0, sp - s)])
    empty = ~mask.any(-1)  # [B, T]
    q = jnp.where(empty[:, :, None, None], 0, q)
    arrays = {**arrays, "mask": mask | (empty[:, :, None] & (jnp.arange(sp) < s))}
  return q, pad(k_BxSxKxD, sp), pad(v_BxSxKxD, sp), arrays


def _shard_mapped(call, mesh, k_shape, arrays: dict):
  """`call(q, k, v, arrays)` in a `jax.shard_map` over `mesh`: each device runs the kernel on
  its rows (batch over the batch axes; the mask's `arrays` lead with the batch) and heads
  ("tensor" when it divides the kv heads; the q heads then split alike, so q head h stays
  with kv head h // G), the rest replicated."""
  batch, _, heads, _ = sharding.logical_spec(("batch", None, "kv_heads", None), k_shape, mesh)
  qkv = P(batch, None, heads, None)
  specs = {n: P(batch) for n in arrays}
  return jax.shard_map(call, mesh=mesh, in_specs=(qkv, qkv, qkv, specs), out_specs=qkv,
                       check_vma=False)


def tokamax_module():
  """tokamax, imported on first use. Its options are absl flags that it parses from sys.argv
  on first read, which fails on any other program's arguments (pytest's, paraflax's own):
  unless the program parsed its absl flags already, take their defaults."""
  import tokamax  # noqa: PLC0415 (a heavy import, needed only off the dense path)
  from absl import flags  # noqa: PLC0415
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def _dense(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxS, cache_kv):
  """The reference: float32 scores over [cache | chunk], the cache read in place. The two
  parts share one softmax (a common max and sum) and are never concatenated: a concatenation
  per layer would copy the cache-long scores once more every step."""
  b, t, h, dh = q_BxTxHxD.shape
  hkv, dt = k_BxTxKxD.shape[2], q_BxTxHxD.dtype
  s = 0 if cache_kv is None else cache_kv[0].shape[1]
  q = q_BxTxHxD.reshape(b, t, hkv, h // hkv, dh)

  def scores(keys_BxSxKxD, see_BxTxS):
    x = jnp.einsum("btkgd,bskd->bkgts", q, keys_BxSxKxD.astype(dt),
                   preferred_element_type=jnp.float32)
    return jnp.where(see_BxTxS[:, None, None], x * dh ** -0.5, _NEG)

  parts = [(scores(k_BxTxKxD, mask_BxTxS[..., s:]), v_BxTxKxD)]  # (scores, values)
  if cache_kv is not None:
    parts.insert(0, (scores(cache_kv[0], mask_BxTxS[..., :s]), cache_kv[1]))
  top = jax.lax.stop_gradient(
      functools.reduce(jnp.maximum, [x.max(-1, keepdims=True) for x, _ in parts]))
  exps = [jnp.exp(x - top) for x, _ in parts]
  total = sum(e.sum(-1, keepdims=True) for e in exps)
  out = sum(jnp.einsum("bkgts,bskd->btkgd", (e / total).astype(dt), values.astype(dt))
            for e, (_, values) in zip(exps, parts))
  return out.reshape(b, t, h, dh)
