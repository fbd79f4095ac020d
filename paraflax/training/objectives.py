"""Training objectives: pure `loss_fn(model, batch, rng, **args) -> (loss, metrics)`.

An objective sees the model (merged inside the jitted step), the batch dict from the data
pipeline (`{"tokens": int32 [B, L]}` for packed text) and a per-step PRNG key derived from
(seed, step). It returns a scalar float32 loss and a dict of scalar metrics. New methods
(Jacobi Forcing, TiDAR, AS-ARM, DEER) add a function here with `register_objective`; the
trainer looks objectives up by `TrainConfig.objective` and never changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from paraflax import masks

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
OBJECTIVES: dict[str, LossFn] = {}


def register_objective(name: str, *, replace: bool = False) -> Callable[[LossFn], LossFn]:
  """Decorator: make `fn` available as `TrainConfig(objective=name)`."""
  def register(fn: LossFn) -> LossFn:
    if name in OBJECTIVES and not replace and OBJECTIVES[name] is not fn:
      raise ValueError(f"objective {name!r} is already registered; pass replace=True to override")
    OBJECTIVES[name] = fn
    return fn
  return register


def get_objective(name: str, args: Any = ()) -> LossFn:
  """The registered objective with its keyword arguments bound: `loss_fn(model, batch, rng)`."""
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}; registered: {sorted(OBJECTIVES)}")
  return functools.partial(OBJECTIVES[name], **dict(args))


def cross_entropy(logits_BxTxV, targets_BxT, weights_BxT=None):
  """Weighted mean token cross entropy and argmax accuracy (both float32 scalars)."""
  nll = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)  # [B, T]
  hit = (jnp.argmax(logits_BxTxV, -1) == targets_BxT).astype(jnp.float32)
  w = jnp.ones_like(nll) if weights_BxT is None else weights_BxT.astype(jnp.float32)
  denom = jnp.maximum(w.sum(), 1.0)
  return (nll * w).sum() / denom, (hit * w).sum() / denom


@register_objective("ar")
def ar(model, batch, rng):
  """Next-token cross entropy on rows `tokens [B, L]`: positions 0..L-1, causal mask.

  Packed text rows are full (packing leaves no padding), so all L-1 next-token targets count.
  Optional keys (DEER teacher rows, for the small-AR-drafter baseline): `lengths [B]`, tokens
  from there on are right padding (no key and no target); `prompt_lens [B]`, only tokens from
  there on (the answer) are targets, the supervision the DEER drafter gets.
  """
  del rng  # deterministic objective
  tokens_BxL = batch["tokens"]
  b, l = tokens_BxL.shape
  lengths_B = batch.get("lengths", jnp.full((b,), l, jnp.int32))
  positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  mask_BxLxL = masks.causal(lengths_B, l)
  logits_BxLxV, _ = model(tokens_BxL, positions_BxL, mask_BxLxL)
  weights = None
  if "lengths" in batch or "prompt_lens" in batch:
    target = jnp.arange(1, l)[None, :]  # the index of the token each position predicts
    weights = target < lengths_B[:, None]
    if "prompt_lens" in batch:
      weights &= target >= batch["prompt_lens"][:, None]
  loss, acc = cross_entropy(logits_BxLxV[:, :-1], tokens_BxL[:, 1:], weights)
  return loss, {"accuracy": acc}
