"""The TPU greedy head kernel (`model/tpu_greedy_head.py`), run interpreted on this CPU: its
argmax equals `argmax(head(x))` for both weight layouts and a vocabulary that is not a
multiple of its block, ties go to the first maximal column across blocks as `jnp.argmax`'s
do, rows mixed with other rows (TiDAR's target) are argmaxes of the mixed logits, the
model's argmax is the same through the kernel and through its logits, and the rule runs it
only where the TPU decode layer runs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.model import greedy_head, tpu_greedy_head
from paraflax.model.run import RunControl
from paraflax.model.transformer import logits
from paraflax.perf.shapes import model_config

pytestmark = pytest.mark.fast

V, D = 300, 96  # three blocks of 128 columns, the last partial
TIES = jnp.array([7, 40, 200, 299])  # columns in the first, the second and the last block


@pytest.mark.parametrize("m", [1, 70], ids=["one row", "70 rows"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_the_kernel_argmax_is_the_head_argmax(m, tied):
  """Row 0's largest logit is columns 7, 40, 200 and 299 alike: it gets 7, and every row what
  `jnp.argmax` of the head's logits gives."""
  kx, kw = jax.random.split(jax.random.key(m))
  x = jax.random.normal(kx, (m, D))
  w = jax.random.normal(kw, (V, D)).at[TIES].set(10 * x[0])
  w = w if tied else w.T
  with jax.default_matmul_precision("highest"):
    want = jnp.argmax(logits(x[None], w.T if tied else w)[0], -1)
    got = tpu_greedy_head.argmax(x, w, tied=tied, columns=128, interpret=True)
  assert got.dtype == jnp.int32 and got[0] == 7
  np.testing.assert_array_equal(got, want)


def test_a_mixed_row_is_the_argmax_of_the_mixed_logits():
  """TiDAR's target: `a * logits(x) + (1 - a) * logits(y)` per row (a = 1: x's own row)."""
  kx, ky, kw, ka = jax.random.split(jax.random.key(4), 4)
  x, y = jax.random.normal(kx, (20, D)), jax.random.normal(ky, (20, D))
  w = jax.random.normal(kw, (V, D))
  a = jnp.where(jnp.arange(20) < 10, jax.random.uniform(ka, (20,)), 1.0)
  with jax.default_matmul_precision("highest"):
    mixed = a[:, None] * (x @ w.T) + (1.0 - a[:, None]) * (y @ w.T)
    got = tpu_greedy_head.argmax(x, w, tied=True, mix=(y, a), columns=128, interpret=True)
    np.testing.assert_array_equal(got, jnp.argmax(mixed, -1))
    np.testing.assert_array_equal(got[10:], jnp.argmax(x[10:] @ w.T, -1))


def test_the_model_argmax_takes_the_kernel_or_the_logits_alike():
  """`Transformer.argmax` with and without `mix`: the kernel ("tpu_decode", interpreted)
  and the logits path ("xla") give the same tokens, tied embedding or not."""
  for tied in (True, False):
    cfg = dataclasses.replace(model_config("micro", "float32"), tie_embeddings=tied)
    assert tpu_greedy_head.runs(cfg, 12, "tpu_decode", "cpu")
    x = jax.random.normal(jax.random.key(5), (2, 6, cfg.d_model))
    other = jnp.broadcast_to(jnp.array([3, 4, 5, 3, 4, 5]), (2, 6))
    a = jnp.broadcast_to(jnp.array([0.25, 0.5, 1.0, 1.0, 1.0, 1.0]), (2, 6))
    got = {}
    with jax.default_matmul_precision("highest"):
      for setting in ("xla", "tpu_decode"):
        model = pf.Transformer(cfg, rngs=nnx.Rngs(0), run=RunControl(attention=setting))
        got[setting] = [model.argmax(x), model.argmax(x, (other, a))]
    for want, have in zip(got["xla"], got["tpu_decode"]):
      np.testing.assert_array_equal(have, want)


def test_the_kernel_runs_where_the_tpu_decode_layer_runs():
  cfg = model_config("micro", "bfloat16")
  assert tpu_greedy_head.runs(cfg, 8, "auto", "tpu")
  assert tpu_greedy_head.runs(cfg, 8, "tpu_decode", "cpu")  # interpreted (the tests)
  assert not tpu_greedy_head.runs(cfg, 8, "auto", "cpu")
  assert not tpu_greedy_head.runs(cfg, 8, "auto", "gpu")
  assert not tpu_greedy_head.runs(cfg, 8, "xla", "tpu")
  assert not tpu_greedy_head.runs(cfg, tpu_greedy_head.MAX_ROWS + 1, "auto", "tpu")
  assert not tpu_greedy_head.runs(dataclasses.replace(cfg, dtype="float32"), 8, "auto", "tpu")
  assert not greedy_head.runs(cfg, 8, "auto", "tpu")  # the GPU kernel's rule is disjoint


def test_a_block_of_columns_is_the_widest_that_fits_its_vmem():
  """Its logits (each source's) and its weight block (double-buffered) fit their VMEM
  budgets, and the next wider block would not: at 0.5B's and 7B's widths, bf16."""
  blocks = tpu_greedy_head.BLOCKS_V
  def fits(rows, sources, d, c):
    return (sources * rows * c * 4 <= tpu_greedy_head.LOGITS_VMEM
            and 2 * d * c * 2 <= tpu_greedy_head.WEIGHT_VMEM)
  for rows, sources in ((8, 1), (160, 2), (576, 2), (1024, 2)):
    for d in (896, 3584):
      c = tpu_greedy_head.block_v(rows, sources, d, 2)
      assert fits(rows, sources, d, c)
      assert c == blocks[0] or not fits(rows, sources, d, blocks[blocks.index(c) - 1])
