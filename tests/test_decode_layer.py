"""The decode layer's kernels (`model/decode_layer.py`), run interpreted on this CPU: a layer
in five kernels equals the model's layer (dense attention over the same cache) in float32, for
one row, a block of rows, batch rows past a tile, with and without q/k/v biases; and a model
that runs them decodes greedy AR's tokens with AR and Jacobi."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_decode_attention import greedy_tokens

import paraflax as pf
from paraflax.model import decode_layer, masks
from paraflax.model.cache import CacheLayer
from paraflax.model.transformer import Block, rope_frequencies
from paraflax.perf.shapes import model_config

SLOTS = 37


def _config(**overrides):
  """Heads of 32 (each RoPE half a dot's 16), grouped 2 per kv head, d_ff not a multiple of
  the kernels' column blocks."""
  cfg = model_config("micro", "float32")
  return dataclasses.replace(cfg, d_model=128, n_heads=4, n_kv_heads=2, d_ff=200,
                             **overrides)


@pytest.mark.parametrize("b,t", [pytest.param(1, 1, marks=pytest.mark.fast), (3, 5), (3, 30)],
                         ids=["one row", "block", "two tiles"])
@pytest.mark.parametrize("bias", [True, False], ids=["biases", "no biases"])
def test_the_layer_equals_the_model_layer(b, t, bias):
  """float32, "highest": output rows and the chunk's keys and values (post-RoPE)."""
  cfg = _config(qkv_bias=bias)
  layer = Block(cfg, nnx.Rngs(0))
  keys = jax.random.split(jax.random.key(1), 6)
  if bias:  # biases initialise to zero: make them count
    for name, key in zip(("bq", "bk", "bv"), keys[3:]):
      p = getattr(layer.attn, name)
      p[...] = jax.random.normal(key, p.shape)
  x = jax.random.normal(keys[0], (b, t, cfg.d_model))
  shape = (2, b, SLOTS, cfg.n_kv_heads, cfg.dim_per_head)
  cache = CacheLayer(jax.random.normal(keys[1], shape), jax.random.normal(keys[2], shape), 1)
  lengths = jnp.minimum(jnp.array([5, 20, 30])[:b], SLOTS - t)
  positions = lengths[:, None] + jnp.arange(t)[None, :]
  mask = masks.decode(lengths, SLOTS, t)
  inv_freq = rope_frequencies(cfg)
  with jax.default_matmul_precision("highest"):
    want, (wk, wv) = layer(x, positions, mask, cache, inv_freq, t, "xla", "cpu")
    got, (k, v) = decode_layer.block(layer, x, positions, mask, cache, inv_freq, interpret=True)
  for a, w in ((got, want), (k, wk), (v, wv)):
    np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)


def test_a_model_running_the_kernels_decodes_greedy_ar_tokens():
  """Greedy AR, Jacobi and TiDAR (k=4: 20 rows a sequence, its target mixing AR and
  diffusion rows in the greedy head), float32, right-padded prompts: with
  `attention="gpu_decode"` the prefill (wider than a decode step) runs dense xla and every
  step the five kernels and the greedy head, and the tokens equal dense xla's throughout."""
  cfg = _config(vocab_size=64, n_layers=2, mask_token_id=63)
  assert decode_layer.runs(cfg, (2, 20, cfg.d_model), True, 20, "gpu_decode", "cpu")
  decoders = (pf.decoders.AR(), pf.decoders.Jacobi(4), pf.decoders.TiDAR(4))
  tokens = greedy_tokens(cfg, logit_scale=8.0, decoders=decoders)
  for name in ("AR", "Jacobi", "TiDAR"):
    np.testing.assert_array_equal(tokens["gpu_decode", name], tokens["xla", name])
  np.testing.assert_array_equal(tokens["xla", "Jacobi"], tokens["xla", "AR"])


@pytest.mark.fast
def test_the_layer_runs_only_where_its_kernels_apply():
  """Not on a CPU by default, nor for the query stream, Qwen3's q/k norms, narrow heads or
  more rows than `MAX_ROWS`; on a GPU with 16-bit compute by default."""
  cfg = dataclasses.replace(_config(), dtype="bfloat16")
  x = (1, 4, cfg.d_model)
  assert decode_layer.runs(cfg, x, True, 4, "auto", "gpu")
  assert not decode_layer.runs(cfg, x, True, 4, "auto", "cpu")
  assert not decode_layer.runs(cfg, x, False, 4, "auto", "gpu")  # no cache: a prefill
  assert not decode_layer.runs(cfg, x, True, 2, "auto", "gpu")  # query-stream rows
  assert not decode_layer.runs(dataclasses.replace(cfg, qk_norm=True), x, True, 4, "auto", "gpu")
  assert not decode_layer.runs(dataclasses.replace(cfg, n_heads=8, n_kv_heads=2), x, True, 4,
                               "auto", "gpu")  # heads of 16: RoPE halves of 8
  wide = (8, decode_layer.MAX_ROWS // 8 + 1, cfg.d_model)
  assert not decode_layer.runs(cfg, wide, True, wide[1], "auto", "gpu")
  assert not decode_layer.runs(dataclasses.replace(cfg, dtype="float32"), x, True, 4, "auto",
                               "gpu")


@pytest.mark.fast
def test_a_wide_projection_equals_its_matmul():
  """A wide step's projection (200 rows: four row tiles, the last partial) takes column blocks
  of 64 (enough programs), the last partial too: normed, gated and with the residual, it
  equals the model's arithmetic in float32."""
  m, k, n = 200, 96, 1000
  keys = jax.random.split(jax.random.key(2), 5)
  x, scale = jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (k,))
  w, gate = (jax.random.normal(key, (k, n)) for key in keys[2:4])
  residual = jax.random.normal(keys[4], (m, n))
  assert decode_layer.column_block(m, n) == 64
  with jax.default_matmul_precision("highest"):
    normed = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale
    want = jax.nn.silu(normed @ gate) * (normed @ w) + residual
    got = decode_layer.project(x, w, gate=gate, norm_scale=scale, eps=1e-6, interpret=True)
    close = lambda a, b: np.testing.assert_allclose(  # up to summation order, at b's scale
        a, b, rtol=2e-5, atol=2e-6 * float(jnp.abs(b).max()))
    close(got + residual, want)
    close(decode_layer.project(x, w, residual=residual, interpret=True), x @ w + residual)
