"""Llama/Qwen-family decoder in Flax NNX with an explicit mask and an external KV cache.

`logits, chunk_kv = model(tokens, positions, mask, cache)`: attention keys are the cache's S
slots followed by the chunk's T tokens, so `mask` is `[B, T, S+T]` (`[B, T, T]` without a
cache). The model never builds a mask and never writes the cache; it returns the chunk's
keys/values (post-RoPE) and the caller commits the rows it keeps (`cache.commit`). A mask in
structured form (`mask_structure.Structured`, same shape) reaches the attention kernel as
it takes it (a causal one as the kernel's own causal mask: `attention.kernel_mask`).

Two-stream models (`two_stream=True`, AS-ARMs for ASSD) also take `queries=Queries(positions,
mask)`: a position-only query stream (XLNet). Every query starts as one learned vector, gets
its target position through RoPE, runs through the same layers and weights as the content
stream, and reads the keys/values of the content stream only (cache slots + chunk tokens, as
`queries.mask [B, Q, S+T]` allows), so a query never sees its own token. The call then returns
the query stream's logits `[B, Q, V]` (the content stream only supplies keys/values).

`model(..., hidden=True)` returns the final-normed hidden states `[B, T, D]` (or the query
stream's `[B, Q, D]`) in the compute dtype instead of the logits, and `model.head(x)` maps them
to the same float32 logits: losses compute the head over chunks of positions
(`training/objectives/head_loss.py`) instead of holding `[B, T, V]` float32.

How the model is computed (attention kernel, remat, scanned layers, loss chunks) is its
`run: RunControl` (`run.py`), given as `Transformer(cfg, rngs=..., run=...)` and static like
the config (part of the graphdef).

Parameters carry logical axis names (`embed`, `heads`, `kv_heads`, `mlp`, `vocab`) as
`out_sharding` metadata, so sharding is a rules table (see `sharding.py`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paraflax.model import decode_layer, greedy_head, tpu_decode_layer, tpu_greedy_head
from paraflax.model.attention import attend, dense_mask
from paraflax.model.cache import CacheLayer, ChunkKV, KVCache
from paraflax.model.config import ModelConfig
from paraflax.model.mask_structure import Structured, two_stream
from paraflax.model.run import REMAT_POLICIES, RunControl
from paraflax.parallel import sharding


class Queries(NamedTuple):
  """The query stream of a two-stream call: one query per target position."""
  positions: jax.Array  # [B, Q] the position each query predicts
  mask: jax.Array  # [B, Q, S+T] the content keys (cache slots, chunk tokens) it may read


def logits(x_BxTxD, w_DxV):
  """float32 logits `[B, T, V]` of hidden states through the output projection `w` (cast to
  x's dtype, accumulated in float32)."""
  return jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV.astype(x_BxTxD.dtype),
                    preferred_element_type=jnp.float32)


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def _lecun(fan_in: int):
  return jax.nn.initializers.normal(fan_in ** -0.5)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype, name: str | None = "embed"):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), dtype), out_sharding=(name,), eager_sharding=False)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies `[Dh/2]` float32 of rotary embeddings (Llama 3 scaling if configured).

  Computed on the host in float32, op for op as transformers does on CPU, so every backend
  compiles the same constant (XLA rewrites `x / c` as `x * (1 / c)` and evaluates `pow` its
  own way, which moves frequencies by an ulp or two).
  """
  f32 = np.float32
  d = cfg.dim_per_head
  inv_freq = f32(1.0) / f32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=f32) / f32(d))
  s = cfg.rope_scaling
  if s is None:
    return inv_freq
  # transformers' `_compute_llama3_parameters`; torch evaluates `scalar / tensor` as
  # `reciprocal(tensor) * scalar`, copied here for bit-equal frequencies
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = (f32(1.0) / inv_freq) * f32(2 * math.pi)
  scaled = np.where(wavelen > low_wavelen, inv_freq / f32(s.factor), inv_freq)
  smooth = (((f32(1.0) / wavelen) * f32(s.original_max_position_embeddings)
             - f32(s.low_freq_factor)) / f32(s.high_freq_factor - s.low_freq_factor))
  smoothed = (f32(1.0) - smooth) * scaled / f32(s.factor) + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(f32)


def apply_rope(x_BxTxHxD, positions_BxT, inv_freq):
  """Rotate-half RoPE (the Llama/Qwen convention) at explicit positions."""
  angles = positions_BxT.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x = x_BxTxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxD.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, hkv, dh, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.dim_per_head, cfg.params_dtype
    self.wq = _param(rngs, _lecun(d), (d, h, dh), ("embed", "heads", None), pd)
    self.wk = _param(rngs, _lecun(d), (d, hkv, dh), ("embed", "kv_heads", None), pd)
    self.wv = _param(rngs, _lecun(d), (d, hkv, dh), ("embed", "kv_heads", None), pd)
    self.wo = _param(rngs, _lecun(h * dh), (h, dh, d), ("heads", None, "embed"), pd)
    if cfg.qkv_bias:
      zeros = jax.nn.initializers.zeros
      self.bq = _param(rngs, zeros, (h, dh), ("heads", None), pd)
      self.bk = _param(rngs, zeros, (hkv, dh), ("kv_heads", None), pd)
      self.bv = _param(rngs, zeros, (hkv, dh), ("kv_heads", None), pd)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.rms_eps, pd, name=None)
      self.k_norm = RMSNorm(dh, cfg.rms_eps, pd, name=None)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxK, cache: CacheLayer | None, inv_freq,
               t_kv, attention, backend):
    """Rows `:t_kv` of x are content tokens (they make the keys/values); rows after them are
    query-stream rows (they only query); `attention`, `backend`: `RunControl.attention` and
    the platform it resolves for (`RunControl.backend()`)."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    content = x_BxTxD[:, :t_kv]
    q = jnp.einsum("btd,dhk->bthk", x_BxTxD, self.wq[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", content, self.wk[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", content, self.wv[...].astype(dt))
    if cfg.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT[:, :t_kv], inv_freq)

    out = attend(q, k, v, mask_BxTxK, attention=attention, cache_kv=cache,
                 max_len=cfg.max_seq_len, backend=backend)
    return jnp.einsum("bthk,hkd->btd", out, self.wo[...].astype(dt)), (k, v)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.d_ff, cfg.params_dtype
    self.w_gate = _param(rngs, _lecun(d), (d, f), ("embed", "mlp"), pd)
    self.w_up = _param(rngs, _lecun(d), (d, f), ("embed", "mlp"), pd)
    self.w_down = _param(rngs, _lecun(f), (f, d), ("mlp", "embed"), pd)

  def __call__(self, x_BxTxD):
    dt = x_BxTxD.dtype
    x = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])  # 2-D matmuls: ~2x faster backward on CPU
    gate = jax.nn.silu(x @ self.w_gate[...].astype(dt))
    out = (gate * (x @ self.w_up[...].astype(dt))) @ self.w_down[...].astype(dt)
    return out.reshape(x_BxTxD.shape)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.params_dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.params_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask, cache, inv_freq, t_kv, attention, backend):
    if decode_layer.runs(self.attn.cfg, x.shape, cache is not None, t_kv, attention, backend):
      return decode_layer.block(self, x, positions, dense_mask(mask), cache, inv_freq,
                                interpret=backend == "cpu")
    a, kv = self.attn(self.attn_norm(x), positions, mask, cache, inv_freq, t_kv, attention,
                      backend)
    x = x + a
    return x + self.mlp(self.mlp_norm(x)), kv


