"""The AR objective "ar": next-token cross entropy, on packed stdlib rows or teacher rows."""

from __future__ import annotations

import jax.numpy as jnp

from paraflax.model import mask_structure
from paraflax.training.objectives.head_loss import weighted_nll
from paraflax.training.objectives.means import Loss, Mean
from paraflax.training.objectives.protocol import register_objective


@register_objective("ar")
def ar(model, batch, rng):
  """Next-token cross entropy on rows `tokens [B, L]`: positions 0..L-1, causal mask.

  Packed text rows are full (packing leaves no padding), so all L-1 next-token targets count.
  Optional keys (DEER teacher rows, for the small-AR-drafter baseline): `lengths [B]`, tokens
  from there on are right padding (no key and no target); `prompt_lens [B]`, only tokens from
  there on (the answer) are targets, the supervision the DEER drafter gets; `loss_mask
  [B, L]` (JSONL records), only tokens i with loss_mask[:, i] = 1 are targets.
  """
  del rng  # deterministic objective
  tokens_BxL = batch["tokens"]
  b, l = tokens_BxL.shape
  lengths_B = batch.get("lengths", jnp.full((b,), l, jnp.int32))
  positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  # rows without padding: the kernels' own causal mask (it skips the blocks above the diagonal)
  mask_BxLxL = (mask_structure.causal(lengths_B, l) if "lengths" in batch
                else mask_structure.full_causal(b, l))
  hidden_BxLxD, _ = model(tokens_BxL, positions_BxL, mask_BxLxL, hidden=True)
  weights = None
  if "lengths" in batch or "prompt_lens" in batch:
    target = jnp.arange(1, l)[None, :]  # the index of the token each position predicts
    weights = target < lengths_B[:, None]
    if "prompt_lens" in batch:
      weights &= target >= batch["prompt_lens"][:, None]
  if "loss_mask" in batch:
    counts = batch["loss_mask"][:, 1:].astype(bool)  # [B, L-1]: the targets that count
    weights = counts if weights is None else weights & counts
  nll_mean, _, hit = weighted_nll(model, hidden_BxLxD[:, :-1], tokens_BxL[:, 1:], weights)
  return Loss.of(nll_mean), {"accuracy": Mean.of(hit, weights)}
