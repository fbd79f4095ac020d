"""Classic speculative decoding: a small AR drafter proposes k tokens one by one, the target
verifies them in one forward (`verify_drafts`), exact for greedy and for sampling (DEER, the
block-diffusion drafter, is `deer.py`). Slot i of either cache holds the token at position i
(prompt, then emitted tokens). The drafter's cache (`SpeculativeState.draft_cache`) only ever
keeps tokens that were finally emitted:

  * it lags the context by u in {1, 2} tokens at the start of a step (1 after a rejection:
    the target's correction; 2 after a full acceptance: the last draft and the bonus token);
  * draft call 1 feeds those u tokens as one chunk, padded to [B, 2] (causal, per-row
    counts); draft calls 2..k feed d_1..d_{k-1} one token each (a `lax.fori_loop`);
  * every call's keys/values are committed at the start of the next call (deferred, as the
    target does), the last call's at the start of the next step;
  * after verification the drafter cache length is cut back to the emitted prefix and the
    deferred commit is trimmed to it, so a rejected draft's keys are never visible again
    (they stay in memory past `lengths`, masked, and are overwritten later).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import state as st
from paraflax.decoding.deer import DEER
from paraflax.decoding.draft_verify import (
  check_drafter,
  drafter_ids,
  proposal_logits,
  shared_vocab,
  start_with_drafter,
  verify_drafts,
)
from paraflax.decoding.protocol import Decoder
from paraflax.model import masks
from paraflax.model.cache import ChunkKV, KVCache
from paraflax.parallel.sharding import subtree
from paraflax.sampling import Greedy

_LAG = 2  # most emitted tokens the drafter can have not seen: the width of draft call 1
DRAFTERS = ("ar", "diffusion")  # the deprecated `drafter=` values


@struct.dataclass
class SpeculativeState(st.DecodeState):
  draft_cache: KVCache = subtree()  # the drafter's cache, without `draft_pending`
  draft_pending: st.PendingCommit = subtree()  # its deferred commit (width 2, <= 2 rows)


def _pad_chunk(kv: ChunkKV, t: int) -> ChunkKV:
  """Pad a chunk's keys/values along T to `t` rows (fixed pending shape)."""
  pad = [(0, 0), (0, 0), (0, t - kv.k.shape[2]), (0, 0), (0, 0)]
  return ChunkKV(k=jnp.pad(kv.k, pad), v=jnp.pad(kv.v, pad))


