"""The acceptance core every speculative method shares (batched, per-row results).

Given k drafts and target logits at the k+1 positions that score them (position i scores
draft i; position k gives the bonus token), return how many drafts each row accepts and the
token that follows them (the target's correction or bonus):

  greedy:      accept while draft_i == argmax p_i; next = argmax p_n.
  stochastic:  accept draft_i with probability min(1, p_i(d)/q_i(d)); at the first rejection
               n, next ~ norm(max(0, p_n - q_n)); if all k are accepted, next ~ p_k.

p and q are the sampler-warped distributions, and drafts must be sampled from exactly q (a
deterministic proposal is the point mass q = one_hot(draft)). The output sequence is then
distributed exactly as sampling from p token by token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _leading_true(x_BxK: jax.Array) -> jax.Array:
  """Number of leading True entries per row: [B]."""
  return jnp.sum(jnp.cumprod(x_BxK.astype(jnp.int32), axis=-1), axis=-1)


def greedy(draft_BxK: jax.Array, target_logits_BxKp1xV: jax.Array):
  """Greedy verification. Returns (n_accepted [B] in 0..k, next_token [B])."""
  return greedy_tokens(draft_BxK, jnp.argmax(target_logits_BxKp1xV, -1).astype(jnp.int32))


def greedy_tokens(draft_BxK: jax.Array, target_BxKp1: jax.Array):
  """Greedy verification against the target's argmax tokens `[B, K+1]` (a head that writes
  no logits: `Forward.argmax`). Returns (n_accepted [B], next_token [B])."""
  k = draft_BxK.shape[1]
  n = _leading_true(draft_BxK == target_BxKp1[:, :k])
  return n, jnp.take_along_axis(target_BxKp1, n[:, None], 1)[:, 0]


def acceptance_probs(p_draft: jax.Array, q_draft: jax.Array, epsilon=0.0) -> jax.Array:
  """min(1, p(d)/q(d) + epsilon) for drafts d sampled from q (q(d) > 0). epsilon > 0 is
  ASSD's tolerance (more accepted drafts, no longer exact); 0 is exact."""
  return jnp.minimum(1.0, p_draft / jnp.maximum(q_draft, jnp.finfo(jnp.float32).tiny) + epsilon)


def residual_probs(p_BxV: jax.Array, q_BxV: jax.Array) -> jax.Array:
  """norm(max(0, p - q)); falls back to p where the residual has no mass (then p == q and a
  rejection has probability zero, so the fallback only guards against rounding)."""
  r = jnp.maximum(p_BxV - q_BxV, 0.0)
  total = jnp.sum(r, -1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_BxV)


def stochastic(rng, draft_BxK, q_BxKxV, p_BxKp1xV, epsilon=0.0):
  """Exact speculative sampling (epsilon = 0). q and p are probabilities. Returns
  (n_accepted, next_token)."""
  b, k = draft_BxK.shape
  rng_accept, rng_next = jax.random.split(rng)
  p_d = jnp.take_along_axis(p_BxKp1xV[:, :k], draft_BxK[..., None], -1)[..., 0]  # [B, K]
  q_d = jnp.take_along_axis(q_BxKxV, draft_BxK[..., None], -1)[..., 0]
  u = jax.random.uniform(rng_accept, (b, k))
  n = _leading_true(u < acceptance_probs(p_d, q_d, epsilon))
  rows = jnp.arange(b)
  p_n = p_BxKp1xV[rows, n]  # [B, V]
  q_n = q_BxKxV[rows, jnp.minimum(n, k - 1)]
  dist = jnp.where((n < k)[:, None], residual_probs(p_n, q_n), p_n)
  next_token = jax.random.categorical(rng_next, jnp.log(dist), -1).astype(jnp.int32)
  return n, next_token


def verify(rng, sampler, draft_BxK, q_BxKxV, target_logits_BxKp1xV, epsilon=0.0):
  """Dispatch on the sampler: greedy comparison, or exact stochastic acceptance with the
  sampler-warped target (`epsilon`: acceptance tolerance, 0 = exact). `q` may be None for
  greedy samplers."""
  if sampler.greedy:
    return greedy(draft_BxK, target_logits_BxKp1xV)
  return stochastic(rng, draft_BxK, q_BxKxV, sampler.probs(target_logits_BxKp1xV), epsilon)


def point_mass(draft_BxK: jax.Array, vocab_size: int) -> jax.Array:
  """q for a deterministic proposal (prompt lookup, n-gram pools): one_hot(draft)."""
  return jax.nn.one_hot(draft_BxK, vocab_size, dtype=jnp.float32)
