"""What the infill decoders (`AnyOrder`, `ASSD`) share: the loop state over a canvas with
holes, the first call, the draft call and the loop's end.

Holes are decided in the lattice order (ascending position) given every visible token.
Content keys/values of decided tokens live in a KV cache (any position order: positions are
explicit). They are the teacher-forced content stream (`masks.lattice`): the prompt's content
comes from the first call, where the prompt sees itself bidirectionally (fused with the first
draft, no separate prefill call); an accepted draft's content comes from a verify call
(causal in order); a resampled token's content (and `AnyOrder`'s last token) is fed with the
next call. A row is done when its holes are filled; a call is counted for the rows that
needed it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.model import masks
from paraflax.model.cache import KVCache, commit, init_cache
from paraflax.model.transformer import Queries
from paraflax.parallel.sharding import axes, subtree

HOLE = -1  # a position to fill


def check_two_stream(cfg, name: str):
  """An infill decoder needs a two-stream (AS-ARM) model."""
  if not cfg.two_stream:
    raise ValueError(f"{name} needs an any-subset model with a query stream "
                     "(ModelConfig.two_stream=True)")


@struct.dataclass
class InfillState:
  canvas: jax.Array = axes("batch", None)  # [B, N] tokens, HOLE where still undecided
  order: jax.Array = axes("batch", None)  # [B, N] hole positions ascending, then the prompt's
  holes: jax.Array = axes("batch")  # [B] number of holes
  n: jax.Array = axes("batch")  # [B] holes decided
  start: jax.Array = axes("batch")  # [B] order index of the block awaiting verification
  drafts: jax.Array = axes("batch", None)  # [B, k] that block's drafts
  q: jax.Array | None = axes("batch", None, None)  # [B, k, V] their distributions (None: greedy)
  cache: KVCache = subtree()  # content keys/values of decided tokens (prompt included)
  pend_tok: jax.Array = axes("batch")  # [B] a decided token whose content is not cached yet
  pend_pos: jax.Array = axes("batch")  # [B]   its position
  pend: jax.Array = axes("batch")  # [B] 1 when there is one
  calls: jax.Array = axes("batch")  # [B] model calls this row needed
  iterations: jax.Array = axes("batch")  # [B] draft calls (one per draft-and-verify iteration)
  rng: jax.Array = axes()  # PRNG key


@struct.dataclass
class InfillOutput:
  tokens: jax.Array  # [B, N] the filled sequences
  holes: jax.Array  # [B] tokens generated
  calls: jax.Array  # [B] model calls (<= holes for ASSD and AnyOrder)
  iterations: jax.Array  # [B] draft calls


def take(x_BxN, idx_BxK):
  return jnp.take_along_axis(x_BxN, jnp.clip(idx_BxK, 0, x_BxN.shape[1] - 1), 1)


def write(canvas, pos_BxK, tokens_BxK, keep_BxK):
  """canvas with tokens written at pos where keep (other entries dropped)."""
  b, n = canvas.shape
  idx = jnp.where(keep_BxK, pos_BxK, n)  # out of bounds: dropped
  return canvas.at[jnp.arange(b)[:, None], idx].set(tokens_BxK, mode="drop")


def sample_block(dec, state: InfillState, logits_BxKxV, active):
  """Draft the block from query logits; its first draft is decided at once."""
  rng, sub = jax.random.split(state.rng)
  drafts, q = dec.sampler.draft(sub, logits_BxKxV)
  first = take(state.order, state.n[:, None])
  canvas = write(state.canvas, first, drafts[:, :1], active[:, None])
  n = state.n + active
  state = state.replace(canvas=canvas, n=n, start=jnp.where(active, n - 1, state.start),
                        drafts=drafts, q=q, rng=rng, calls=state.calls + active,
                        iterations=state.iterations + active)
  if dec.pending_first:  # no verify call computes its content: feed it with the next call
    state = state.replace(pend_tok=drafts[:, 0], pend_pos=first[:, 0],
                          pend=active.astype(jnp.int32))
  return state


def first_call(fwd, dec, canvas_BxN, rng) -> InfillState:
  """The first call: the prompt's content (bidirectional) and the first block's queries."""
  b, n = canvas_BxN.shape
  k = dec.block
  hole = canvas_BxN == HOLE
  pos = jnp.broadcast_to(jnp.arange(n), (b, n))
  order = jnp.argsort(jnp.where(hole, pos, n + pos), axis=1).astype(jnp.int32)
  holes = hole.sum(1).astype(jnp.int32)
  visible = ~hole
  content, _ = masks.lattice(visible, valid_BxN=visible)  # holes: padding rows
  queries = Queries(take(order, jnp.broadcast_to(jnp.arange(k), (b, k))),
                    jnp.broadcast_to(visible[:, None, :], (b, k, n)))  # see the prompt only
  logits, kv = fwd(jnp.where(hole, 0, canvas_BxN), pos, content, None, queries)
  cache = commit(init_cache(fwd.cfg, b, n, fwd.backend), kv, jnp.argsort(hole, axis=1, stable=True),
                 n - holes)
  zeros = jnp.zeros((b,), jnp.int32)
  state = InfillState(canvas=canvas_BxN, order=order, holes=holes, n=zeros, start=zeros,
                      drafts=jnp.zeros((b, k), jnp.int32), q=None, cache=cache,
                      pend_tok=zeros, pend_pos=zeros, pend=zeros, calls=zeros,
                      iterations=zeros, rng=rng)
  return sample_block(dec, state, logits, jnp.ones((b,), bool))


def draft_call(fwd, dec, state: InfillState) -> InfillState:
  """A draft call: the pending token's content, and queries for the next block of holes
  given everything decided."""
  b = state.n.shape[0]
  k = dec.block
  active = state.n < state.holes
  cache = state.cache
  pend = state.pend.astype(bool)[:, None, None]
  content = masks.over_cache(cache.lengths, cache.slots, jnp.ones((b, 1, 1), bool))
  qpos = take(state.order, state.n[:, None] + jnp.arange(k))
  qmask = masks.over_cache(cache.lengths, cache.slots, jnp.broadcast_to(pend, (b, k, 1)))
  logits, kv = fwd(state.pend_tok[:, None], state.pend_pos[:, None], content, cache,
                   Queries(qpos, qmask))
  cache = commit(cache, kv, jnp.zeros((b, 1), jnp.int32), jnp.where(active, state.pend, 0))
  state = state.replace(cache=cache, pend=jnp.zeros_like(state.pend))
  return sample_block(dec, state, logits, active)


def cond(state: InfillState):
  return jnp.any(state.n < state.holes)


def finish(state: InfillState) -> InfillOutput:
  return InfillOutput(tokens=state.canvas, holes=state.holes, calls=state.calls,
                      iterations=state.iterations)
