"""The TPU decode layer's kernels (`model/tpu_decode_layer.py`, `tpu_decode_attention.py`),
run interpreted on this CPU: layers of three Pallas kernels (q/k/v, the output projection, the
MLP) around the attention kernel equal the model's layers in float32, for one row and a block
of rows, with weights in one column block and in several, with q/k/v biases; a model that
runs them decodes greedy AR's tokens with AR and TiDAR; and "auto" picks them only for a
TPU's 16-bit decode steps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_decode_attention import greedy_tokens

import paraflax as pf
from paraflax.model import masks, tpu_decode_layer
from paraflax.model.cache import CacheLayer, KVCache
from paraflax.model.transformer import Block, rope_frequencies
from paraflax.perf.shapes import model_config

SLOTS = 37


def _config(**overrides):
  cfg = model_config("micro", "float32")
  return dataclasses.replace(cfg, **{"d_model": 128, "n_heads": 4, "n_kv_heads": 2,
                                     "d_ff": 200, **overrides})


@pytest.mark.fast
@pytest.mark.parametrize("b,t,shape,bias", [
    (1, 1, {}, False),  # heads of 32; d_ff 200 in one column block, k and v in one of 64 lanes
    (3, 5, {"n_heads": 12, "n_kv_heads": 4, "head_dim": 32, "d_ff": 384}, True)],  # 3 blocks
    ids=["one row, one block", "block of rows, three blocks, biases"])
def test_the_layers_equal_the_model_layers(b, t, shape, bias):
  """Two layers over a two-layer cache, float32, "highest": output rows and the chunk's keys
  and values (post-RoPE) of each layer."""
  cfg = _config(qkv_bias=bias, **shape)
  if "d_ff" in shape:  # q and the MLP's d_ff in several column blocks: the grid walks them
    assert tpu_decode_layer.columns(cfg.d_model, cfg.n_heads * cfg.dim_per_head) == 128
    assert tpu_decode_layer.columns(cfg.d_model, cfg.d_ff, weights=3) == 128
  layers = [Block(cfg, nnx.Rngs(i)) for i in range(2)]
  keys = jax.random.split(jax.random.key(1), 9)
  if bias:  # biases initialise to zero: make them count
    for layer, k0 in zip(layers, (3, 6)):
      for name, key in zip(("bq", "bk", "bv"), keys[k0:k0 + 3]):
        p = getattr(layer.attn, name)
        p[...] = jax.random.normal(key, p.shape)
  x = jax.random.normal(keys[0], (b, t, cfg.d_model))
  shape = (2, b, SLOTS, cfg.n_kv_heads, cfg.dim_per_head)
  cache = KVCache(k=jax.random.normal(keys[1], shape), v=jax.random.normal(keys[2], shape),
                  lengths=jnp.zeros((b,), jnp.int32))
  lengths = jnp.minimum(jnp.array([5, 20, 30])[:b], SLOTS - t)
  positions = lengths[:, None] + jnp.arange(t)[None, :]
  mask = masks.decode(lengths, SLOTS, t)
  inv_freq = rope_frequencies(cfg)
  with jax.default_matmul_precision("highest"):
    want, kvs = x, []
    for i, layer in enumerate(layers):
      want, kv = layer(want, positions, mask, CacheLayer(cache.k, cache.v, i), inv_freq, t,
                       "xla", "cpu")
      kvs.append(kv)
    got, (k, v) = tpu_decode_layer.layers(layers, x, positions, mask, cache, inv_freq,
                                          interpret=True)
  close = lambda a, w: np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)  # noqa: E731
  close(got, want)
  for i, (wk, wv) in enumerate(kvs):
    close(k[i], wk)
    close(v[i], wv)


def test_a_model_running_the_kernels_decodes_greedy_ar_tokens():
  """Greedy AR and TiDAR (k=4: 20 rows a sequence, its target mixing rows), float32,
  right-padded prompts: with `attention="tpu_decode"` the prefill runs dense xla and every
  step the four kernels a layer, and the tokens equal dense xla's AR tokens. (The whole suite
  only: the fast tier checks the layers themselves on the lower bounds.)"""
  cfg = _config(vocab_size=64, n_layers=2, mask_token_id=63)
  assert tpu_decode_layer.runs(cfg, (2, 20, cfg.d_model), True, 20, "tpu_decode", "cpu")
  decoders = (pf.decoders.AR(), pf.decoders.TiDAR(4))
  tokens = greedy_tokens(cfg, logit_scale=8.0, decoders=decoders,
                         settings=("xla", "tpu_decode"))
  for name in ("AR", "TiDAR"):
    np.testing.assert_array_equal(tokens["tpu_decode", name], tokens["xla", "AR"])


@pytest.mark.fast
def test_the_layer_runs_only_where_its_kernels_apply():
  """On a TPU with 16-bit compute by default, up to `MAX_ROWS` rows over a cache; not on a CPU
  or a GPU by default, nor for a prefill, the query stream, Qwen3's q/k norms, wider steps or
  float32 compute."""
  cfg = dataclasses.replace(_config(), dtype="bfloat16")
  x = (1, 4, cfg.d_model)
  assert tpu_decode_layer.runs(cfg, x, True, 4, "auto", "tpu")
  assert not tpu_decode_layer.runs(cfg, x, True, 4, "auto", "cpu")
  assert not tpu_decode_layer.runs(cfg, x, True, 4, "auto", "gpu")
  assert not tpu_decode_layer.runs(cfg, x, False, 4, "auto", "tpu")  # no cache: a prefill
  assert not tpu_decode_layer.runs(cfg, x, True, 2, "auto", "tpu")  # query-stream rows
  assert not tpu_decode_layer.runs(dataclasses.replace(cfg, qk_norm=True), x, True, 4, "auto",
                                   "tpu")
  wide = (16, tpu_decode_layer.MAX_ROWS // 16 + 1, cfg.d_model)  # 65 rows a sequence
  assert tpu_decode_layer.runs(cfg, (8, wide[1], cfg.d_model), True, wide[1], "auto", "tpu")
  assert not tpu_decode_layer.runs(cfg, wide, True, wide[1], "auto", "tpu")
  assert not tpu_decode_layer.runs(dataclasses.replace(cfg, dtype="float32"), x, True, 4,
                                   "auto", "tpu")
