"""TiDAR training: the doubled sequence [clean | all-mask copy] and its two losses.

Input `[B, 2L]` = the L clean tokens (causal, positions 0..L-1, shifted next-token labels),
then L mask tokens at the same positions 0..L-1, cut into blocks of `block_size` positions.
A block of mask slots sees itself (bidirectionally) and the clean tokens strictly before its
first position (`masks.tidar_train`; passed structured: `mask_structure.tidar_train`); slot
i is labelled with the clean token x_i (unshifted). So the first slot of a block starting at
s predicts x_s from x_{<s}, the same target as the AR output at s-1: at decoding time the two
can be mixed (`TiDAR.beta`), and slots 2.. of a block are the drafts for the tokens after it.
Every diffusion-half input is the mask token (the paper's full-mask strategy), so both losses
average L terms and
loss = (alpha * L_AR + L_diff) / (1 + alpha).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from paraflax.model import mask_structure
from paraflax.training.objectives.head_loss import weighted_nll
from paraflax.training.objectives.means import Loss, Mean
from paraflax.training.objectives.protocol import register_objective


def doubled(tokens_BxL: jax.Array, mask_token_id: int):
  """(tokens [B, 2L], positions [B, 2L]) of the doubled sequence [clean | mask copy]."""
  b, l = tokens_BxL.shape
  pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  tokens = jnp.concatenate([tokens_BxL, jnp.full((b, l), mask_token_id, tokens_BxL.dtype)], 1)
  return tokens, jnp.concatenate([pos, pos], 1)


def block_sizes_for(rng: jax.Array, batch: int, block_size: int | Sequence[int]) -> jax.Array:
  """Per-row block sizes [B]: `block_size`, or a uniform draw from a list of sizes (one model
  that drafts well at several block sizes)."""
  sizes = jnp.atleast_1d(jnp.asarray(block_size, jnp.int32))
  return sizes[jax.random.randint(rng, (batch,), 0, sizes.shape[0])]


@register_objective("tidar")
def tidar_loss(model, batch, rng, block_size: int | Sequence[int] = 8, alpha: float = 1.0):
  """(alpha * L_AR + L_diff) / (1 + alpha) on packed rows `tokens [B, L]`.

  L_AR: next-token cross entropy of the clean half (L-1 targets). L_diff: cross entropy of
  every mask slot against the clean token at its position (L targets). `block_size`: an int,
  or a list of sizes drawn per row. With `loss_mask [B, L]` (JSONL records) only tokens i with
  loss_mask[:, i] = 1 are targets, in both halves.
  """
  mask_id = model.cfg.mask_token_id
  if mask_id is None:
    raise ValueError("the 'tidar' objective needs ModelConfig.mask_token_id (the <mask> id, 2 "
                     "for paraflax tokenizers)")
  tokens_BxL = batch["tokens"]
  b, l = tokens_BxL.shape
  tokens, positions = doubled(tokens_BxL, mask_id)
  largest = max(block_size) if isinstance(block_size, Sequence) else block_size
  mask = mask_structure.tidar_train(l, block_sizes_for(rng, b, block_size), max_block=largest)
  hidden_Bx2LxD, _ = model(tokens, positions, mask, hidden=True)
  # clean position i predicts x_{i+1} (the last one nothing), mask slot i predicts x_i
  if "loss_mask" in batch:  # each half's count depends on the mask: a head pass a half
    w_diff = batch["loss_mask"].astype(bool)  # [B, L]: slot i predicts x_i
    w_ar = w_diff[:, 1:]  # [B, L-1]: clean position i predicts x_{i+1}
    ar, nll_ar, hit_ar = weighted_nll(model, hidden_Bx2LxD[:, :l - 1], tokens_BxL[:, 1:], w_ar)
    diff, nll_diff, hit_diff = weighted_nll(model, hidden_Bx2LxD[:, l:], tokens_BxL, w_diff)
    loss = Loss.of((alpha / (1.0 + alpha), ar), (1.0 / (1.0 + alpha), diff))
  else:  # the counts, B (L-1) and B L, are the shape's: one weighted NLL a row, one head pass
    w_ar = w_diff = None
    targets = jnp.concatenate([tokens_BxL[:, 1:], tokens_BxL[:, :1], tokens_BxL], 1)
    i = jnp.arange(2 * l)
    coef = jnp.where(i < l - 1, alpha / ((1.0 + alpha) * max(l - 1, 1)),
                     jnp.where(i >= l, 1.0 / ((1.0 + alpha) * l), 0.0))
    both, nll, hit = weighted_nll(model, hidden_Bx2LxD, targets, jnp.broadcast_to(coef, (b, 2 * l)))
    nll_ar, hit_ar, nll_diff, hit_diff = nll[:, :l - 1], hit[:, :l - 1], nll[:, l:], hit[:, l:]
    loss = Loss.of(Mean(both.total, jnp.float32(b)))
  ar, ar_acc = Mean.of(nll_ar, w_ar), Mean.of(hit_ar, w_ar)
  diff, diff_acc = Mean.of(nll_diff, w_diff), Mean.of(hit_diff, w_diff)
  return loss, {"ar_loss": ar, "diff_loss": diff, "accuracy": ar_acc, "diff_accuracy": diff_acc}
