"""The greedy head kernel (`model/greedy_head.py`), run interpreted on this CPU: its argmax
equals `argmax(head(x))` for both weight layouts, rows past a tile and a vocabulary that is
not a multiple of its block, ties go to the first maximal column as `jnp.argmax`'s do, and
the rule runs it only where the GPU decode kernels run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paraflax.model import greedy_head
from paraflax.model.transformer import logits
from paraflax.perf.shapes import model_config

pytestmark = pytest.mark.fast

V, D = 300, 96  # three vocabulary blocks, the last partial; a contraction past one block


@pytest.mark.parametrize("m", [1, 5, 70], ids=["one row", "a tile", "two tiles"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_the_kernel_argmax_is_the_head_argmax(m, tied):
  kx, kw = jax.random.split(jax.random.key(m))
  x = jax.random.normal(kx, (m, D))
  w = jax.random.normal(kw, (V, D) if tied else (D, V))
  with jax.default_matmul_precision("highest"):
    want = jnp.argmax(logits(x[None], w.T if tied else w)[0], -1)
    got = greedy_head.argmax(x, w, tied=tied, interpret=True)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, want)


def test_ties_go_to_the_first_maximal_column():
  """Columns 7, 40 (one block), 200 and 299 (later blocks) are one column, row 0's largest
  logit by far: row 0 gets 7, and every row what `jnp.argmax` gives."""
  kx, kw = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (8, D))
  w = jax.random.normal(kw, (V, D)).at[jnp.array([7, 40, 200, 299])].set(10 * x[0])
  want = jnp.argmax(x @ w.T, -1)
  assert want[0] == 7
  np.testing.assert_array_equal(greedy_head.argmax(x, w, tied=True, interpret=True), want)


def test_the_kernel_runs_where_the_decode_kernels_run():
  cfg = model_config("micro", "bfloat16")
  assert greedy_head.runs(cfg, 8, "auto", "gpu")
  assert greedy_head.runs(cfg, 8, "gpu_decode", "cpu")  # interpreted (the tests)
  assert not greedy_head.runs(cfg, 8, "auto", "cpu")
  assert not greedy_head.runs(cfg, 8, "xla", "gpu")
  assert not greedy_head.runs(cfg, greedy_head.MAX_ROWS + 1, "auto", "gpu")
  assert not greedy_head.runs(dataclasses.replace(cfg, dtype="float32"), 8, "auto", "gpu")
