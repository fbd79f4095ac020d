"""The greedy head kernels, the GPU's (`model/greedy_head.py`) and the TPU's
(`model/tpu_greedy_head.py`), run interpreted on this CPU: each argmax equals
`argmax(head(x))` for both weight layouts, rows past a tile and a vocabulary that is not a
multiple of its block, ties go to the first maximal column as `jnp.argmax`'s do, rows mixed
with other rows (TiDAR's target) are argmaxes of the mixed logits, the model's argmax is the
same through either kernel and through its logits, each rule runs its kernel only where its
decode layer runs, and the TPU kernel's block of vocabulary columns is the widest that fits
its VMEM."""

import dataclasses
import functools

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

V, D = 300, 96  # three vocabulary blocks, the last partial; a contraction past one block
# each kernel's argmax, interpreted, in blocks of 128 vocabulary columns
KERNELS = {"gpu": functools.partial(greedy_head.argmax, interpret=True),
           "tpu": functools.partial(tpu_greedy_head.argmax, columns=128, interpret=True)}
# each kernel by the attention setting under which the model's argmax takes it on a CPU
SETTINGS = {"gpu_decode": greedy_head, "tpu_decode": tpu_greedy_head}
on_both = pytest.mark.parametrize("kernel", list(KERNELS))


@on_both
@pytest.mark.parametrize("m", [1, 5, 70], ids=["one row", "a tile", "two tiles"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_the_kernel_argmax_is_the_head_argmax(m, tied, kernel):
  kx, kw = jax.random.split(jax.random.key(m))
  x = jax.random.normal(kx, (m, D))
  w = jax.random.normal(kw, (V, D) if tied else (D, V))
  with jax.default_matmul_precision("highest"):
    want = jnp.argmax(logits(x[None], w.T if tied else w)[0], -1)
    got = KERNELS[kernel](x, w, tied=tied)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, want)


@on_both
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_ties_go_to_the_first_maximal_column(tied, kernel):
  """Columns 7, 40 (one block), 200 and 299 (later blocks) are one column, row 0's largest
  logit by far: row 0 gets 7, and every row what `jnp.argmax` gives."""
  kx, kw = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (8, D))
  w = jax.random.normal(kw, (V, D)).at[jnp.array([7, 40, 200, 299])].set(10 * x[0])
  want = jnp.argmax(x @ w.T, -1)
  assert want[0] == 7
  np.testing.assert_array_equal(KERNELS[kernel](x, w if tied else w.T, tied=tied), want)


def test_the_kernel_runs_where_the_decode_kernels_run():
  cfg = model_config("micro", "bfloat16")
  assert greedy_head.runs(cfg, 8, "auto", "gpu")
  assert greedy_head.runs(cfg, 8, "gpu_decode", "cpu")  # interpreted (the tests)
  assert not greedy_head.runs(cfg, 8, "auto", "cpu")
  assert not greedy_head.runs(cfg, 8, "xla", "gpu")
  assert not greedy_head.runs(cfg, greedy_head.MAX_ROWS + 1, "auto", "gpu")
  assert not greedy_head.runs(dataclasses.replace(cfg, dtype="float32"), 8, "auto", "gpu")


def test_the_kernel_runs_where_the_tpu_decode_layer_runs():
  cfg = model_config("micro", "bfloat16")
  assert tpu_greedy_head.runs(cfg, 8, "auto", "tpu")
  assert tpu_greedy_head.runs(cfg, 8, "tpu_decode", "cpu")  # interpreted (the tests)
  assert not tpu_greedy_head.runs(cfg, 8, "auto", "cpu")
  assert not tpu_greedy_head.runs(cfg, 8, "auto", "gpu")
  assert not tpu_greedy_head.runs(cfg, 8, "xla", "tpu")
  assert not tpu_greedy_head.runs(cfg, greedy_head.MAX_ROWS + 1, "auto", "tpu")
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


@on_both
def test_a_mixed_row_is_the_argmax_of_the_mixed_logits(kernel):
  """TiDAR's target: `a * logits(x) + (1 - a) * logits(y)` per row (a = 1: x's own row)."""
  kx, ky, kw, ka = jax.random.split(jax.random.key(4), 4)
  x, y = jax.random.normal(kx, (20, D)), jax.random.normal(ky, (20, D))
  w = jax.random.normal(kw, (V, D))
  a = jnp.where(jnp.arange(20) < 10, jax.random.uniform(ka, (20,)), 1.0)
  with jax.default_matmul_precision("highest"):
    mixed = a[:, None] * (x @ w.T) + (1.0 - a[:, None]) * (y @ w.T)
    got = KERNELS[kernel](x, w, tied=True, mix=(y, a))
    np.testing.assert_array_equal(got, jnp.argmax(mixed, -1))
    np.testing.assert_array_equal(got[10:], jnp.argmax(x[10:] @ w.T, -1))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_model_argmax_takes_the_kernel_or_the_logits_alike(setting):
  """`Transformer.argmax` with and without `mix`: the kernel ("gpu_decode" or "tpu_decode",
  interpreted) and the logits path ("xla") give the same tokens, tied embedding or not."""
  for tied in (True, False):
    cfg = dataclasses.replace(model_config("micro", "float32"), tie_embeddings=tied)
    assert SETTINGS[setting].runs(cfg, 12, setting, "cpu")
    x = jax.random.normal(jax.random.key(5), (2, 6, cfg.d_model))
    other = jnp.broadcast_to(jnp.array([3, 4, 5, 3, 4, 5]), (2, 6))
    a = jnp.broadcast_to(jnp.array([0.25, 0.5, 1.0, 1.0, 1.0, 1.0]), (2, 6))
    got = {}
    with jax.default_matmul_precision("highest"):
      for run in ("xla", setting):
        model = pf.Transformer(cfg, rngs=nnx.Rngs(0), run=RunControl(attention=run))
        got[run] = [model.argmax(x), model.argmax(x, (other, a))]
    for want, have in zip(got["xla"], got[setting]):
      np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_the_argmax_in_chunks_is_the_head_argmax(tied):
  """A TPU's wide steps (`argmax_in_chunks`): chunks of 128 columns (the last one starting
  earlier), ties across chunks to the first column, rows mixed with other rows (TiDAR's
  target): what `jnp.argmax` of the (mixed) logits gives."""
  kx, kw, ka = jax.random.split(jax.random.key(6), 3)
  x = jax.random.normal(kx, (2, 12, D))
  w = jax.random.normal(kw, (V, D)).at[jnp.array([7, 200, 299])].set(10 * x[0, 0])
  other = jnp.broadcast_to(jnp.arange(12)[::-1], (2, 12))
  a = jnp.where(jnp.arange(12) < 6, jax.random.uniform(ka, (2, 12)), 1.0)
  with jax.default_matmul_precision("highest"):
    out = logits(x, w.T)
    for mix, want in ((None, out), ((other, a), a[..., None] * out + (1 - a[..., None])
                                    * jnp.take_along_axis(out, other[..., None], 1))):
      got = greedy_head.argmax_in_chunks(x, w if tied else w.T, tied=tied, mix=mix, columns=128)
      assert got.dtype == jnp.int32
      np.testing.assert_array_equal(got, jnp.argmax(want, -1))
  # the tie (columns 7, 200, 299, in chunks 0, 1 and the last), unmixed: the first column
  assert greedy_head.argmax_in_chunks(x, w, tied=True, columns=128)[0, 0] == 7
