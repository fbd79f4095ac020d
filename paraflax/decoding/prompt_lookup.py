"""Prompt-lookup decoding: draft the tokens that followed the latest earlier occurrence of
the context's last n-gram, verify them in one forward (the free baseline HF users have)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax import verify
from paraflax.decoding import state as st
from paraflax.decoding.checks import check_fits
from paraflax.decoding.draft_verify import verify_drafts
from paraflax.decoding.protocol import Decoder
from paraflax.parallel.sharding import axes
from paraflax.sampling import Greedy


@struct.dataclass
class PromptLookupState(st.DecodeState):
  context: jax.Array = axes("batch", None)  # [B, P + N] prompt then output, -1 past the end


def lookup(context_BxC: jax.Array, length_B: jax.Array, max_ngram: int, num_tokens: int):
  """Drafts [B, num_tokens] from the most recent earlier match of the last n tokens (n from
  max_ngram down to 1) in `context[b, :length[b]]`, and whether any n-gram matched [B].

  A match must end before the context's last token (so at least one token follows it);
  drafts past the known context repeat its last token. Vectorised over all start positions.
  """
  b, c = context_BxC.shape
  starts = jnp.arange(c)
  rows = jnp.arange(b)[:, None]
  best = jnp.full((b,), -1, jnp.int32)  # start of the continuation
  for n in range(1, max_ngram + 1):  # a longer n-gram overrides a shorter one
    suffix = jnp.take_along_axis(context_BxC, jnp.maximum(length_B[:, None] - n + jnp.arange(n), 0), 1)
    window = context_BxC[rows[:, :, None], jnp.minimum(starts[None, :, None] + jnp.arange(n), c - 1)]
    ok = jnp.all(window == suffix[:, None, :], -1) & (starts[None] + n < length_B[:, None])
    ok &= length_B[:, None] > n  # the suffix itself must exist before an earlier copy can
    latest = jnp.max(jnp.where(ok, starts[None] + n, -1), -1)
    best = jnp.where(latest >= 0, latest, best)
  idx = jnp.minimum(jnp.maximum(best, 0)[:, None] + jnp.arange(num_tokens), length_B[:, None] - 1)
  last = jnp.take_along_axis(context_BxC, length_B[:, None] - 1, 1)
  drafts = jnp.where((best >= 0)[:, None], jnp.take_along_axis(context_BxC, idx, 1), last)
  return drafts.astype(jnp.int32), best >= 0


@struct.dataclass
class PromptLookup(Decoder):
  """Draft `num_tokens` tokens by n-gram lookup (n <= max_ngram) in prompt + output."""
  max_ngram: int = struct.field(pytree_node=False, default=3)
  num_tokens: int = struct.field(pytree_node=False, default=8)
  sampler: object = struct.field(default_factory=Greedy)
  State = PromptLookupState

  def validate(self, cfg, draft_cfg):
    if self.num_tokens < 1:
      raise ValueError(f"PromptLookup needs num_tokens >= 1, got {self.num_tokens}")
    if self.max_ngram < 1:
      raise ValueError(f"PromptLookup needs max_ngram >= 1, got {self.max_ngram}")
    check_fits("PromptLookup", f"num_tokens={self.num_tokens}", self.num_tokens + 1, cfg)
    check_fits("PromptLookup", f"max_ngram={self.max_ngram}", self.max_ngram, cfg)
    self.sampler.validate()

  @property
  def lookahead(self) -> int:
    return self.num_tokens

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    b, p = prompts.shape
    context = jnp.full((b, p + max_new_tokens), -1, jnp.int32)
    context = st.write_rows(context, jnp.zeros_like(prompt_lens), prompts, prompt_lens)
    k = self.num_tokens
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=self.cache_capacity(p, max_new_tokens), chunk=k + 1, keep=k + 1,
                     sampler=self.sampler, rng=rng, eos_id=eos_id, cls=PromptLookupState,
                     context=context)
    return state.replace(context=st.write_rows(context, prompt_lens, state.tokens[:, :1],
                                               state.lengths))

  def step(self, fwd, draft, state: PromptLookupState) -> PromptLookupState:
    del draft
    old_end = state.prompt_lens + state.lengths
    drafts, _ = lookup(state.context, old_end, self.max_ngram, self.num_tokens)
    q = verify.point_mass(drafts, fwd.cfg.vocab_size)
    state, _, new, kept = verify_drafts(fwd, state, drafts, q, self.sampler)
    return state.replace(context=st.write_rows(state.context, old_end, new, kept))
