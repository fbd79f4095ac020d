"""Speculative decoding: a drafter proposes k tokens, the target verifies them in one forward
(`verify_drafts`), exact for greedy and for sampling. Two drafter kinds (`drafter=`):

"ar": classic speculative decoding, a small AR model drafting k tokens one by one. Slot i of
either cache holds the token at position i (prompt, then emitted tokens). The drafter's cache
(`DraftCache`, in `state.extra`) only ever keeps tokens that were finally emitted:

  * it lags the context by u in {1, 2} tokens at the start of a step (1 after a rejection:
    the target's correction; 2 after a full acceptance: the last draft and the bonus token);
  * draft call 1 feeds those u tokens as one chunk, padded to [B, 2] (causal, per-row
    counts); draft calls 2..k feed d_1..d_{k-1} one token each (a `lax.fori_loop`);
  * every call's keys/values are committed at the start of the next call (deferred, as the
    target does), the last call's at the start of the next step;
  * after verification the drafter cache length is cut back to the emitted prefix and the
    deferred commit is trimmed to it, so a rejected draft's keys are never visible again
    (they stay in memory past `lengths`, masked, and are overwritten later).

"diffusion": DEER, a prefix-conditioned block-diffusion drafter (`training/deer.py` trains
it) drafting all k tokens in one forward. Its cache holds the emitted context; a draft call
feeds the u in 1..k+1 emitted tokens it has not seen (causal, padded to k+1), then
[<sep>, <mask> x k] at positions c..c+k (c = context length), which see the context and each
other (`masks.tidar`). Mask i's distribution q_i (the block marginal given the prefix, warped
by the sampler) drafts d_i. Only the u context tokens are committed, so the cache never holds
a draft and needs no rollback. Verification stops at the first rejection (exact; the paper's
pseudo-code re-queries the drafter and walks on, which is not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax import masks
from paraflax.cache import ChunkKV, KVCache, commit
from paraflax.decoding import state as st
from paraflax.sharding import subtree
from paraflax.decoding.draft_verify import verify_drafts
from paraflax.sampling import Greedy

_LAG = 2  # most emitted tokens the drafter can have not seen: the width of draft call 1


@struct.dataclass
class DraftCache:
  """The drafter's cache and its deferred commit (chunk width 2, up to 2 kept rows)."""
  cache: KVCache = subtree()
  pending: st.PendingCommit = subtree()


def _pad_chunk(kv: ChunkKV, t: int) -> ChunkKV:
  """Pad a chunk's keys/values along T to `t` rows (fixed pending shape)."""
  pad = [(0, 0), (0, 0), (0, t - kv.k.shape[2]), (0, 0), (0, 0)]
  return ChunkKV(k=jnp.pad(kv.k, pad), v=jnp.pad(kv.v, pad))


DRAFTERS = ("ar", "diffusion")


