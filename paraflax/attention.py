"""Masked attention: one function with pluggable implementations behind the explicit mask.

`attend(q, k, v, mask, implementation=..., cache_kv=...)`: queries `[B, T, H, D]` attend the
keys [cache slots S | chunk tokens] under the bool mask `[B, T, S+T]` (query may attend key),
grouped-query: H = G * Hkv, query head h reads kv head h // G. Implementations
(`ModelConfig.attention`):

  xla          dense einsum scores `[B, Hkv, G, T, S+T]` float32; the reference. The cache is
               read in place (no concatenation); memory quadratic in length.
  xla_chunked  tokamax's chunked XLA attention (online softmax over key chunks of 1024 and
               query chunks of 512, each chunk rematerialised): every backend, memory linear.
  mosaic       tokamax Pallas kernels: TPU splash attention / Mosaic GPU (sm90+).
  triton       tokamax Pallas Triton flash attention (GPU).
  cudnn        cuDNN flash attention through `jax.nn.dot_product_attention` (GPU).
  auto         `resolve`: static in (backend, compute dtype, max_seq_len), plus a decode rule.

xla and xla_chunked honour `jax_default_matmul_precision` (float32 exactness); the
accelerator kernels do not promise to, so "auto" never picks them for float32 compute.
A query row whose mask is all False (padding; its output is ignored) gets the mean of all
values (uniform weights) on xla and xla_chunked alike: finite, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paraflax.config import ATTENTION as IMPLEMENTATIONS

ACCELERATED = ("mosaic", "triton", "cudnn")  # kernels that do not run on CPU
# "auto" thresholds, from CPU measurements (scripts/attention_bench.py):
DECODE_ROWS = 64  # a call over a cache with at most this many query rows runs dense xla
DENSE_MAX_LEN = 1024  # models with max_seq_len up to this run dense xla (small, faster)

_NEG = jnp.finfo(jnp.float32).min  # masked score: a fully masked row stays finite (uniform)


def check(name: str) -> None:
  """Raise ValueError unless `name` is an attention implementation."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}; got {name!r}")


def triton_ok(jax_version: str, tokamax_version: str | None) -> bool:
  """Whether tokamax's Triton kernel runs with these versions: tokamax <= 0.0.12 calls
  `pl.dot`, which JAX 0.11 removed (an AttributeError at trace time, seen on an H100)."""
  num = lambda v: tuple(int(x) for x in v.split(".")[:3] if x.isdigit())
  return tokamax_version is None or num(jax_version) < (0, 11) or num(tokamax_version) > (0, 0, 12)


def _tokamax_version() -> str | None:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("tokamax")
  except PackageNotFoundError:
    return None


def resolve(name: str, backend: str, dtype, *, max_len: int | None = None, rows: int = 0,
            cached: bool = False) -> str | tuple[str, ...]:
  """The implementation that setting `name` stands for: static (backend, dtype, the model's
  `max_len`; query `rows` and whether there is a cache only for the decode rule).

  "auto", in order: (1) decode rule: a call over a cache with <= `DECODE_ROWS` query rows
  runs "xla" (fastest there, reads the cache in place, memory linear in S for few rows);
  (2) a model with max_seq_len <= `DENSE_MAX_LEN` runs "xla"; (3) on CPU or with float32
  compute "xla_chunked" (float32 exactness, DESIGN invariant 1, needs a path that honours
  the matmul precision); (4) on GPU / TPU with 16-bit compute the backend's kernel
  ("triton" / "mosaic"), falling back to "xla_chunked" for a shape the kernel declines;
  "xla_chunked" on GPU where the installed tokamax's Triton kernel cannot run (`triton_ok`).
  So one `generate` call runs one implementation for its prefill and every step wider than
  `DECODE_ROWS`, and dense xla for steps up to that width.
  """
  check(name)
  if name != "auto":
    if name in ACCELERATED and backend == "cpu":
      raise ValueError(f"attention={name!r} needs a GPU or TPU; this backend is cpu "
                       "(use 'auto', 'xla' or 'xla_chunked')")
    return name
  if (cached and rows <= DECODE_ROWS) or (max_len is not None and max_len <= DENSE_MAX_LEN):
    return "xla"
  if backend == "cpu" or jnp.dtype(dtype) == jnp.float32:
    return "xla_chunked"
  if backend == "tpu":
    return ("mosaic", "xla_chunked")
  return ("triton", "xla_chunked") if triton_ok(jax.__version__, _tokamax_version()) \
      else "xla_chunked"


def attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxS, *, implementation: str = "xla",
           cache_kv=None, max_len: int | None = None):
  """Masked attention `[B, T, H, D]` over keys [cache slots | chunk]: k, v `[B, T', Hkv, D]`
  (T' = T, or fewer for two-stream calls), `cache_kv` None or (k, v) `[B, S, Hkv, D]` (cast
  to q's dtype), mask `[B, T, S+T']`. `implementation` and `max_len`: see `resolve`."""
  q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = map(jnp.asarray, (q_BxTxHxD, k_BxTxKxD, v_BxTxKxD))
  s = 0 if cache_kv is None else cache_kv[0].shape[1]
  t, dt = q_BxTxHxD.shape[1], q_BxTxHxD.dtype
  impl = resolve(implementation, jax.default_backend(), dt, max_len=max_len, rows=t,
                 cached=cache_kv is not None)
  if impl == "xla":
    return _dense(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxS, cache_kv)
  k, v = k_BxTxKxD, v_BxTxKxD
  if s:  # the kernels take one key array: copy the cache in front of the chunk
    k = jnp.concatenate([cache_kv[0].astype(dt), k], axis=1)
    v = jnp.concatenate([cache_kv[1].astype(dt), v], axis=1)
  return _tokamax().dot_product_attention(q_BxTxHxD, k, v, mask=mask_BxTxS[:, None],
                                       implementation=impl)


def _tokamax():
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
