"""`commit` appends any chosen chunk rows at each row's length; the spare slot absorbs the rest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paraflax as pf
from conftest import MICRO
from paraflax.model.cache import TPU_SPARE

pytestmark = pytest.mark.fast


def test_commit_appends_chosen_rows_per_row():
  cfg = pf.ModelConfig(**{**MICRO, "n_layers": 1, "n_kv_heads": 1, "head_dim": 2, "n_heads": 1,
                          "d_model": 2})
  cache = pf.init_cache(cfg, 3, 6)
  cache = cache.replace(lengths=jnp.array([0, 2, 5]))
  values = jnp.arange(3 * 4, dtype=jnp.float32).reshape(1, 3, 4, 1, 1) + 1.0  # row-unique
  chunk = pf.ChunkKV(k=jnp.broadcast_to(values, (1, 3, 4, 1, 2)),
                     v=-jnp.broadcast_to(values, (1, 3, 4, 1, 2)))
  src = jnp.array([[0, 1, 2], [3, 1, 0], [2, 2, 2]])  # any rows, e.g. a winning candidate's
  out = pf.commit(cache, chunk, src, jnp.array([3, 2, 0]))
  np.testing.assert_array_equal(out.lengths, [3, 4, 5])
  k = np.asarray(out.k[0, :, :, 0, 0])
  np.testing.assert_array_equal(k[0, :3], [1, 2, 3])
  np.testing.assert_array_equal(k[1, 2:4], [8, 6])  # chunk rows 3 and 1 of batch row 1
  np.testing.assert_array_equal(k[1, :2], [0, 0])  # untouched
  np.testing.assert_array_equal(k[2, :6], [0] * 6)  # count 0: nothing written to real slots
  np.testing.assert_array_equal(out.v, -out.k)
  assert out.capacity == 6 and out.slots == 7


@pytest.mark.parametrize("n", [1, 3, TPU_SPARE + 4])
def test_a_tpu_cache_commits_as_the_scatter_does(n):
  """A TPU's cache (`slices`) writes each row's window of n slots by dynamic slices: every
  committed slot equals the scatter's, for rows that keep all, some or none of their
  entries, near the capacity and full. Up to `TPU_SPARE` entries the window starts at the
  row's length and nothing is read; past them the window is read first, and near the
  last slot it is clamped back over committed slots."""
  cfg = pf.ModelConfig(**{**MICRO, "n_layers": 2, "n_kv_heads": 1, "head_dim": 2, "n_heads": 1,
                          "d_model": 2})
  lengths = jnp.array([0, 3, 6, 5, 4])
  scatter = pf.init_cache(cfg, 5, 6).replace(lengths=lengths)
  sliced = pf.init_cache(cfg, 5, 6, backend="tpu").replace(lengths=lengths)
  assert sliced.slices and not scatter.slices
  assert sliced.capacity == scatter.capacity == 6 and sliced.slots == 6 + TPU_SPARE
  reads = "dynamic_slice" in str(jax.make_jaxpr(pf.commit)(
      sliced, pf.ChunkKV(k=jnp.zeros((2, 5, 4, 1, 2)), v=jnp.zeros((2, 5, 4, 1, 2))),
      jnp.zeros((5, n), jnp.int32), jnp.zeros((5,), jnp.int32)))
  assert reads == (n > TPU_SPARE)
  rng = np.random.default_rng(n)
  for step in range(4):
    values = jnp.arange(2 * 5 * 4, dtype=jnp.float32).reshape(2, 5, 4, 1, 1) + 100.0 * step
    chunk = pf.ChunkKV(k=jnp.broadcast_to(values, (2, 5, 4, 1, 2)),
                       v=-jnp.broadcast_to(values, (2, 5, 4, 1, 2)))
    src = jnp.asarray(rng.integers(0, 4, (5, n)))
    room = 6 - np.asarray(scatter.lengths)  # a step commits what fits, as decoders do
    count = jnp.asarray(np.minimum(rng.integers(0, n + 1, 5), room))
    scatter, sliced = (pf.commit(c, chunk, src, count) for c in (scatter, sliced))
    np.testing.assert_array_equal(sliced.lengths, scatter.lengths)
    for b, m in enumerate(np.asarray(scatter.lengths)):
      np.testing.assert_array_equal(sliced.k[:, b, :m], scatter.k[:, b, :m])
      np.testing.assert_array_equal(sliced.v[:, b, :m], scatter.v[:, b, :m])
  assert sliced.slices  # a commit keeps the cache's kind
