"""The AS-ARM two-stream model and its lattice masks: a query never reads its own token,
the cache changes nothing, the masks equal hand-built arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_model

import paraflax as pf
from paraflax.model import masks
from paraflax.model.cache import commit, init_cache


@pytest.fixture(scope="module")
def asarm():
  return micro_model(seed=4, two_stream=True)


@pytest.mark.fast
def test_lattice_masks_equal_hand_built_ones():
  content, query = masks.lattice(jnp.array([[True, False, True, False]]))
  np.testing.assert_array_equal(content[0], np.array([[1, 0, 1, 0], [1, 1, 1, 0], [1, 0, 1, 0],
                                                      [1, 1, 1, 1]], bool))
  np.testing.assert_array_equal(query[0], np.array([[1, 0, 1, 0], [1, 0, 1, 0], [1, 0, 1, 0],
                                                    [1, 1, 1, 0]], bool))
  content, query = masks.lattice(jnp.array([[False, True, False]]), jnp.array([[1, 1, 0]], bool))
  np.testing.assert_array_equal(content[0], np.array([[1, 1, 0], [0, 1, 0], [0, 0, 1]], bool))
  np.testing.assert_array_equal(query[0], np.array([[0, 1, 0], [0, 1, 0], [0, 0, 1]], bool))


def _teacher_forced(model, tokens, visible):
  b, n = tokens.shape
  content, query = masks.lattice(visible)
  pos = jnp.broadcast_to(jnp.arange(n), (b, n))
  logits, kv = model(tokens, pos, content, queries=pf.Queries(pos, query))
  return logits, kv


def test_a_query_never_reads_its_own_token_but_later_queries_do(asarm):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 48, (1, 10)), jnp.int32)
  visible = jnp.asarray(rng.random((1, 10)) < 0.4).at[0, 4].set(False).at[0, 7].set(False)
  logits, _ = _teacher_forced(asarm, tokens, visible)
  assert logits.shape == (1, 10, 48)
  changed, _ = _teacher_forced(asarm, tokens.at[0, 4].set((tokens[0, 4] + 1) % 48), visible)
  np.testing.assert_allclose(changed[0, :5], logits[0, :5], atol=1e-5)  # itself and before
  assert float(jnp.abs(changed[0, 7] - logits[0, 7]).max()) > 1e-3  # a later target reads it


def test_query_stream_over_a_cache_equals_one_teacher_forced_call(asarm):
  """Prompt content cached, then targets' content + queries as a chunk: same query logits."""
  rng = np.random.default_rng(1)
  n, m = 9, 4
  tokens = jnp.asarray(rng.integers(0, 48, (2, n)), jnp.int32)
  visible = jnp.arange(n)[None] < m  # prompt first, then targets: one chunk each
  visible = jnp.broadcast_to(visible, (2, n))
  ref, _ = _teacher_forced(asarm, tokens, visible)
  content, _ = masks.lattice(visible)
  pos = jnp.broadcast_to(jnp.arange(n), (2, n))
  _, kv = asarm(tokens[:, :m], pos[:, :m], content[:, :m, :m])
  cache = commit(init_cache(asarm.cfg, 2, 16), kv, jnp.broadcast_to(jnp.arange(m), (2, m)),
                 jnp.full((2,), m))
  t = n - m
  causal = masks.decode(cache.lengths, cache.slots, t)
  strict = causal & ~jnp.eye(cache.slots + t, dtype=bool)[cache.slots:][None]
  logits, _ = asarm(tokens[:, m:], pos[:, m:], causal, cache, pf.Queries(pos[:, m:], strict))
  np.testing.assert_allclose(logits, ref[:, m:], atol=2e-5)


@pytest.mark.fast
def test_queries_need_a_two_stream_model_and_right_shapes(model, asarm):
  pos = jnp.arange(3)[None]
  full = jnp.ones((1, 3, 3), bool)
  with pytest.raises(ValueError, match="needs a two-stream model"):
    model(jnp.zeros((1, 3), jnp.int32), pos, full, queries=pf.Queries(pos, full))
  with pytest.raises(ValueError, match=r"mask \[B, Q, S\+T\]"):
    asarm(jnp.zeros((1, 3), jnp.int32), pos, full, queries=pf.Queries(pos, full[:, :, :2]))
  content = jax.eval_shape(lambda: asarm(jnp.zeros((1, 3), jnp.int32), pos, full))[0]
  assert content.shape == (1, 3, 48)  # without queries: the content stream's logits