def _layer_call(remat: str, attention: str, backend: str, inv_freq: np.ndarray, t_kv: int):
  """`run(layer, x, positions, mask, cache) -> (x, (k, v))` (`cache`: a `CacheLayer` or None),
  rematerialised as `remat` (resolved) says. The host constants (RoPE frequencies, content
  rows, the attention setting) are closed over, so they stay static under `jax.checkpoint`; a
  missing cache (None) is an empty pytree. The layer goes through `jax.checkpoint` as a
  (graphdef, state) split, not `nnx.remat`: a layer never mutates itself, and a model merged
  inside a decode loop's body has Variables that nnx's graph updates refuse to touch from the
  checkpoint's trace."""
  def run(layer, x, positions, mask, cache):
    x = sharding.constrain_batch(x)  # rows stay split over the batch axes (FSDP)
    return layer(x, positions, mask, cache, inv_freq, t_kv, attention, backend)
  if REMAT_POLICIES[remat] is None:
    return run

  def run_remat(layer, *args):
    graphdef, state = nnx.split(layer)
    remat_run = jax.checkpoint(lambda st, *a: run(nnx.merge(graphdef, st), *a),
                               policy=REMAT_POLICIES[remat])
    return remat_run(state, *args)
  return run_remat


def _scan_layers(layers, run, x, positions, mask, cache: KVCache | None):
  """The layer loop as one `lax.scan` over the layers' states stacked at call time (the
  parameter tree keeps one entry per layer; the cache is already `[layers, ...]`).
  Returns (x, (k, v) `[layers, B, T, Hkv, Dh]`).

  The stack is a copy of the layer weights (and their gradient a stacked one), made in the
  compute dtype: every layer casts its weights to it anyway, so the result is the same."""
  graphdef = nnx.graphdef(layers[0])

  def stack(*a):
    return jnp.stack([w.astype(x.dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w
                      for w in a])
  stacked = jax.tree.map(stack, *(nnx.state(layer) for layer in layers))

  def body(x, xs):
    state, cache_k, cache_v = xs
    layer = None if cache_k is None else CacheLayer(cache_k[None], cache_v[None], 0)
    return run(nnx.merge(graphdef, state), x, positions, mask, layer)
  cache_kv = (None, None) if cache is None else (cache.k, cache.v)
  return jax.lax.scan(body, x, (stacked, *cache_kv))


class Transformer(nnx.Module):
  """Decoder-only transformer; see the module docstring for the calling convention."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, run: RunControl = RunControl()):
    self.cfg = cfg
    self.run = run
    v, d, pd = cfg.vocab_size, cfg.d_model, cfg.params_dtype
    embed_std = d ** -0.5 if cfg.tie_embeddings else 1.0
    self.embed = _param(rngs, jax.nn.initializers.normal(embed_std), (v, d), ("vocab", "embed"), pd)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(d, cfg.rms_eps, pd)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, _lecun(d), (d, v), ("embed", "vocab"), pd)
    if cfg.two_stream:  # the query stream's input at every position (XLNet's w)
      self.query_embed = _param(rngs, jax.nn.initializers.normal(embed_std), (d,), ("embed",), pd)

  def __call__(self, tokens_BxT, positions_BxT, mask, cache: KVCache | None = None,
               queries: Queries | None = None, hidden: bool = False):
    """Returns (logits float32, ChunkKV with k, v `[layers, B, T, Hkv, Dh]`): the content
    stream's logits `[B, T, V]`, or with `queries` the query stream's `[B, Q, V]`. With
    `hidden=True` the final-normed hidden states `[B, T or Q, D]` (compute dtype) instead."""
    cfg = self.cfg
    b, t = tokens_BxT.shape
    s = 0 if cache is None else cache.k.shape[2]
    if positions_BxT.shape != (b, t):
      raise ValueError(f"positions must have shape {(b, t)} like tokens, got {positions_BxT.shape}")
    if mask.shape != (b, t, s + t):
      raise ValueError(f"mask must have shape [B, T, S+T] = {(b, t, s + t)} "
                       f"({s} cache slots + {t} chunk tokens), got {tuple(mask.shape)}")
    if cache is not None and cache.k.shape[1] != b:
      raise ValueError(f"cache batch {cache.k.shape[1]} != tokens batch {b}")
    dt = cfg.compute_dtype
    inv_freq = rope_frequencies(cfg)
    # rows gathered, then cast: the gradient is a scatter-add in the parameter dtype. Cast
    # first, it is a 16-bit scatter-add, which a GPU does by compare-and-swap loops that
    # serialise on repeated ids (TiDAR's L mask tokens: 34% of its H200 step)
    x = self.embed[...][tokens_BxT].astype(dt)
    if queries is not None:
      x, positions_BxT, mask = self._with_queries(x, positions_BxT, mask, queries, s)
    remats = [self.run.layer_remat(cfg, i) for i in range(cfg.n_layers)]
    backend = self.run.backend()
    calls = {remat: _layer_call(remat, self.run.attention, backend, inv_freq, t)
             for remat in set(remats)}
    if self.run.scans(cfg, cached=cache is not None):
      if len(calls) > 1:
        raise ValueError(f"run.scan_layers=True scans one layer program; run.remat_layers="
                         f"{self.run.remat_layers} of {cfg.n_layers} layers needs them unscanned")
      (call,) = calls.values()
      x, (ks, vs) = _scan_layers(self.layers, call, x, positions_BxT, mask, cache)
    elif tpu_decode_layer.runs(cfg, x.shape, cache is not None, t, self.run.attention, backend):
      x, (ks, vs) = tpu_decode_layer.layers(self.layers, x, positions_BxT, dense_mask(mask),
                                            cache, inv_freq, interpret=backend == "cpu")
    else:
      ks, vs = [], []
      for i, layer in enumerate(self.layers):
        # the whole stack and the layer's index: a kernel reads the layer in place
        layer_cache = None if cache is None else CacheLayer(cache.k, cache.v, i)
        x, (k, v) = calls[remats[i]](layer, x, positions_BxT, mask, layer_cache)
        ks.append(k)
        vs.append(v)
      ks, vs = jnp.stack(ks), jnp.stack(vs)
    x = self.final_norm(x if queries is None else x[:, t:])
    return x if hidden else self.head(x), ChunkKV(k=ks, v=vs)

  def unembedding(self):
    """The output projection `[D, V]` in the parameter dtype (tied: the embedding's transpose)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def head(self, x_BxTxD):
    """float32 logits `[B, T, V]` of final-normed hidden states (`hidden=True` outputs)."""
    return logits(x_BxTxD, self.unembedding())

  def argmax(self, x_BxTxD, mix=None):
    """int32 `[B, T]`: `argmax(head(x))`, in one kernel that writes no logits where
    `greedy_head.runs` or `tpu_greedy_head.runs` (a GPU's or a TPU's decode step). `mix`
    (other `[B, T]` int32, a `[B, T]`): row t's logits are `a * logits[t] + (1 - a) *
    logits[other]` (TiDAR's target mixes its AR and diffusion rows; a = 1 with other = t
    leaves a row as it is)."""
    b, t, d = x_BxTxD.shape
    backend = self.run.backend()
    tied = self.cfg.tie_embeddings
    w = self.embed[...] if tied else self.lm_head[...]
    kernel = next((k for k in (greedy_head, tpu_greedy_head)
                   if k.runs(self.cfg, b * t, self.run.attention, backend)), None)
    if kernel is None and backend == "tpu" and b * t >= greedy_head.TPU_ROWS:
      return greedy_head.argmax_in_chunks(x_BxTxD, w, tied=tied, mix=mix)
    if kernel is None:
      return jnp.argmax(greedy_head.mixed(self.head(x_BxTxD), mix), -1).astype(jnp.int32)
    flat = lambda z: z.reshape(b * t, *z.shape[2:])
    mixed = None if mix is None else (
        flat(jnp.take_along_axis(x_BxTxD, mix[0][..., None], 1)), flat(mix[1]))
    return kernel.argmax(flat(x_BxTxD), w, tied=tied, mix=mixed,
                         interpret=backend == "cpu").reshape(b, t)

  def _with_queries(self, x_BxTxD, positions_BxT, mask, queries: Queries, s: int):
    """Append the query stream's rows to the content rows (inputs, positions, mask)."""
    if not self.cfg.two_stream:
      raise ValueError("queries= needs a two-stream model (ModelConfig.two_stream=True)")
    structured = isinstance(mask, Structured), isinstance(queries.mask, Structured)
    if structured[0] != structured[1] or (any(structured) and s):
      raise ValueError("a two-stream call takes two dense masks (masks.lattice), or two "
                       "structured ones (mask_structure.lattice) without a cache")
    b, t, d = x_BxTxD.shape
    q = queries.positions.shape[1] if queries.positions.ndim == 2 else -1
    if queries.positions.shape != (b, q) or tuple(queries.mask.shape) != (b, q, s + t):
      raise ValueError(f"queries need positions [B, Q] and mask [B, Q, S+T] = {(b, q, s + t)}, "
                       f"got {tuple(queries.positions.shape)} and {tuple(queries.mask.shape)}")
    g = jnp.broadcast_to(self.query_embed[...].astype(x_BxTxD.dtype), (b, q, d))
    both = (two_stream(mask, queries.mask) if structured[0]
            else jnp.concatenate([mask, queries.mask], 1))
    return (jnp.concatenate([x_BxTxD, g], 1),
            jnp.concatenate([positions_BxT, queries.positions], 1), both)
