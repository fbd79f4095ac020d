"""AS-ARM training: the teacher-forced joint loss (Eq. 7) under the binary-lattice
decomposition (Eq. 4), on packed stdlib rows.

Each row of N tokens keeps a random subset of m positions as the prompt (visible; they see
each other bidirectionally) and makes the rest targets, generated in ascending position order
(`masks.lattice`). The two-stream model reads every target's content causally in that order,
and its query stream predicts each target from the prompt and the targets before it; the loss
is the query stream's cross entropy at the targets (mean over targets).

A row is attended sorted, prompt first and then the targets in order (the positions travel
with their tokens, so the loss is the same): a target's query then sees no key after its own
index, and reaches an attention kernel under its causal mask
(`mask_structure.lattice(sorted_rows=True)`).

The masking rate r = 1 - m/N is drawn per row with a low-discrepancy sampler (Sahoo et al.):
r_b = lo + (hi - lo) * ((u + b) / B mod 1) with one u ~ U(0, 1) per batch, so a batch covers
[lo, hi] evenly. [lo, hi] follows the curriculum of the paper's appendix: it starts at
`rate_start` and moves linearly to `rate_end` over `ramp_steps` steps (the official script:
15% -> [85%, 99%] over 5k steps). The step comes from `batch["step"]`, which the trainer adds
for objectives that declare the "step" field; without it the end of the ramp is used.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from paraflax.model import mask_structure
from paraflax.model.transformer import Queries
from paraflax.training.objectives.head_loss import weighted_nll
from paraflax.training.objectives.means import Loss, Mean
from paraflax.training.objectives.protocol import register_objective


def masking_range(step, rate_start: Sequence[float], rate_end: Sequence[float],
                  ramp_steps: int):
  """(lo, hi) masking rates at `step`: linear from `rate_start` to `rate_end`."""
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(ramp_steps, 1), 0.0, 1.0)
  lo = rate_start[0] + (rate_end[0] - rate_start[0]) * frac
  hi = rate_start[1] + (rate_end[1] - rate_start[1]) * frac
  return lo, hi


def low_discrepancy_rates(rng, batch: int, lo, hi) -> jax.Array:
  """[B] masking rates covering [lo, hi] evenly: lo + (hi - lo) * ((u + b) / B mod 1)."""
  u = jax.random.uniform(rng, ())
  return lo + (hi - lo) * jnp.mod(u + jnp.arange(batch) / batch, 1.0)


def lattice_visible(rng, rates_B: jax.Array, n: int) -> jax.Array:
  """[B, N] prompt positions: a uniformly random subset of round((1 - r) * N) positions per
  row, at least one and at most N - 1 (a row always has a target and a prompt token)."""
  b = rates_B.shape[0]
  m = jnp.clip(jnp.round((1.0 - rates_B) * n), 1, n - 1).astype(jnp.int32)
  ranks = jnp.argsort(jnp.argsort(jax.random.uniform(rng, (b, n)), 1), 1)
  return ranks < m[:, None]


@register_objective("asarm", fields=("tokens", "step"))
def asarm_loss(model, batch, rng, rate_start: Sequence[float] = (0.15, 0.15),
               rate_end: Sequence[float] = (0.85, 0.99), ramp_steps: int = 5000):
  """Query-stream cross entropy at the target positions of lattice-decomposed rows; with
  `loss_mask [B, N]` (JSONL records) only targets with loss_mask 1 count (the others are still
  generated in order, as context for later ones)."""
  if not model.cfg.two_stream:
    raise ValueError("the 'asarm' objective needs a two-stream model "
                     "(ModelConfig.two_stream=True)")
  tokens = batch["tokens"]
  b, n = tokens.shape
  step = batch["step"][0] if "step" in batch else ramp_steps
  lo, hi = masking_range(step, rate_start, rate_end, ramp_steps)
  k_rate, k_pick = jax.random.split(rng)
  rates = low_discrepancy_rates(k_rate, b, lo, hi)
  visible = lattice_visible(k_pick, rates, n)
  counts = ~visible
  if "loss_mask" in batch:
    counts &= batch["loss_mask"].astype(bool)
  # each row sorted prompt first, then its targets in order (positions travel with their
  # tokens): the same loss, and a target's query sees no key after its own index
  order = jnp.argsort(~visible, axis=1, stable=True)  # [B, N]
  take = lambda x: jnp.take_along_axis(x, order, 1)
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  tokens, pos, visible, counts = take(tokens), take(pos), take(visible), take(counts)
  content, query = mask_structure.lattice(visible, sorted_rows=True)
  hidden_BxNxD, _ = model(tokens, pos, content, queries=Queries(pos, query), hidden=True)
  nll_mean, _, hit = weighted_nll(model, hidden_BxNxD, tokens, counts)
  return Loss.of(nll_mean), {"accuracy": Mean.of(hit, counts), "masking_rate": Mean.of(rates)}
