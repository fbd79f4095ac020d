"""`JacobiMR(variant="released")`'s rules (its `init` and `step` are `jacobi_mr.released_init`
and `released_step`): Jacobi Forcing's MR loop as the released code runs it
(hao-ai-lab/JacobiForcing, `jacobi_forward_greedy_multiblock` of
`cllm2_qwen2_modeling_kv_terminate_on_eos_improved_multiblock_lookahead_unified.py` and its
driver `jacobi_forcing_inference_MR_humaneval.py`), in fixed shapes inside the one compiled
loop. Greedy and exact.

Blocks are `Jacobi(variant="released")`'s (`released_blocks.py`): the prefill reads the prompt
and n tokens drawn at random from it (the call's rng), its argmaxes are block 1's draft and it
counts as no iteration; a block has a fixed n tokens, a step accepts nothing past its end, and
the decided token after a finished block starts the next one with n-1 tokens drawn from the
prompt and the output so far. On top of that, per row:

* Pool (`recycle`): a `deque(maxlen=P)` made anew for every block (released P = 4). After a
  step in which the block rejected a draft, two entries go in: the block so far (its accepted
  tokens, the next token, the new argmaxes: n tokens, `block_entries`), then the new argmaxes
  alone (when there are any).
* Lookup (`recycling.lookup(..., "released")`): every entry but the newest, newest first;
  an entry holding the pending token gives the candidate from the token's *first* occurrence,
  padded with the main draft's own tokens. A copy of the main draft counts, and the
  candidates are used only when more than one entry matched; then they ride in the same
  forward as extra blocks (P - 1 candidate slots, `masks.decode_candidates`), and the first
  block with the most accepted drafts wins (the main draft on ties; `jacobi_mr.verify_ra`).
* K = 2 (`pseudo_block`, released r = 0.85): once the block's accepted tokens reach
  ceil(r*n), the released loop spawns a pseudo block (the block's remaining draft padded with
  the pad token) after it in the forward. When the real block finishes, the released call
  returns after it: the pseudo block's work is thrown away and the next block starts from
  context draws as above. A pseudo block sits after the real one in a causal forward, so it
  changes no argmax of the real block, and its tokens reach the pool only past the n tokens of
  the block entry, where no candidate reads them as long as n - ceil(r*n) <= 2 (n = 16 at r =
  0.85: 2; the next step uses candidates built before the spawn, and any later one holds the
  pending token alone, the block having at most 1 token left). So K = 2 commits K = 1's
  tokens; it costs a wider forward (n slots more, holding the pending token repeated: in fixed
  shapes a forward costs the same whatever they hold) and one forward more for every block
  whose finishing step is also the one that reaches ceil(r*n): the released loop then spawns
  an all-pad block and runs it alone once before returning. That forward cannot change a token
  and is counted (`forwards`), not run.

Not reproduced: the released pool drops the tokenizer's pad token from its block entries (the
decoder has no pad id; it matters only if the model emits that token inside a block); at
n - ceil(r*n) > 2 its entries carry the pseudo block's tokens after the block's; an all-pad
block that gets ceil(r*n) tokens accepted on its own (the model predicting the pad token
ceil(r*n) - 1 times in a row) keeps the released call going as real multi-block decoding.
Stopping is AR's: at EOS (in the accepted drafts or as the next token, as the released loop)
and exactly at `max_new_tokens` (the released driver checks it between blocks only).
"""

from __future__ import annotations

import jax.numpy as jnp

from paraflax.decoding import recycling


def check_released(n, k: int, p: int, c, rule: str) -> None:
  """The settings the released loop takes (one clear error each): K = 1 or 2, a pool of
  >= 2 entries, the candidates its rule fixes, its own pool rule, n >= 2."""
  name = 'JacobiMR(variant="released")'
  if k not in (1, 2):
    raise ValueError(f"{name} runs the released loop's K = 1 or 2, got num_blocks={k}")
  if p < 2:
    raise ValueError(f"{name} needs pool_size >= 2 (the released pool is 4; without candidates "
                     f'it is Jacobi(variant="released")), got {p}')
  if c not in (0, p - 1):
    raise ValueError(f"{name} verifies every pool entry but the newest (pool_size - 1 = {p - 1}"
                     f" candidates): leave num_candidates at 0, got {c!r}")
  if rule != "stream":
    raise ValueError(f'{name} has its own pool rule: recycling={rule!r} applies to '
                     'variant="window"')
  if n < 2:
    raise ValueError(f"{name} needs block_size >= 2, got {n}")


def block_entries(tokens_BxN, lengths_B, guesses_BxG, left_B, n: int):
  """The two pool entries after a step that left a block unfinished, each [B, n], -1 past
  its end: the block so far (its accepted tokens, the pending token (the next one), the
  `left` new guesses: n tokens), then the new guesses alone."""
  a = (n - 1 - left_B)[:, None]  # the block's tokens before the pending one
  block = recycling.emitted_then(tokens_BxN, lengths_B, a, guesses_BxG, n)
  tail = jnp.where(jnp.arange(n) < left_B[:, None], jnp.pad(guesses_BxG, ((0, 0), (0, 1))), -1)
  return block, tail


def recycle(pool_BxPxE, ptr_B, block_BxN, tail_BxN, left_B, rejected_B, full_B):
  """The released pool after a step: where the block rejected a draft, `block` then `tail`
  (only when the block has guesses left) enter it like a `deque(maxlen=P)`; where the block
  finished, a fresh empty pool for the next one."""
  pool, ptr = recycling.insert(pool_BxPxE, ptr_B, block_BxN, rejected_B)
  pool, ptr = recycling.insert(pool, ptr, tail_BxN, rejected_B & (left_B > 0))
  return jnp.where(full_B[:, None, None], -1, pool), jnp.where(full_B, 0, ptr)


def pseudo_block(blocks_B, left_B, full_B, n: int, k: int, s: int):
  """K = 2's pseudo block after a step: (in flight [B] (0 or 1), lone [B]: the step spawned an
  all-pad block as it finished the real one, which the released loop runs alone once).
  The released loop spawns one per block once its accepted tokens (the pending one not
  included: n at the block's end) reach s = ceil(r*n)."""
  if k == 1:
    return blocks_B, jnp.zeros_like(full_B)
  spawn = (blocks_B == 0) & (jnp.where(full_B, n, n - 1 - left_B) >= s)
  return jnp.where(full_B, 0, blocks_B + spawn), full_B & spawn
