"""Mask builders equal hand-written arrays; the causal mask makes the model causal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_model
from flax import nnx

from paraflax.model import masks


def _a(rows):
  return np.array([[c == "1" for c in r.replace(" ", "")] for r in rows])


@pytest.mark.fast
def test_cache_slots():
  got = masks.cache_slots(jnp.array([2, 4]), 5)
  np.testing.assert_array_equal(got, _a(["11000", "11110"]))


@pytest.mark.fast
def test_causal_padding_aware():
  got = masks.causal(jnp.array([3, 1]), 4)
  np.testing.assert_array_equal(got[0], _a(["1000", "1100", "1110", "1110"]))
  np.testing.assert_array_equal(got[1], _a(["1000", "1000", "1000", "1000"]))


@pytest.mark.fast
def test_block_causal():
  got = masks.block_causal(jnp.array([[0, 0, 1, 1, 1]]))
  np.testing.assert_array_equal(
      got[0], _a(["10000", "11000", "00100", "00110", "00111"]))


@pytest.mark.fast
def test_over_cache_and_decode():
  got = masks.decode(jnp.array([2, 0]), 3, 2)
  np.testing.assert_array_equal(got[0], _a(["110 10", "110 11"]))
  np.testing.assert_array_equal(got[1], _a(["000 10", "000 11"]))
  chunk = masks.block_causal(jnp.array([[0, 1]]))
  np.testing.assert_array_equal(masks.over_cache(jnp.array([1]), 2, chunk)[0],
                                _a(["10 10", "10 01"]))


@pytest.mark.fast
def test_decode_candidates():
  got = masks.decode_candidates(jnp.array([1, 2]), 2, 3, 2, 2)
  assert got.shape == (2, 7, 9)
  np.testing.assert_array_equal(got[0], _a([
      "10 1000000", "10 1100000", "10 1110000",
      "10 0001000", "10 0001100",
      "10 0000010", "10 0000011"]))
  np.testing.assert_array_equal(got[1, :, :2], np.ones((7, 2), bool))
  np.testing.assert_array_equal(got[1, :, 2:], got[0, :, 2:])
  # no candidates: the plain decode mask
  np.testing.assert_array_equal(masks.decode_candidates(jnp.array([2, 0]), 3, 2, 2, 0),
                                masks.decode(jnp.array([2, 0]), 3, 2))

def test_causal_mask_makes_logits_independent_of_later_tokens():
  """d logits[i] / d embed[token_j] == 0 for j > i: every token id is distinct, so the
  gradient with respect to an embedding row is the gradient with respect to that input."""
  model = micro_model()
  t = 8
  tokens = jnp.arange(t)[None] + 3
  pos = jnp.arange(t)[None]
  mask = masks.causal(jnp.array([t]), t)
  graphdef, params = nnx.split(model)

  def logits_energy(emb):  # [T]: a scalar per query position
    p = jax.tree.map(lambda x: x, params)  # a shallow copy whose embedding is the input
    p["embed"] = nnx.Param(emb)
    logits, _ = nnx.merge(graphdef, p)(tokens, pos, mask)
    return jnp.sum(logits[0] ** 2, -1)

  jac = jax.jacrev(logits_energy)(model.embed[...])  # [T, V, D]
  seen = np.abs(np.asarray(jac)).sum(-1)  # [T, V]
  ids = np.asarray(tokens[0])
  for i in range(t):
    assert np.all(seen[i, ids[i + 1:]] == 0.0), f"position {i} sees a later token"
    assert np.all(seen[i, ids[:i + 1]] > 0.0), f"position {i} does not see its prefix"


@pytest.mark.fast
def test_tidar_training_mask():
  """[c0..c3 | m0..m3], block size 2: clean causal, mask blocks see the clean prefix before
  them and themselves (the docstring's picture)."""
  got = masks.tidar_train(4, jnp.array([2]))
  np.testing.assert_array_equal(got[0], _a([
      "1000 0000", "1100 0000", "1110 0000", "1111 0000",
      "0000 1100", "0000 1100", "1100 0011", "1100 0011"]))
  kinds = jnp.array([[masks.CLEAN] * 4 + [masks.MASKED] * 4])
  blocks = jnp.array([[0, 0, 1, 1, 0, 0, 1, 1]])
  np.testing.assert_array_equal(masks.tidar(kinds, blocks), got)


@pytest.mark.fast
def test_tidar_prefill():
  got = masks.tidar_prefill(jnp.array([2, 3]), 3, 2)
  np.testing.assert_array_equal(got[0], _a([
      "100 00", "110 00", "111 00", "110 11", "110 11"]))
  np.testing.assert_array_equal(got[1], _a([
      "100 00", "110 00", "111 00", "111 11", "111 11"]))


@pytest.mark.fast
def test_tidar_decode():
  got = masks.tidar_decode(jnp.array([1, 2]), 2, 2)
  assert got.shape == (2, 6, 8)
  np.testing.assert_array_equal(got[0], _a([
      "10 100000", "10 110000", "10 101100", "10 101100", "10 110011", "10 110011"]))
  np.testing.assert_array_equal(got[1, :, :2], np.ones((6, 2), bool))
  np.testing.assert_array_equal(got[1, :, 2:], got[0, :, 2:])
  k3 = masks.tidar_decode(jnp.array([0]), 1, 3)[0, :, 1:]  # k = 3: 3 inputs + 3 blocks of 3
  assert k3.shape == (12, 12)
  np.testing.assert_array_equal(k3[:3, :3], np.tril(np.ones((3, 3), bool)))
  for j in range(3):  # block j sees inputs 0..j and itself
    rows = k3[3 + 3 * j:6 + 3 * j]
    np.testing.assert_array_equal(rows[:, :3], np.broadcast_to(np.arange(3) <= j, (3, 3)))
    np.testing.assert_array_equal(rows[:, 3:], np.broadcast_to(
        np.arange(9) // 3 == j, (3, 9)))
