"""Gradient accumulation equal to one batch k times larger (`TrainConfig.grad_accum`).

The batch is split into k micro-batches (row i goes to micro-batch i mod k, so a batch split
over data-parallel devices keeps every micro-batch spread over all of them), each with its own
key `jax.random.split(rng, k)[i]`. An objective's loss is sum_j coef_j * total_j / count_j
(`means.Loss`), so:
  1. every micro-batch's counts come first: they depend on the batch and the key only, and the
     forward pass they are traced with has no output used, which XLA removes;
  2. a `lax.scan` over the micro-batches sums the gradients (and values) of
     sum_j coef_j * total_j / N_j, N_j the whole batch's count, and the metrics' totals;
  3. loss and metrics are the whole batch's.
Equality is exact (to rounding) for deterministic objectives ("ar", "jacobi_forcing"); the
ones that draw from the key (TiDAR block sizes, AS-ARM subsets, DEER cuts) draw per
micro-batch, equal in distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paraflax.training.objectives.means import as_means
from paraflax.training.run import layout


def split(batch: dict, k: int) -> dict:
  """`{name: [B, ...]}` -> `{name: [k, B/k, ...]}`; micro-batch i holds rows i, i + k, ..."""
  def cut(x):
    if x.shape[0] % k:
      raise ValueError(f"a batch of {x.shape[0]} rows does not split into {k} micro-batches")
    return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
  return {name: cut(x) for name, x in batch.items()}


def accumulated(parts, graphdef, params, batch, rng, k: int):
  """(loss, metrics, grads) of `batch` from `k` micro-batches. `parts(model, batch, rng)` is
  an objective's own output (`objectives.BoundLoss.parts`, or any loss: `means.as_means`)."""
  xs = (split(batch, k), jax.random.split(rng, k))

  def means(p, micro):
    return as_means(*parts(layout.model_of(graphdef, p), *micro))

  def counts(micro):
    loss, metrics = means(params, micro)
    return [m.count for m in loss.means], {name: m.count for name, m in metrics.items()}
  n_loss, n_metrics = jax.tree.map(lambda c: c.sum(0), jax.lax.map(counts, xs))

  def one(micro):
    def value(p):
      loss, metrics = means(p, micro)
      return loss.over(n_loss), {name: m.total for name, m in metrics.items()}
    return jax.value_and_grad(value, has_aux=True)(params)

  def body(acc, micro):
    return jax.tree.map(jnp.add, acc, one(micro)), None
  first = jax.tree.map(lambda x: x[0], xs)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, first))
  ((loss, totals), grads), _ = jax.lax.scan(body, zeros, xs)
  metrics = {name: t / jnp.maximum(n_metrics[name], 1.0) for name, t in totals.items()}
  return loss, metrics, grads