@struct.dataclass
class Speculative(Decoder):
  """Draft `block_size` tokens with k forwards of a small AR `draft_model=` (same tokenizer
  as the target; row counts may differ), verify them with the target in one forward.
  `sampler` warps both p and q; the drafter proposes only ids < `vocab` (default: the smaller
  row count; give the tokenizer's real size to keep drafts off padding rows)."""
  block_size: int = struct.field(pytree_node=False, default=4)
  sampler: object = struct.field(default_factory=Greedy)
  vocab: int | None = struct.field(pytree_node=False, default=None)
  uses_draft_model = True
  State = SpeculativeState

  @staticmethod
  def _old_spelling(*args, **kwargs):
    """`Speculative(k, drafter="diffusion")` (deprecated) is `DEER(k)`; `drafter="ar"` is
    the default."""
    if len(args) > 2:
      kwargs["drafter"], args = args[2], args[:2]
    if "drafter" not in kwargs:
      return None
    drafter = kwargs.pop("drafter")
    if drafter not in DRAFTERS:
      raise ValueError(f"Speculative drafter must be one of {DRAFTERS}, got {drafter!r}")
    new = "DEER(...)" if drafter == "diffusion" else "Speculative(...) without drafter="
    warnings.warn(f"Speculative(..., drafter={drafter!r}) is deprecated: use "
                  f"pf.decoders.{new}", DeprecationWarning, stacklevel=3)
    return (DEER if drafter == "diffusion" else Speculative)(*args, **kwargs)

  @property
  def draft_forwards_per_step(self) -> int:
    return self.block_size  # one a draft

  @property
  def lookahead(self) -> int:
    return self.block_size

  def validate(self, cfg, draft_cfg):
    check_drafter("Speculative", self, cfg, draft_cfg, "small AR model")
    self.sampler.validate()

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    return start_with_drafter(
        self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id, SpeculativeState,
        lambda dcache: {"draft_cache": dcache, "draft_pending": st.no_pending(dcache, _LAG, _LAG)})

  def _draft(self, draft, state: SpeculativeState, rng, rows: int):
    """k drafter forwards. Returns (drafts [B, k], q [B, k, rows] or None (rows: the
    verifier's vocabulary), drafter cache with every call but the last committed, the last
    call's deferred commit)."""
    k = self.block_size
    shared = shared_vocab(self, draft.cfg, rows)
    propose = lambda key, logits_BxVd: self.sampler.draft(
        key, proposal_logits(logits_BxVd, shared, rows))
    b = state.lengths.shape[0]
    active = ~state.done
    batch = jnp.arange(b)
    cache = st.apply_pending(state.draft_cache, state.draft_pending)
    end = state.prompt_lens + state.lengths  # context length; slot i = position i
    # call 1: the emitted tokens the drafter has not cached (1 or 2), as one padded chunk
    unseen = jnp.clip(end - cache.lengths, 1, _LAG)
    idx = cache.lengths[:, None] - state.prompt_lens[:, None] + jnp.arange(_LAG)  # token index
    idx = jnp.clip(idx, 0, state.tokens.shape[1] - 1)
    chunk = jnp.where(jnp.arange(_LAG)[None] < unseen[:, None],
                      drafter_ids(jnp.take_along_axis(state.tokens, idx, 1), draft.cfg.vocab_size),
                      0)
    pos = cache.lengths[:, None] + jnp.arange(_LAG)
    mask = masks.over_cache(cache.lengths, cache.slots, masks.causal(unseen, _LAG))
    logits, kv = draft(chunk, pos, mask, cache)
    d1, q1 = propose(jax.random.fold_in(rng, 0), logits[batch, unseen - 1])
    pending = st.PendingCommit(kv=kv, src=jnp.broadcast_to(jnp.arange(_LAG), (b, _LAG)),
                               count=jnp.where(active, unseen, 0))
    drafts = jnp.zeros((b, k), jnp.int32).at[:, 0].set(d1)
    q = None if q1 is None else jnp.zeros((b, k) + q1.shape[1:], q1.dtype).at[:, 0].set(q1)

    def body(j, carry):  # feed d_j at position end + j - 1, draft d_{j+1}
      cache, pending, drafts, q = carry
      cache = st.apply_pending(cache, pending)
      tok = drafts[:, j - 1][:, None]
      logits, kv = draft(tok, (end + j - 1)[:, None], masks.decode(cache.lengths, cache.slots, 1),
                         cache)
      d, qj = propose(jax.random.fold_in(rng, j), logits[:, 0])
      pending = st.PendingCommit(kv=_pad_chunk(kv, _LAG), src=jnp.zeros((b, _LAG), jnp.int32),
                                 count=active.astype(jnp.int32))
      drafts = drafts.at[:, j].set(d)
      q = None if q is None else q.at[:, j].set(qj)
      return cache, pending, drafts, q

    return jax.lax.fori_loop(1, k, body, (cache, pending, drafts, q))

  def step(self, fwd, draft, state: SpeculativeState) -> SpeculativeState:
    active = ~state.done
    rng, sub = jax.random.split(state.rng)
    state = state.replace(rng=rng)  # verify_drafts splits its own key from the new one
    dcache, dpending, drafts, q = self._draft(draft, state, sub, fwd.cfg.vocab_size)
    state = state.replace(draft_forwards=state.draft_forwards
                          + self.draft_forwards_per_step * active)
    state, _, _, _ = verify_drafts(fwd, state, drafts, q, self.sampler)
    # roll the drafter back to the emitted prefix that the target has cached: the context
    # minus its last token (after a full acceptance that drops d_k, which was never fed)
    limit = state.prompt_lens + state.lengths - 1
    count = jnp.clip(limit - dcache.lengths, 0, dpending.count)
    dcache = dcache.replace(lengths=jnp.minimum(dcache.lengths, limit))
    return state.replace(draft_cache=dcache, draft_pending=dpending.replace(count=count))
