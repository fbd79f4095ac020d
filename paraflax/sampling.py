"""Samplers: frozen pytree dataclasses whose parameters are traced (no retrace per value).

Each sampler warps logits (temperature, top-k, top-p) and samples from exactly that warped
distribution; `probs` returns the same distribution, which speculative verification uses for
both the target p and the draft q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

_NEG_INF = -jnp.inf


@struct.dataclass
class Greedy:
  """Argmax decoding."""
  greedy = True  # class constant, not a field: decoders branch on it statically

  def validate(self):
    pass

  def warp(self, logits):
    return jnp.where(logits == jnp.max(logits, -1, keepdims=True), 0.0, _NEG_INF)

  def probs(self, logits):
    return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)

  def sample(self, rng, logits):
    del rng
    return jnp.argmax(logits, -1).astype(jnp.int32)

  def draft(self, rng, logits):
    """(draft tokens, their proposal q): greedy drafts need no q (verification is greedy)."""
    return self.sample(rng, logits), None


class _Stochastic:
  """Shared validation/probs/sample for the temperature-based samplers."""
  greedy = False

  def validate(self):
    if not float(self.temperature) > 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature} (use Greedy() for argmax)")

  def probs(self, logits):
    return jax.nn.softmax(self.warp(logits), -1)

  def sample(self, rng, logits):
    return jax.random.categorical(rng, self.warp(logits), -1).astype(jnp.int32)

  def draft(self, rng, logits):
    """(draft tokens sampled from the warped logits, that distribution q for verification)."""
    return self.sample(rng, logits), self.probs(logits)


@struct.dataclass
class Temperature(_Stochastic):
  """Sample from softmax(logits / temperature)."""
  temperature: float = 1.0

  def warp(self, logits):
    return logits.astype(jnp.float32) / self.temperature


@struct.dataclass
class TopK(_Stochastic):
  """Keep the k largest logits (ties at the k-th value kept), with temperature."""
  k: int = 40
  temperature: float = 1.0

  def validate(self):
    super().validate()
    if int(self.k) < 1:
      raise ValueError(f"top-k needs k >= 1, got {self.k}")

  def warp(self, logits):
    logits = logits.astype(jnp.float32) / self.temperature
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.clip(jnp.asarray(self.k, jnp.int32), 1, logits.shape[-1])
    kth = jnp.take(sorted_desc, k - 1, axis=-1)[..., None]
    return jnp.where(logits >= kth, logits, _NEG_INF)


@struct.dataclass
class TopP(_Stochastic):
  """Nucleus sampling: the smallest set of top tokens whose probability reaches p."""
  p: float = 0.9
  temperature: float = 1.0

  def validate(self):
    super().validate()
    if not 0.0 < float(self.p) <= 1.0:
      raise ValueError(f"top-p needs 0 < p <= 1, got {self.p}")

  def warp(self, logits):
    logits = logits.astype(jnp.float32) / self.temperature
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, -1)
    mass_before = jnp.cumsum(probs, -1) - probs  # mass of strictly larger tokens
    n_keep = jnp.sum(mass_before < self.p, -1, keepdims=True)  # >= 1
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, -1)
    return jnp.where(logits >= threshold, logits, _NEG_INF)
