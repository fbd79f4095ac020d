"""Masked attention: one function with pluggable implementations behind the explicit mask.

`attend(q, k, v, mask, attention=..., cache_kv=...)`: queries `[B, T, H, D]` attend the
keys [cache slots S | chunk tokens] under the bool mask `[B, T, S+T]` (query may attend key),
grouped-query: H = G * Hkv, query head h reads kv head h // G. The `attention` setting
(`RunControl.attention`, checked there) names an implementation:

  xla          dense einsum scores `[B, Hkv, G, T, S+T]` float32; the reference. The cache is
               read in place (no concatenation); memory quadratic in length.
  xla_chunked  tokamax's chunked XLA attention (online softmax over key chunks of 1024 and
               query chunks of 512, each chunk rematerialised): every backend, memory linear.
  mosaic       tokamax Pallas kernels: TPU splash attention / Mosaic GPU (sm90+). Splash
               attention tiles queries and keys in blocks of `KERNEL_BLOCK` (128) and refuses
               other lengths (a ValueError), so "auto" picks it only for lengths it divides.
  triton       tokamax Pallas Triton flash attention (GPU).
  cudnn        cuDNN flash attention through `jax.nn.dot_product_attention` (GPU).
  auto         `resolve`: static in (backend, compute dtype, max_seq_len), plus decode and
               block rules; what it picks per backend, and where that was verified:
               docs/kernels.md.

Under a mesh (`sharding.use_mesh` / `traced_on`, more than one device) the kernels run in a
`jax.shard_map` (XLA cannot partition a custom kernel call): rows split over the batch axes,
heads over "tensor" when it divides the kv heads (a query head stays with its kv head), the
rest replicated; xla and xla_chunked are partitioned by XLA itself.

xla and xla_chunked honour `jax_default_matmul_precision` (float32 exactness); the
accelerator kernels do not promise to, so "auto" never picks them for float32 compute.
A query row whose mask is all False (padding; its output is ignored) gets the mean of all
values (uniform weights) on xla and xla_chunked alike: finite, never NaN.

A mask in structured form (`mask_structure.Structured`) runs `blockwise`, whatever the
setting: tiles of `BLOCK` queries x `BLOCK` keys with an online softmax, the mask of each tile
evaluated from the tokens' fields (never `[T, K]`), and the tiles its layout marks empty
skipped, forward and backward. It is the plain-JAX reference of what a fused kernel given the
structure skips; an all-False row gives zeros there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from paraflax.model.mask_structure import EMPTY, Structured
from paraflax.parallel import sharding

IMPLEMENTATIONS = ("auto", "xla", "xla_chunked", "mosaic", "triton", "cudnn")
ACCELERATED = ("mosaic", "triton", "cudnn")  # kernels that do not run on CPU
# "auto" thresholds, from CPU measurements (docs/scaling.md, Attention; at model level
# `paraflax perf slots` / `perf train --attention xla|xla_chunked` measure the same choice):
DECODE_ROWS = 64  # a call over a cache with at most this many query rows runs dense xla
DENSE_MAX_LEN = 1024  # models with max_seq_len up to this run dense xla (small, faster)
BLOCK = 128  # queries and keys per tile of `blockwise`
KERNEL_BLOCK = 128  # TPU splash attention's query and key block (tokamax's default config)

_NEG = jnp.finfo(jnp.float32).min  # masked score: a fully masked row stays finite (uniform)


def resolve(attention: str, backend: str, dtype, *, max_len: int | None = None,
            rows: int = 0, cached: bool = False, keys: int | None = None
            ) -> str | tuple[str, ...]:
  """The implementation the `attention` setting stands for: static (backend, dtype, the
  model's `max_len`; query `rows`, whether there is a cache and the key length `keys`, cache
  slots + rows (None: `rows`, a cache-free call), for the decode and block rules).

  "auto", in order: (1) decode rule: a call over a cache with <= `DECODE_ROWS` query rows
  runs "xla" (fastest there, reads the cache in place, memory linear in S for few rows);
  (2) a model with max_seq_len <= `DENSE_MAX_LEN` runs "xla"; (3) on CPU or with float32
  compute "xla_chunked" (float32 exactness, DESIGN invariant 1, needs a path that honours
  the matmul precision); (4) with 16-bit compute, on TPU "mosaic" when `KERNEL_BLOCK`
  divides both `rows` and `keys` (splash attention's blocks; a prompt padded to 64 tokens
  or a 72-row TiDAR step runs "xla_chunked"), falling back to "xla_chunked" for a shape the
  kernel declines; on GPU "xla_chunked" until a GPU run verifies a tokamax kernel with the
  supported versions (docs/kernels.md).
  So one `generate` call runs one implementation for its prefill and every step wider than
  `DECODE_ROWS`, and dense xla for steps up to that width.
  """
  if attention not in IMPLEMENTATIONS:
    raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}; got {attention!r}")
  if attention != "auto":
    if attention in ACCELERATED and backend == "cpu":
      raise ValueError(f"attention={attention!r} needs a GPU or TPU; this backend is cpu "
                       "(use 'auto', 'xla' or 'xla_chunked')")
    return attention
  if (cached and rows <= DECODE_ROWS) or (max_len is not None and max_len <= DENSE_MAX_LEN):
    return "xla"
  if backend != "tpu" or jnp.dtype(dtype) == jnp.float32:
    return "xla_chunked"
  blocks = rows % KERNEL_BLOCK == 0 and (rows if keys is None else keys) % KERNEL_BLOCK == 0
  return ("mosaic", "xla_chunked") if blocks else "xla_chunked"


def attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxS, *, attention: str = "xla",
           cache_kv=None, max_len: int | None = None, backend: str | None = None):
  """Masked attention `[B, T, H, D]` over keys [cache slots | chunk]: k, v `[B, T', Hkv, D]`
  (T' = T, or fewer for two-stream calls), `cache_kv` None or (k, v) `[B, S, Hkv, D]` (cast
  to q's dtype), mask `[B, T, S+T']`. `attention`, `max_len` and `backend` (the platform to
  resolve for; None: the default backend): see `resolve`. A kernel under a mesh runs in a
  shard_map (`_shard_mapped`)."""
  q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = map(jnp.asarray, (q_BxTxHxD, k_BxTxKxD, v_BxTxKxD))
  s = 0 if cache_kv is None else cache_kv[0].shape[1]
  t, dt = q_BxTxHxD.shape[1], q_BxTxHxD.dtype
  if isinstance(mask_BxTxS, Structured):
    k, v = k_BxTxKxD, v_BxTxKxD
    if s:
      k = jnp.concatenate([cache_kv[0].astype(dt), k], axis=1)
      v = jnp.concatenate([cache_kv[1].astype(dt), v], axis=1)
    return blockwise(q_BxTxHxD, k, v, mask_BxTxS)
  impl = resolve(attention, backend or jax.default_backend(), dt, max_len=max_len, rows=t,
                 cached=cache_kv is not None, keys=s + k_BxTxKxD.shape[1])
  if impl == "xla":
    return _dense(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxS, cache_kv)
  k, v = k_BxTxKxD, v_BxTxKxD
  if s:  # the kernels take one key array: copy the cache in front of the chunk
    k = jnp.concatenate([cache_kv[0].astype(dt), k], axis=1)
    v = jnp.concatenate([cache_kv[1].astype(dt), v], axis=1)

  def call(q, k, v, mask):
    return tokamax_module().dot_product_attention(q, k, v, mask=mask[:, None], implementation=impl)

  kernel = set((impl,) if isinstance(impl, str) else impl) & set(ACCELERATED)
  mesh = sharding.context_mesh() if kernel else None
  if mesh is not None and mesh.size > 1:  # XLA cannot partition a kernel's custom call
    call = _shard_mapped(call, mesh, k.shape)
    mask_BxTxS = jnp.broadcast_to(mask_BxTxS, (*q_BxTxHxD.shape[:2], k.shape[1]))
  return call(q_BxTxHxD, k, v, mask_BxTxS)


def _shard_mapped(call, mesh, k_shape):
  """`call(q, k, v, mask)` in a `jax.shard_map` over `mesh`: each device runs the kernel on
  its rows (batch over the batch axes) and heads ("tensor" when it divides the kv heads; the
  q heads then split alike, so q head h stays with kv head h // G), the rest replicated."""
  batch, _, heads, _ = sharding.logical_spec(("batch", None, "kv_heads", None), k_shape, mesh)
  qkv = P(batch, None, heads, None)
  return jax.shard_map(call, mesh=mesh, in_specs=(qkv, qkv, qkv, P(batch)), out_specs=qkv,
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


def blockwise(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask: Structured, block_q: int = BLOCK,
              block_k: int = BLOCK):
  """Attention `[B, T, H, D]` under a structured mask `[B, T, S]`, tile by tile: each row of
  the batch and block of queries runs an online softmax over its key blocks, skipping the
  tiles `mask.layout` marks EMPTY (a `lax.cond`: skipped in the backward pass too); each
  block of queries is rematerialised in the backward pass (memory linear in T)."""
  b, t, h, dh = q_BxTxHxD.shape
  s, hkv, dt = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2], q_BxTxHxD.dtype
  bq, bk = min(block_q, t), min(block_k, s)
  nq, nk = -(-t // bq), -(-s // bk)
  layout = mask.layout(bq, bk)  # [B, nq, nk]

  def blocks(x, n, size):  # [B, N, ...] -> [B, n, size, ...], zero or edge padded
    mode = "edge" if x.ndim == 2 else "constant"
    x = jnp.pad(x, [(0, 0), (0, n * size - x.shape[1])] + [(0, 0)] * (x.ndim - 2), mode=mode)
    return x.reshape(b, n, size, *x.shape[2:])

  q = blocks(q_BxTxHxD.reshape(b, t, hkv, h // hkv, dh), nq, bq)
  k, v = blocks(k_BxSxKxD, nk, bk), blocks(v_BxSxKxD, nk, bk)
  fq = {n: blocks(a, nq, bq) for n, a in mask.queries.items()}
  fk = {n: blocks(a, nk, bk) for n, a in mask.keys.items()}
  key_real = (jnp.arange(nk * bk) < s).reshape(nk, bk)

  def q_block(k_r, v_r, fk_r, x):  # one row's keys, one block of its queries
    q_i, fq_i, layout_i = x  # [bq, Hkv, G, D], fields [bq], [nk]

    def tile(carry, y):
      k_j, v_j, fk_j, real_j, layout_ij = y

      def compute(carry):
        m, total, acc = carry  # [Hkv, G, bq] max, [Hkv, G, bq] sum, [Hkv, G, bq, D]: float32
        allowed = mask.rule({n: a[None, :, None] for n, a in fq_i.items()},
                            {n: a[None, None, :] for n, a in fk_j.items()})[0] & real_j
        scores = jnp.einsum("qkgd,skd->kgqs", q_i, k_j,
                            preferred_element_type=jnp.float32) * dh ** -0.5
        top = jnp.max(jnp.where(allowed, scores, -jnp.inf), -1)
        m_new = jax.lax.stop_gradient(jnp.maximum(m, top))  # the shift: no effect on values
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(allowed, jnp.exp(scores - shift[..., None]), 0.0)
        scale = jnp.exp(m - shift)
        acc = acc * scale[..., None] + jnp.einsum("kgqs,skd->kgqd", p.astype(dt), v_j,
                                                  preferred_element_type=jnp.float32)
        return m_new, total * scale + p.sum(-1), acc

      return jax.lax.cond(layout_ij == EMPTY, lambda c: c, compute, carry), None

    g = h // hkv
    init = (jnp.full((hkv, g, bq), -jnp.inf), jnp.zeros((hkv, g, bq)),
            jnp.zeros((hkv, g, bq, dh)))
    (_, total, acc), _ = jax.lax.scan(tile, init, (k_r, v_r, fk_r, key_real, layout_i))
    out = acc / jnp.where(total == 0, 1.0, total)[..., None]  # a row with no key: zeros
    return jnp.moveaxis(out, 2, 0).astype(dt)  # [bq, Hkv, G, D]

  def row(x):
    q_r, k_r, v_r, fq_r, fk_r, layout_r = x
    body = jax.checkpoint(lambda y: q_block(k_r, v_r, fk_r, y))
    return jax.lax.map(body, (q_r, fq_r, layout_r))

  out = jax.lax.map(row, (q, k, v, fq, fk, layout))  # [B, nq, bq, Hkv, G, D]
  return out.reshape(b, nq * bq, h, dh)[:, :t]
