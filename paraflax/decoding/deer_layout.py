"""DEER's drafting block, defined once for the decoder (`decoding/deer.py`) and the Stage I/II
objectives (`training/objectives/deer.py`).

A prefix x_0..x_{c-1} sits at positions 0..c-1, causal among itself; then a block
[SEP, y_1, ..., y_k]: SEP at position c, y_i at position c+i (block offset i). The block sees
the whole prefix and itself bidirectionally (`masks.tidar`: kinds CLEAN for the prefix,
MASKED for the block). The logits at y_i predict x_{c+i-1}, the i-th token after the prefix;
SEP's logits are not used. The prefix is causal among itself, so a decoder caches it, unless
the drafter's `ModelConfig.drafter_prefix` is "bidirectional": then each prefix token sees the
whole prefix, its encoding changes with every token appended, and every draft re-encodes it.

    prefix                 block
    x_0 .. x_{c-1}   |   SEP   y_1      y_2      ..  y_k
    pos 0 .. c-1     |   c     c+1      c+2      ..  c+k
                     |         ->x_c    ->x_{c+1}    ->x_{c+k-1}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paraflax.model import masks


def block_tokens(offsets: jax.Array, sep_id: int, fill) -> jax.Array:
  """The drafter's inputs at block `offsets` (any shape): SEP at offset 0, `fill` elsewhere
  (<mask> at drafting; a token or <mask> in training rows, where offsets < 0 are the prefix)."""
  return jnp.where(offsets == 0, sep_id, fill).astype(jnp.int32)


def block_positions(prefix: jax.Array, offsets: jax.Array) -> jax.Array:
  """Positions `prefix[..., None] + offsets`: block offset i after c prefix tokens sits at c+i."""
  return prefix[..., None] + offsets


def mask(kinds_BxT, blocks_BxT, valid_BxT, bidirectional: bool) -> jax.Array:
  """The drafter's attention `[B, T, T]`: `masks.tidar`, and with `bidirectional` (a drafter
  whose `drafter_prefix` is "bidirectional") every valid clean token also sees the later ones:
  the caller marks clean only the prefix a block conditions on."""
  see = masks.tidar(kinds_BxT, blocks_BxT, valid_BxT)
  if not bidirectional:
    return see
  clean = kinds_BxT == masks.CLEAN
  return see | (clean[:, :, None] & (clean & valid_BxT)[:, None, :])


def draft_inputs(context_BxU, context_pos_BxU, context_valid_BxU, prefix_B, k: int,
                 mask_id: int, sep_id: int, cache_lengths_B=None, slots: int = 0):
  """One drafting forward: U context tokens (padding where not valid), then the block [SEP,
  <mask> x k] at positions c..c+k (c = `prefix`, the context length). With a cache (a causal
  prefix) the context is the tokens the cache lacks and the mask is `[B, T, S+T]`; without
  (`cache_lengths=None`, a bidirectional prefix) it is the whole context, seen in both
  directions, and the mask `[B, T, T]`. Returns (tokens [B, T], positions [B, T], mask) with
  T = U + k + 1; the block's logits are the last k + 1 rows."""
  b, u = context_BxU.shape
  offsets = jnp.arange(k + 1, dtype=jnp.int32)
  block = jnp.broadcast_to(block_tokens(offsets, sep_id, mask_id), (b, k + 1))
  tokens = jnp.concatenate([context_BxU, block], 1)
  positions = jnp.concatenate([context_pos_BxU, block_positions(prefix_B, offsets)], 1)
  kinds = jnp.array([masks.CLEAN] * u + [masks.MASKED] * (k + 1))
  blocks = jnp.array([0] * u + [1] * (k + 1))
  valid = jnp.concatenate([context_valid_BxU, jnp.ones((b, k + 1), bool)], 1)
  chunk = mask(jnp.broadcast_to(kinds, (b, kinds.size)), jnp.broadcast_to(blocks, (b, blocks.size)),
               valid, bidirectional=cache_lengths_B is None)
  if cache_lengths_B is None:
    return tokens, positions, chunk
  return tokens, positions, masks.over_cache(cache_lengths_B, slots, chunk)
