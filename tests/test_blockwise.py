"""Blockwise attention over structured masks (`attention.blockwise`): values and gradients equal
the dense reference under every kind of training mask, empty tiles are really skipped (forward
and backward), and the model takes a structured mask in place of the dense one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paraflax.model import attention, masks
from paraflax.model import mask_structure as ms
from paraflax.model.transformer import Queries
from paraflax.training.objectives import jacobi_forcing as jf
from paraflax.training.run.step import init_params
from conftest import compiled_forward

pytestmark = pytest.mark.fast


def _masks():
  """Structured masks of each shape of rule, no query row without a key."""
  row = jf.example(np.arange(3) + 4, np.full((2, 4), 5), np.full((2, 4), 6), 21)  # 2 padding
  visible = jnp.asarray(np.random.default_rng(0).random((2, 12)) < 0.4)
  return {
      "causal": ms.causal(jnp.array([12, 7]), 12),
      "tidar_train": ms.tidar_train(6, jnp.array([2, 4])),
      "noise_aware": ms.noise_aware(jnp.asarray(row["kinds"])[None],
                                    jnp.asarray(row["valid"])[None]),
      "lattice": ms.lattice(visible)[0],
      "decode over a cache": ms.decode(jnp.array([3, 5]), 6, 5),
  }


def _qkv(mask, seed=0, h=4, hkv=2, d=8):
  b, t, s = mask.shape
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (b, t, h, d)), jax.random.normal(k2, (b, s, hkv, d)),
          jax.random.normal(k3, (b, s, hkv, d)))


@pytest.mark.parametrize("name", list(_masks()))
def test_values_and_gradients_equal_the_dense_path(name):
  mask = _masks()[name]
  q, k, v = _qkv(mask)
  w = jax.random.normal(jax.random.key(9), q.shape)  # a cotangent: every output counts

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))

  dense = loss(lambda q, k, v: attention._dense(q, k, v, mask.dense(), None))(q, k, v)
  tiled = loss(lambda q, k, v: attention.blockwise(q, k, v, mask, 4, 3))(q, k, v)
  for got, want in zip(jax.tree.leaves(tiled), jax.tree.leaves(dense)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_empty_tiles_are_skipped_forward_and_backward():
  """Causal, tiles of 4: the first block of queries never touches the last block of keys,
  so NaN keys and values there cannot reach its outputs or their gradients (a computed tile
  would give 0 x NaN = NaN)."""
  mask = ms.causal(jnp.array([12]), 12)
  assert mask.layout(4, 4)[0, 0, 2] == ms.EMPTY
  q, k, v = _qkv(mask)
  k, v = k.at[:, 8:].set(jnp.nan), v.at[:, 8:].set(jnp.nan)
  out = attention.blockwise(q, k, v, mask, 4, 4)
  assert np.isfinite(out[:, :8]).all() and np.isnan(out[:, 8:]).all()
  grad = jax.grad(lambda q: attention.blockwise(q, k, v, mask, 4, 4)[:, :4].sum())(q)
  assert np.isfinite(grad[:, :4]).all()  # (later rows: 0 cotangent x NaN values = NaN)


def test_the_model_takes_a_structured_mask_in_place_of_the_dense_one(model):
  """The AR forward and TiDAR's doubled row, structured (blockwise) vs dense masks."""
  forward = compiled_forward(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, model.cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  for dense, structured in [(masks.causal(jnp.array([20, 13]), 20),
                             ms.causal(jnp.array([20, 13]), 20)),
                            (masks.tidar_train(10, jnp.array([2, 5])),
                             ms.tidar_train(10, jnp.array([2, 5])))]:
    want, want_kv = forward(tokens, pos, dense)
    got, got_kv = forward(tokens, pos, structured)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_kv.k[0], want_kv.k[0])  # before any attention
    np.testing.assert_allclose(got_kv.v, want_kv.v, rtol=1e-5, atol=1e-5)
  two = nnx.merge(*init_params(dataclasses.replace(model.cfg, two_stream=True), 0))
  content, query = ms.lattice(pos < 5)
  with pytest.raises(ValueError, match="two-stream calls take dense masks"):
    two(tokens, pos, content, queries=Queries(pos, query))
