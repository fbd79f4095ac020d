"""The `Objective` protocol (a pure loss and what it reads) and its registry.

A loss is `loss(model, batch, rng, **args) -> (loss, metrics)`: it sees the model (merged
inside the jitted step), the batch dict of the run's data source and a per-step PRNG key
derived from (seed, step), and returns its loss as weighted means kept as sums
(`means.Loss`: sum_j coef_j * Mean_j) and a dict of `means.Mean` metrics, so that gradient
accumulation adds micro-batches up to the whole batch exactly (`run/accumulate.py`); a loss may
also return a plain scalar and scalar metrics (accumulated as means of one term: a mean of
micro-batch means). What callers get (`Objective.__call__`, `bind`, `get_objective`, the
function `register_objective` returns) is the finished `(scalar loss, {name: scalar})`,
`finalize`d; `bind(...).parts` is the raw output the training step accumulates. Each method
registers its own from its own file (`ar.py`, `tidar.py`, `asarm.py`, `jacobi_forcing.py`,
`deer.py`) with `register_objective`, declaring the batch `fields` it
reads and the data `source` it trains on; the trainer looks objectives up by
`TrainConfig.objective` and never branches on one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from paraflax.training.objectives.means import Mean, finalize

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class BoundLoss:
  """A loss with its arguments bound: calling it gives (scalar loss, scalar metrics);
  `parts(model, batch, rng)` gives the loss's own output (means, for accumulation)."""
  parts: Callable

  def __call__(self, model, batch, rng):
    return finalize(*self.parts(model, batch, rng))

STEP = "step"  # the batch field the trainer adds itself: the 0-based step, int32 [B]


@dataclasses.dataclass(frozen=True)
class Objective:
  """A registered objective. Calling it calls its loss.

  `fields`: the batch keys the loss reads; `"step"` (`STEP`) is added by the trainer, the
  others must be among the data source's `fields`. `source`: the registered data source it
  trains on (a config naming another one must give these fields too).
  """

  name: str
  loss: LossFn
  fields: tuple[str, ...] = ("tokens",)
  source: str = "stdlib"

  def __call__(self, model, batch, rng, **args):
    return finalize(*self.loss(model, batch, rng, **args))

  def bind(self, args: Any = ()) -> BoundLoss:
    """The loss with its keyword arguments bound: `loss_fn(model, batch, rng)`."""
    return BoundLoss(functools.partial(self.loss, **dict(args)))

  def check_args(self, args: Any) -> None:
    """Raise a one-line ValueError unless the loss takes these keyword arguments."""
    try:
      inspect.signature(self.loss).bind(None, None, None, **dict(args))
    except TypeError as e:
      raise ValueError(f"objective {self.name!r} does not take objective_args "
                       f"{dict(args)}: {e}") from None

  @property
  def needs_step(self) -> bool:
    return STEP in self.fields


OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str, *, fields: tuple[str, ...] = ("tokens",),
                       source: str = "stdlib",
                       replace: bool = False) -> Callable[[LossFn], LossFn]:
  """Decorator: make `fn` available as `TrainConfig(objective=name)`; returns `fn` finalized
  (its loss and metrics as scalars)."""
  def register(fn: LossFn) -> LossFn:
    if name in OBJECTIVES and not replace and OBJECTIVES[name].loss is not fn:
      raise ValueError(f"objective {name!r} is already registered; pass replace=True to override")
    OBJECTIVES[name] = Objective(name, fn, tuple(fields), source)

    @functools.wraps(fn)
    def finalized(*args, **kwargs):
      return finalize(*fn(*args, **kwargs))
    return finalized
  return register


def objective(name: str) -> Objective:
  """The registered objective `name` (a clear ValueError for an unknown one)."""
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}; registered: {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]


def get_objective(name: str, args: Any = ()) -> BoundLoss:
  """The registered objective's loss with its keyword arguments bound: `loss_fn(model, batch,
  rng)`."""
  return objective(name).bind(args)


def cross_entropy(logits_BxTxV, targets_BxT, weights_BxT=None):
  """Weighted mean token cross entropy and argmax accuracy (both float32 scalars)."""
  nll = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)  # [B, T]
  hit = (jnp.argmax(logits_BxTxV, -1) == targets_BxT).astype(jnp.float32)
  return Mean.of(nll, weights_BxT).value, Mean.of(hit, weights_BxT).value
