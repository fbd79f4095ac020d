"""The AR baseline: prefill, then one token per forward with a KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import state as st
from paraflax.decoding.protocol import Decoder
from paraflax.model import masks
from paraflax.sampling import Greedy


@struct.dataclass
class AR(Decoder):
  """One token per forward. `sampler`: Greedy(), Temperature(t), TopK(k), TopP(p)."""
  sampler: object = struct.field(default_factory=Greedy)

  def validate(self, cfg, draft_cfg):
    self.sampler.validate()

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    return st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                    capacity=self.cache_capacity(prompts.shape[1], max_new_tokens),
                    chunk=1, keep=1, sampler=self.sampler, rng=rng, eos_id=eos_id)

  def step(self, fwd, draft, state: st.DecodeState) -> st.DecodeState:
    del draft
    active = ~state.done
    cache = st.flush(state)
    # the last emitted token is fed at position prompt_len + lengths - 1 (== cache length)
    tok = st.last_tokens(state)[:, None]
    pos = (state.prompt_lens + state.lengths - 1)[:, None]
    mask = masks.decode(cache.lengths, cache.slots, 1)
    rng, sub = jax.random.split(state.rng)
    if self.sampler.greedy:  # the head's argmax (no logits where its kernel runs)
      nxt, kv = fwd.argmax(tok, pos, mask, cache)
      nxt = nxt[:, 0]
    else:
      logits, kv = fwd(tok, pos, mask, cache)
      nxt = self.sampler.sample(sub, logits[:, 0])
    pending = st.PendingCommit(kv=kv, src=jnp.zeros_like(tok), count=active.astype(jnp.int32))
    state = state.replace(cache=cache, pending=pending, rng=rng, forwards=state.forwards + active)
    state, _ = st.emit(state, nxt[:, None], jnp.ones_like(nxt))
    return state.replace(step=state.step + 1)
