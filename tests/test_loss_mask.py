"""`loss_mask` in the AR, TiDAR and AS-ARM objectives: all ones is no mask (TiDAR's loss and
gradients within rounding: without a mask its head takes both halves in one pass); zeros drop
exactly those targets (references computed from the model's logits by hand)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paraflax.model import masks
from paraflax.model.transformer import Queries
from paraflax.training.objectives import asarm
from paraflax.training.objectives.ar import ar
from paraflax.training.objectives.tidar import block_sizes_for, doubled, tidar_loss
from conftest import micro_model
from test_head_loss import assert_grads_close

B, L = 2, 12
RNG = jax.random.key(3)


@pytest.fixture(scope="module")
def model():
  """One micro model for the three objectives: two-stream (AS-ARM), with a mask id (TiDAR)."""
  return micro_model(seed=0, two_stream=True, mask_token_id=2)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(0), (B, L), 3, 48, jnp.int32)


@pytest.fixture(scope="module")
def loss_mask():
  m = np.ones((B, L), np.int32)
  m[0, :5] = 0  # a prompt
  m[1, 3:7] = 0
  return jnp.asarray(m)


def _nll(logits_BxTxV, targets_BxT):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits_BxTxV, -1), targets_BxT[..., None],
                              -1)[..., 0]


def _mean(x, w):
  return float((x * w).sum() / w.sum())


def _both(fn, tokens, loss_mask):
  """(loss, metrics) without a mask, with all ones, and with `loss_mask`."""
  return [fn({"tokens": tokens}), fn({"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}),
          fn({"tokens": tokens, "loss_mask": loss_mask})]


def test_ar(model, tokens, loss_mask):
  plain, ones, masked = _both(lambda b: ar(model, b, RNG), tokens, loss_mask)
  assert plain[0] == ones[0] and plain[1]["accuracy"] == ones[1]["accuracy"]
  pos = jnp.broadcast_to(jnp.arange(L), (B, L))
  logits, _ = model(tokens, pos, masks.causal(jnp.full((B,), L), L))
  ref = _mean(_nll(logits[:, :-1], tokens[:, 1:]), loss_mask[:, 1:])
  np.testing.assert_allclose(float(masked[0]), ref, rtol=1e-5)


def test_tidar(model, tokens, loss_mask):
  fn_of = lambda m, b: tidar_loss(m, b, RNG, block_size=(3, 4), alpha=0.5)
  plain, ones, masked = _both(lambda b: fn_of(model, b), tokens, loss_mask)
  # no mask: one head pass over both halves; a mask: a pass a half. The same loss and gradient
  for k in plain[1]:
    np.testing.assert_allclose(plain[1][k], ones[1][k], rtol=1e-6, err_msg=k)
  graphdef, params = nnx.split(model)
  step = lambda b: jax.value_and_grad(lambda p: fn_of(nnx.merge(graphdef, p), b)[0])(params)
  (v0, g0), (v1, g1) = step({"tokens": tokens}), step({"tokens": tokens,
                                                       "loss_mask": jnp.ones_like(tokens)})
  np.testing.assert_allclose(v0, v1, rtol=1e-6)
  assert_grads_close(g0, g1)
  seq, pos = doubled(tokens, 2)
  logits, _ = model(seq, pos, masks.tidar_train(L, block_sizes_for(RNG, B, (3, 4))))
  ar_ref = _mean(_nll(logits[:, :L - 1], tokens[:, 1:]), loss_mask[:, 1:])
  diff_ref = _mean(_nll(logits[:, L:], tokens), loss_mask)
  np.testing.assert_allclose(float(masked[1]["ar_loss"]), ar_ref, rtol=1e-5)
  np.testing.assert_allclose(float(masked[1]["diff_loss"]), diff_ref, rtol=1e-5)
  np.testing.assert_allclose(float(masked[0]), (0.5 * ar_ref + diff_ref) / 1.5, rtol=1e-5)


def test_asarm(model, tokens, loss_mask):
  args = ((0.3, 0.7), (0.3, 0.7), 1)
  plain, ones, masked = _both(lambda b: asarm.asarm_loss(model, b, RNG, *args), tokens, loss_mask)
  assert plain[0] == ones[0] and plain[1]["accuracy"] == ones[1]["accuracy"]
  k_rate, k_pick = jax.random.split(RNG)
  visible = asarm.lattice_visible(k_pick, asarm.low_discrepancy_rates(k_rate, B, 0.3, 0.7), L)
  content, query = masks.lattice(visible)
  pos = jnp.broadcast_to(jnp.arange(L), (B, L))
  logits, _ = model(tokens, pos, content, queries=Queries(pos, query))
  ref = _mean(_nll(logits, tokens), ~visible & loss_mask.astype(bool))
  np.testing.assert_allclose(float(masked[0]), ref, rtol=1e-5)
