"""AS-ARM training: the masking-rate curriculum and low-discrepancy rates, the prompt subset,
and the lattice loss (no target can see its own token: i.i.d. noise stays unlearnable while a
deterministic pattern is learnt)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from paraflax.model import masks
from paraflax.model.transformer import Queries
from paraflax.training.objectives import asarm
from paraflax.training.objectives.head_loss import token_nll
from conftest import micro_model


@pytest.mark.fast
def test_curriculum_and_low_discrepancy_rates():
  lo, hi = asarm.masking_range(0, (0.15, 0.15), (0.85, 0.99), 100)
  assert (float(lo), float(hi)) == pytest.approx((0.15, 0.15))
  lo, hi = asarm.masking_range(50, (0.15, 0.15), (0.85, 0.99), 100)
  assert (float(lo), float(hi)) == pytest.approx((0.5, 0.57))
  lo, hi = asarm.masking_range(10_000, (0.15, 0.15), (0.85, 0.99), 100)
  assert (float(lo), float(hi)) == pytest.approx((0.85, 0.99))
  rates = np.sort(np.asarray(asarm.low_discrepancy_rates(jax.random.key(0), 8, 0.2, 0.6)))
  assert rates.min() >= 0.2 and rates.max() < 0.6
  np.testing.assert_allclose(np.diff(rates), 0.05, atol=1e-6)  # one per stratum


@pytest.mark.fast
def test_prompt_subsets_have_the_drawn_sizes():
  rates = jnp.array([0.0, 0.25, 0.5, 0.99, 1.0])
  visible = np.asarray(asarm.lattice_visible(jax.random.key(1), rates, 8))
  assert visible.sum(1).tolist() == [7, 6, 4, 1, 1]  # at least one target and one prompt token


def _train(model, data_fn, steps=150, lr=3e-3):
  graphdef, params = nnx.split(model)
  tx = optax.adam(lr)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, batch, rng):
    def loss_fn(p):
      return asarm.asarm_loss(nnx.merge(graphdef, p), batch, rng, (0.3, 0.9), (0.3, 0.9), 1)[0]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  losses = []
  for i in range(steps):
    params, opt, loss = step(params, opt, {"tokens": data_fn(i)}, jax.random.key(i))
    losses.append(float(loss))
  return np.mean(losses[-20:])


@pytest.mark.slow
def test_lattice_loss_learns_patterns_but_cannot_read_its_own_token():
  v, n, b = 16, 16, 32
  noise = lambda i: jax.random.randint(jax.random.key(100 + i), (b, n), 0, v)
  ramp = lambda i: (jax.random.randint(jax.random.key(i), (b, 1), 0, v) + jnp.arange(n)) % v
  model = micro_model(seed=0, vocab_size=v, two_stream=True)
  assert _train(model, noise) > 0.9 * np.log(v)  # a leak of the own token would reach ~0
  model = micro_model(seed=0, vocab_size=v, two_stream=True)
  assert _train(model, ramp) < 0.3 * np.log(v)  # one visible token determines the row


@pytest.mark.fast
def test_needs_a_two_stream_model(model):
  with pytest.raises(ValueError, match="two-stream"):
    asarm.asarm_loss(model, {"tokens": jnp.zeros((2, 8), jnp.int32)}, jax.random.key(0))


def test_sorted_rows_give_the_loss_and_gradients_of_the_natural_order():
  """The objective attends each row sorted prompt first (structured masks, the query stream
  `subcausal`); the same draws in the natural order with `masks.lattice`'s dense masks give
  the same loss and gradients (float32)."""
  model = micro_model(seed=3, vocab_size=32, two_stream=True)
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(5), (3, 12), 0, 32)
  rng, args = jax.random.key(7), ((0.4, 0.4), (0.6, 0.8), 10)

  def natural(p):  # asarm_loss's draws, unsorted
    m = nnx.merge(graphdef, p)
    lo, hi = asarm.masking_range(args[2], *args)
    k_rate, k_pick = jax.random.split(rng)
    visible = asarm.lattice_visible(k_pick, asarm.low_discrepancy_rates(k_rate, 3, lo, hi), 12)
    content, query = masks.lattice(visible)
    pos = jnp.broadcast_to(jnp.arange(12), (3, 12))
    hidden, _ = m(tokens, pos, content, queries=Queries(pos, query), hidden=True)
    nll, _ = token_nll(m, hidden, tokens)
    w = (~visible).astype(jnp.float32)
    return (nll * w).sum() / w.sum()

  def sorted_(p):
    loss = asarm.asarm_loss(nnx.merge(graphdef, p), {"tokens": tokens}, rng, *args)[0]
    return jnp.asarray(loss)

  want = jax.jit(jax.value_and_grad(natural))(params)
  got = jax.jit(jax.value_and_grad(sorted_))(params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
