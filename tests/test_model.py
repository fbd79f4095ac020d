"""The transformer: cached decoding equals recomputation; config and shape errors are clear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO, micro_model
from flax import nnx

import paraflax as pf
from paraflax.model import masks

VARIANTS = [
    dict(),
    dict(qkv_bias=True),
    dict(qk_norm=True, tie_embeddings=True),
    dict(n_kv_heads=4, rope_theta=1e6),
    dict(n_kv_heads=1, head_dim=16),
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_cached_decoding_equals_full_recomputation(overrides):
  model = micro_model(**overrides)
  b, t, s = 2, 12, 16
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, MICRO["vocab_size"])
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  full, _ = model(tokens, pos, masks.causal(jnp.full((b,), t), t))

  # prefill 5 tokens, then a 4-token chunk, then 3 single tokens, all through the cache
  cache = pf.init_cache(model.cfg, b, s)
  got = []
  for lo, hi in [(0, 5), (5, 9), (9, 10), (10, 11), (11, 12)]:
    n = hi - lo
    logits, kv = model(tokens[:, lo:hi], pos[:, lo:hi], masks.decode(cache.lengths, cache.slots, n),
                       cache)
    cache = pf.commit(cache, kv, jnp.broadcast_to(jnp.arange(n), (b, n)), jnp.full((b,), n))
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, 1), full, atol=1e-5, rtol=1e-5)


def test_logits_are_float32_in_bfloat16_compute():
  model = micro_model(dtype="bfloat16")
  logits, kv = model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None],
                     masks.causal(jnp.array([3]), 3))
  assert logits.dtype == jnp.float32 and kv.k.dtype == jnp.bfloat16
  assert kv.k.shape == (MICRO["n_layers"], 1, 3, MICRO["n_kv_heads"], 8)


@pytest.mark.fast
def test_params_carry_logical_axis_names(model):
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  names = {n for spec in leaves for n in spec if n is not None}
  assert names == {"embed", "heads", "kv_heads", "mlp", "vocab"}
  assert all(len(spec) > 0 for spec in leaves)


@pytest.mark.fast
def test_mask_shape_mismatch_is_a_clear_error(model):
  tokens = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match=r"mask must have shape \[B, T, S\+T\]"):
    model(tokens, jnp.arange(3)[None], jnp.ones((1, 3, 4), bool))
  cache = pf.init_cache(model.cfg, 1, 4)
  with pytest.raises(ValueError, match="5 cache slots"):
    model(tokens, jnp.arange(3)[None], jnp.ones((1, 3, 3), bool), cache)


@pytest.mark.parametrize("bad, match", [
    (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(d_model=30), "not divisible by n_heads"),
    (dict(n_layers=0), "n_layers must be >= 1"),
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(mask_token_id=48), "outside the vocabulary"),
    (dict(sep_token_id=-1), "sep_token_id -1 is outside the vocabulary"),
])
@pytest.mark.fast
def test_bad_config_is_a_clear_error(bad, match):
  with pytest.raises(ValueError, match=match):
    pf.ModelConfig(**{**MICRO, **bad})
