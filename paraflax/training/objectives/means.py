"""Losses and metrics as weighted means kept as (sum, weight) pairs, so that micro-batches add
up to their batch exactly: a mean of micro-batch means is not the batch's mean when they hold
different numbers of targets (what `optax.MultiSteps` would average).

    loss = Loss.of((alpha, Mean.of(nll_ar)), (1.0, Mean.of(nll_diff, weights)))
    loss.value  # sum_j coef_j * total_j / max(count_j, 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Mean:
  """A weighted mean as its parts: value = total / max(count, 1)."""
  total: jax.Array  # [] float32: sum of weight x value
  count: jax.Array  # [] float32: sum of weights

  @classmethod
  def of(cls, values, weights=None) -> Mean:
    """The weighted mean of `values` (all weights 1 when None)."""
    w = jnp.ones_like(values) if weights is None else weights.astype(jnp.float32)
    return cls((values * w).sum(), w.sum())

  @property
  def value(self) -> jax.Array:
    return self.total / jnp.maximum(self.count, 1.0)


@struct.dataclass
class Loss:
  """A loss `sum_j coefs[j] * means[j].value`; the coefficients are constants of the
  objective's arguments, never of the batch."""
  means: tuple[Mean, ...]
  coefs: tuple  # floats, one per mean

  @classmethod
  def of(cls, *terms) -> Loss:
    """From terms that are a `Mean` (coefficient 1) or a (coefficient, Mean) pair."""
    pairs = [(1.0, t) if isinstance(t, Mean) else t for t in terms]
    return cls(tuple(m for _, m in pairs), tuple(c for c, _ in pairs))

  @property
  def value(self) -> jax.Array:
    return self.over([m.count for m in self.means])

  def over(self, counts) -> jax.Array:
    """The loss with each mean's total divided by `counts[j]` (a whole batch's) instead."""
    return sum(c * m.total / jnp.maximum(n, 1.0) for c, m, n in zip(self.coefs, self.means, counts))


def as_means(loss, metrics) -> tuple[Loss, dict[str, Mean]]:
  """An objective's output with plain scalars (a loss that is not written as means) taken as
  means of one term each."""
  one = lambda x: x if isinstance(x, Mean) else Mean(jnp.asarray(x, jnp.float32), jnp.float32(1))
  loss = loss if isinstance(loss, Loss) else Loss.of(one(loss))
  return loss, {k: one(v) for k, v in metrics.items()}


def finalize(loss, metrics) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(scalar loss, scalar metrics) of an objective's output, whichever way it is written."""
  value = lambda x: x.value if isinstance(x, (Mean, Loss)) else x
  return value(loss), {k: value(v) for k, v in metrics.items()}
