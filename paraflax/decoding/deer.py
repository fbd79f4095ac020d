"""DEER: speculative decoding with a prefix-conditioned block-diffusion drafter
(`training/objectives/deer.py` trains it) drafting all k tokens in one forward, verified by the
target in one forward (`verify_drafts`), exact for greedy and for sampling.

The drafter's cache holds the emitted context. A draft call feeds the u in 1..k+1 emitted
tokens it has not seen (causal, padded to k+1), then [<sep>, <mask> x k] at positions c..c+k
(c = context length), which see the context and each other: the layout of `deer_layout`,
shared with the training objectives. Mask i's distribution q_i (the block marginal given the
prefix, warped by the sampler) drafts d_i. Only the u context tokens are committed, so the
cache never holds a draft and needs no rollback. Verification stops at the first rejection
(exact; the paper's pseudo-code re-queries the drafter and walks on, which is not).

A drafter trained with a bidirectional prefix (`ModelConfig.drafter_prefix`, read here and by
the objectives, so weights and decoding never disagree) has no cache: every draft call feeds
the whole context (prompt, then the emitted tokens) and the block in one cache-free forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import deer_layout
from paraflax.decoding import state as st
from paraflax.decoding.draft_verify import (
  check_drafter,
  drafter_ids,
  proposal_logits,
  shared_vocab,
  start_with_drafter,
  verify_drafts,
)
from paraflax.decoding.protocol import Decoder
from paraflax.model.cache import ChunkKV, KVCache, commit
from paraflax.parallel.sharding import axes, subtree
from paraflax.sampling import Greedy


@struct.dataclass
class DEERState(st.DecodeState):
  draft_cache: KVCache | None = subtree()  # the drafter's cache (causal prefix): context only
  prompts: jax.Array | None = axes("batch", None, default=None)  # [B, P] (bidirectional prefix)


@struct.dataclass
class DEER(Decoder):
  """Draft `block_size` tokens in one forward of a DEER `draft_model=` (a block-diffusion
  drafter with the target's tokenizer, `mask_token_id` and `sep_token_id` set; its rows may
  differ, e.g. method tokens past the target's), verify them with the target in one forward.
  `sampler` warps both p and q; drafts are ids < `vocab` (as in `Speculative`)."""
  block_size: int = struct.field(pytree_node=False, default=4)
  sampler: object = struct.field(default_factory=Greedy)
  vocab: int | None = struct.field(pytree_node=False, default=None)
  uses_draft_model = True
  State = DEERState

  @property
  def draft_forwards_per_step(self) -> int:
    return 1  # one diffusion forward drafts the block

  @property
  def lookahead(self) -> int:
    return self.block_size

  def validate(self, cfg, draft_cfg):
    check_drafter("DEER", self, cfg, draft_cfg, "DEER block-diffusion drafter")
    for name in ("mask_token_id", "sep_token_id"):
      if getattr(draft_cfg, name) is None:
        raise ValueError(f"diffusion drafting needs a DEER drafter: the draft model's "
                         f"ModelConfig.{name} is None (train one with the deer_drafter recipe)")
    self.sampler.validate()

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    if draft.cfg.drafter_prefix == "causal":
      return start_with_drafter(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng,
                                eos_id, DEERState, lambda dcache: {"draft_cache": dcache})
    k = self.block_size
    return st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                    capacity=self.cache_capacity(prompts.shape[1], max_new_tokens), chunk=k + 1,
                    keep=k + 1, sampler=self.sampler, rng=rng, eos_id=eos_id, cls=DEERState,
                    draft_cache=None, prompts=drafter_ids(prompts, draft.cfg.vocab_size))

  def _draft_bidirectional(self, draft, state: DEERState):
    """Block logits `[B, k, Vd]` of one cache-free drafter forward over the whole context."""
    k = self.block_size
    (b, p), n = state.prompts.shape, state.tokens.shape[1]
    generated = drafter_ids(jnp.maximum(state.tokens, 0), draft.cfg.vocab_size)
    context = jnp.concatenate([state.prompts, generated], 1)  # [B, P+N]
    positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(p), (b, p)),
                                 state.prompt_lens[:, None] + jnp.arange(n)], 1)
    valid = jnp.concatenate([jnp.arange(p)[None] < state.prompt_lens[:, None],
                             jnp.arange(n)[None] < state.lengths[:, None]], 1)
    tokens, positions, mask = deer_layout.draft_inputs(
        context, positions, valid, state.prompt_lens + state.lengths, k,
        draft.cfg.mask_token_id, draft.cfg.sep_token_id)
    return draft(tokens, positions, mask)[0][:, -k:]

  def _draft(self, draft, state: DEERState, rng, rows: int):
    """One drafter forward. Returns (drafts [B, k], q [B, k, rows] or None (rows: the
    verifier's vocabulary), drafter cache holding the whole context, or None without one)."""
    shared = shared_vocab(self, draft.cfg, rows)
    if state.draft_cache is None:  # a bidirectional prefix
      drafts, q = self.sampler.draft(
          rng, proposal_logits(self._draft_bidirectional(draft, state), shared, rows))
      return drafts, q, None
    k, u_max = self.block_size, self.block_size + 1
    b = state.lengths.shape[0]
    cache = state.draft_cache
    end = state.prompt_lens + state.lengths  # context length c
    unseen = end - cache.lengths  # [B] 1..k+1 emitted tokens the drafter has not cached
    idx = cache.lengths[:, None] - state.prompt_lens[:, None] + jnp.arange(u_max)
    idx = jnp.clip(idx, 0, state.tokens.shape[1] - 1)
    valid = jnp.arange(u_max)[None] < unseen[:, None]
    fresh = jnp.where(valid, drafter_ids(jnp.take_along_axis(state.tokens, idx, 1),
                                         draft.cfg.vocab_size), 0)
    tokens, positions, mask = deer_layout.draft_inputs(
        fresh, cache.lengths[:, None] + jnp.arange(u_max), valid, end, k,
        draft.cfg.mask_token_id, draft.cfg.sep_token_id, cache.lengths, cache.slots)
    logits, kv = draft(tokens, positions, mask, cache)
    drafts, q = self.sampler.draft(rng, proposal_logits(logits[:, u_max + 1:], shared, rows))
    kv = ChunkKV(k=kv.k[:, :, :u_max], v=kv.v[:, :, :u_max])  # context tokens only
    src = jnp.broadcast_to(jnp.arange(u_max), (b, u_max))
    cache = commit(cache, kv, src, jnp.where(state.done, 0, unseen))
    return drafts, q, cache

  def step(self, fwd, draft, state: DEERState) -> DEERState:
    active = ~state.done
    rng, sub = jax.random.split(state.rng)
    state = state.replace(rng=rng)  # verify_drafts splits its own key from the new one
    drafts, q, dcache = self._draft(draft, state, sub, fwd.cfg.vocab_size)
    state = state.replace(draft_forwards=state.draft_forwards
                          + self.draft_forwards_per_step * active)
    state, _, _, _ = verify_drafts(fwd, state, drafts, q, self.sampler)
    return state.replace(draft_cache=dcache)  # it holds only emitted tokens: no rollback