@struct.dataclass
class Speculative:
  """Draft `block_size` tokens with `draft_model=` (same vocabulary as the target), verify
  them with the target in one forward. `drafter`: "ar" (k drafter forwards a step) or
  "diffusion" (DEER: one forward a step). `sampler` warps both p and q."""
  block_size: int = struct.field(pytree_node=False, default=4)
  sampler: object = struct.field(default_factory=Greedy)
  drafter: str = struct.field(pytree_node=False, default="ar")
  uses_draft_model = True

  def validate(self, cfg, draft_cfg):
    k = self.block_size
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
      raise ValueError(f"Speculative needs block_size >= 1, got {k!r}")
    if self.drafter not in DRAFTERS:
      raise ValueError(f"Speculative drafter must be one of {DRAFTERS}, got {self.drafter!r}")
    if draft_cfg is None:
      raise ValueError(f"Speculative needs draft_model= (the {self.drafter} model to draft with)")
    if draft_cfg.vocab_size != cfg.vocab_size:
      raise ValueError(f"Speculative needs the drafter's vocabulary to be the verifier's: "
                       f"draft vocab_size {draft_cfg.vocab_size} != {cfg.vocab_size}")
    if self.drafter == "diffusion":
      for name in ("mask_token_id", "sep_token_id"):
        if getattr(draft_cfg, name) is None:
          raise ValueError(f"diffusion drafting needs a DEER drafter: the draft model's "
                           f"ModelConfig.{name} is None (train one with configs/deer_drafter.py)")
    self.sampler.validate()

  def cache_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
    return prompt_len + max_new_tokens + self.block_size

  def max_steps(self, max_new_tokens: int) -> int:
    return max(max_new_tokens - 1, 1)  # every step emits at least one token

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    k = self.block_size
    capacity = self.cache_capacity(prompts.shape[1], max_new_tokens)
    # the drafter's prefill logits are not needed: the first token is the target's
    dcache, _ = st.prefill(draft, prompts, prompt_lens, capacity)
    extra = (dcache if self.drafter == "diffusion"
             else DraftCache(cache=dcache, pending=st.no_pending(dcache, _LAG, _LAG)))
    return st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens, capacity=capacity,
                    steps=self.max_steps(max_new_tokens), chunk=k + 1, keep=k + 1,
                    sampler=self.sampler, rng=rng, eos_id=eos_id, extra=extra)

  def _draft_diffusion(self, draft, state: st.DecodeState, rng):
    """One drafter forward. Returns (drafts [B, k], q [B, k, V] or None, drafter cache
    holding the whole context)."""
    k, u_max = self.block_size, self.block_size + 1
    b = state.lengths.shape[0]
    cache = state.extra
    end = state.prompt_lens + state.lengths  # context length c
    unseen = end - cache.lengths  # [B] 1..k+1 emitted tokens the drafter has not cached
    idx = cache.lengths[:, None] - state.prompt_lens[:, None] + jnp.arange(u_max)
    idx = jnp.clip(idx, 0, state.tokens.shape[1] - 1)
    fresh = jnp.where(jnp.arange(u_max)[None] < unseen[:, None],
                      jnp.take_along_axis(state.tokens, idx, 1), 0)
    cfg = draft.cfg
    block = jnp.full((b, k + 1), cfg.mask_token_id, jnp.int32).at[:, 0].set(cfg.sep_token_id)
    tokens = jnp.concatenate([fresh, block], 1)  # [B, 2k+2]
    positions = jnp.concatenate([cache.lengths[:, None] + jnp.arange(u_max),
                                 end[:, None] + jnp.arange(k + 1)], 1)
    kinds = jnp.array([masks.CLEAN] * u_max + [masks.MASKED] * (k + 1))
    blocks = jnp.array([0] * u_max + [1] * (k + 1))
    valid = jnp.concatenate([jnp.arange(u_max)[None] < unseen[:, None],
                             jnp.ones((b, k + 1), bool)], 1)
    chunk = masks.tidar(jnp.broadcast_to(kinds, (b, kinds.size)),
                        jnp.broadcast_to(blocks, (b, blocks.size)), valid)
    logits, kv = draft(tokens, positions, masks.over_cache(cache.lengths, cache.slots, chunk),
                       cache)
    drafts, q = self.sampler.draft(rng, logits[:, u_max + 1:])
    kv = ChunkKV(k=kv.k[:, :, :u_max], v=kv.v[:, :, :u_max])  # context tokens only
    src = jnp.broadcast_to(jnp.arange(u_max), (b, u_max))
    cache = commit(cache, kv, src, jnp.where(state.done, 0, unseen))
    return drafts, q, cache

  def _draft(self, draft, state: st.DecodeState, rng):
    """k drafter forwards. Returns (drafts [B, k], q [B, k, V] or None, drafter cache with
    every call but the last committed, the last call's deferred commit)."""
    k = self.block_size
    b = state.lengths.shape[0]
    active = ~state.done
    rows = jnp.arange(b)
    cache = st.apply_pending(state.extra.cache, state.extra.pending)
    end = state.prompt_lens + state.lengths  # context length; slot i = position i
    # call 1: the emitted tokens the drafter has not cached (1 or 2), as one padded chunk
    unseen = jnp.clip(end - cache.lengths, 1, _LAG)
    idx = cache.lengths[:, None] - state.prompt_lens[:, None] + jnp.arange(_LAG)  # token index
    idx = jnp.clip(idx, 0, state.tokens.shape[1] - 1)
    chunk = jnp.where(jnp.arange(_LAG)[None] < unseen[:, None],
                      jnp.take_along_axis(state.tokens, idx, 1), 0)
    pos = cache.lengths[:, None] + jnp.arange(_LAG)
    mask = masks.over_cache(cache.lengths, cache.slots, masks.causal(unseen, _LAG))
    logits, kv = draft(chunk, pos, mask, cache)
    d1, q1 = self.sampler.draft(jax.random.fold_in(rng, 0), logits[rows, unseen - 1])
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
      d, qj = self.sampler.draft(jax.random.fold_in(rng, j), logits[:, 0])
      pending = st.PendingCommit(kv=_pad_chunk(kv, _LAG), src=jnp.zeros((b, _LAG), jnp.int32),
                                 count=active.astype(jnp.int32))
      drafts = drafts.at[:, j].set(d)
      q = None if q is None else q.at[:, j].set(qj)
      return cache, pending, drafts, q

    return jax.lax.fori_loop(1, k, body, (cache, pending, drafts, q))

  def step(self, fwd, draft, state: st.DecodeState) -> st.DecodeState:
    active = ~state.done
    rng, sub = jax.random.split(state.rng)
    state = state.replace(rng=rng)  # verify_drafts splits its own key from the new one
    if self.drafter == "diffusion":
      drafts, q, dcache = self._draft_diffusion(draft, state, sub)
      state = state.replace(draft_forwards=state.draft_forwards + active)
      state, _, _, _ = verify_drafts(fwd, state, drafts, q, self.sampler)
      return state.replace(extra=dcache)  # it holds only emitted tokens: nothing to roll back
    dcache, dpending, drafts, q = self._draft(draft, state, sub)
    state = state.replace(draft_forwards=state.draft_forwards + self.block_size * active)
    state, _, _, _ = verify_drafts(fwd, state, drafts, q, self.sampler)
    # roll the drafter back to the emitted prefix that the target has cached: the context
    # minus its last token (after a full acceptance that drops d_k, which was never fed)
    limit = state.prompt_lens + state.lengths - 1
    count = jnp.clip(limit - dcache.lengths, 0, dpending.count)
    dcache = dcache.replace(lengths=jnp.minimum(dcache.lengths, limit))
    return state.replace(extra=DraftCache(cache=dcache, pending=dpending.replace(count=count)))
