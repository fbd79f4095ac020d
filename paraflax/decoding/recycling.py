"""Rejection recycling's n-gram pool (Jacobi Forcing's MR): a per-row FIFO ring of token
sequences from past Jacobi iterations, and the lookup that turns them into candidate blocks
for the pending token. Two rules for `JacobiMR(recycling=...)` (`RULES`), and the released
loop's own (`JacobiMR(variant="released")`, `lookup(..., rule="released")`):

* "stream", paraflax's rule, adapted from the released Jacobi Forcing code's pool: after a
  step in which the real-active block rejected a draft, two entries of (K+1)*n - 1 tokens
  enter the ring (a `deque(maxlen=P)`): the last n emitted tokens and the in-flight drafts
  (`stream_entries`), then the RA's fresh drafts. The lookup skips the newest
  entry; in every other, the candidate is the suffix from the *first occurrence of the
  pending token anywhere* in it, padded with the main block. A copy of the main block is no
  candidate, and a single candidate is verified too. The pool lives for the whole generation.
* "rejected_drafts", the paper's prose: the main block's rejected drafts (n tokens), kept
  once; an entry is a candidate only when its *first* token is the pending token.
* "released" (`jacobi_forward_greedy_multiblock`'s `_build_candidates`): entries as
  `jacobi_mr_released` stores them (a pool made anew for every block); the lookup skips the
  newest entry and takes the suffix from the first occurrence, padded with the main block,
  as "stream" does, but copies of the main block count, and the candidates are used only
  when more than one entry matched (`len(cands) > 1`).

Entries are -1 past their end (and empty slots all -1): -1 never equals a token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

RULES = ("stream", "rejected_drafts")


def insert(pool_BxPxE, ptr_B, entry_BxE, ok_B, dedup: bool = False):
  """FIFO ring insert, like a deque(maxlen=P): where ok[b] (and, with `dedup`, no identical
  entry is already there) write entry[b] over row b's oldest slot. Returns (pool, ptr)."""
  b, p, _ = pool_BxPxE.shape
  if dedup:
    ok_B = ok_B & ~jnp.any(jnp.all(pool_BxPxE == entry_BxE[:, None], -1), -1)
  slot = jnp.where(ok_B, ptr_B % p, p)  # p: out of range, dropped
  return pool_BxPxE.at[jnp.arange(b), slot].set(entry_BxE, mode="drop"), ptr_B + ok_B


def lookup(pool_BxPxE, ptr_B, main_BxN, c: int, rule: str):
  """Up to C candidate blocks for the main block [pending, drafts], newest entry first:
  (cands [B, C, n], valid [B, C]).

  A valid candidate's slot 0 is the pending token, found in the entry (`any`, never an
  argmax that would read 0 on no match); slot i is the entry's token i places later, or the
  main block's slot i past the entry's end. A copy of the main block is no candidate (it
  cannot win), except under "released", where every match counts and the candidates are
  valid only when more than one entry matched; invalid candidates repeat the pending token.
  """
  b, p, e = pool_BxPxE.shape
  n = main_BxN.shape[1]
  key = main_BxN[:, 0]
  hit = pool_BxPxE == key[:, None, None]  # [B, P, E]
  age = (ptr_B[:, None] - 1 - jnp.arange(p)) % p  # [B, P], 0 = newest
  if rule == "rejected_drafts":
    found = hit[..., 0]
  else:  # "stream", "released": the newest entry (the RA's fresh drafts) is skipped
    found = jnp.any(hit, -1) & (age > 0)
  start = jnp.argmax(hit, -1)  # the first occurrence; meaningful only where found
  idx = start[..., None] + jnp.arange(n)  # [B, P, n]
  tok = jnp.take_along_axis(pool_BxPxE, jnp.minimum(idx, e - 1), -1)
  tok = jnp.where((idx < e) & (tok >= 0), tok, main_BxN[:, None])
  if rule != "released":
    found &= jnp.any(tok != main_BxN[:, None], -1)
  top, pick = jax.lax.top_k(jnp.where(found, p - age, 0), c)  # newest first
  cands = jnp.take_along_axis(tok, pick[..., None], 1)
  valid = top > 0
  if rule == "released":
    valid &= (jnp.sum(found, -1) > 1)[:, None]
  return jnp.where(valid[..., None], cands, key[:, None, None]), valid


def stream_entries(m, tokens_BxN, lengths_B, n: int):
  """The "stream" rule's two pool entries after a step of `jacobi_mr` (`m` its `MRState`),
  each [B, (K+1)*n - 1], -1 past its end: the last n emitted tokens (the pending one last;
  fewer at the start) and every in-flight draft, then the RA's fresh drafts."""
  w = m.drafts.shape[1]
  j = jnp.arange(w + n)[None]
  a = jnp.minimum(n - 1, lengths_B - 1)[:, None]  # emitted tokens before the pending one
  end = a + 1 + m.ra_len[:, None] + n * m.blocks[:, None]
  stream = jnp.where(j < end, emitted_then(tokens_BxN, lengths_B, a, m.drafts, w + n), -1)
  fresh = jnp.where(j < m.ra_len[:, None], jnp.pad(m.drafts, ((0, 0), (0, n))), -1)
  return stream, fresh


def emitted_then(tokens_BxN, lengths_B, a_Bx1, drafts_BxW, width: int):
  """`[B, width]`: each row's last `a` emitted tokens and its pending one (the last emitted),
  then `drafts` (the last one repeated past them): a pool entry's sequence."""
  j = jnp.arange(width)[None]
  emitted = jnp.take_along_axis(tokens_BxN, jnp.maximum(lengths_B[:, None] - 1 - a_Bx1 + j, 0),
                                1)
  drafts = jnp.take_along_axis(drafts_BxW, jnp.clip(j - a_Bx1 - 1, 0, drafts_BxW.shape[1] - 1),
                               1)
  return jnp.where(j <= a_Bx1, emitted, drafts)
