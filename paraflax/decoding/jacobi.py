"""Greedy Jacobi decoding with a KV cache and a running window.

Each forward refines a block [pending token, g_1..g_{n-1}]: the model's argmax after every
block position is its next guess for the following position (one Jacobi iteration), the
longest prefix of guesses that equals those argmaxes is accepted plus one decided token
(`verify.greedy`), and the block slides on, full, with the unverified argmaxes as its new
guesses. The output is token for token greedy AR decoding.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from paraflax.decoding import state as st
from paraflax.decoding.draft_verify import verify_drafts
from paraflax.sampling import Greedy


@struct.dataclass
class Jacobi:
  """Jacobi decoding with blocks of `block_size` tokens (1 = plain AR)."""
  block_size: int = struct.field(pytree_node=False, default=16)
  sampler: object = struct.field(default_factory=Greedy)
  uses_draft_model = False

  def validate(self, cfg, draft_cfg):
    if not isinstance(self.block_size, int) or self.block_size < 1:
      raise ValueError(f"Jacobi needs block_size >= 1, got {self.block_size!r}")
    if not self.sampler.greedy:
      raise ValueError("Jacobi decoding is greedy (its fixed point is the greedy AR output); "
                       f"got sampler {type(self.sampler).__name__}")

  def cache_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
    return prompt_len + max_new_tokens + self.block_size

  def max_steps(self, max_new_tokens: int) -> int:
    return max(max_new_tokens - 1, 1)  # every step decides at least one token

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    n = self.block_size
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=self.cache_capacity(prompts.shape[1], max_new_tokens),
                     steps=self.max_steps(max_new_tokens), chunk=n, keep=n,
                     sampler=self.sampler, rng=rng, eos_id=eos_id)
    # initial guesses: the first decided token repeated (any tokens would do)
    return state.replace(extra=jnp.repeat(state.tokens[:, :1], n - 1, axis=1))

  def step(self, fwd, draft, state: st.DecodeState) -> st.DecodeState:
    del draft
    n = self.block_size
    state, logits, _, kept = verify_drafts(fwd, state, state.extra, None, self.sampler)
    argmax = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, n]
    # argmax[kept - 1] was just decided; the ones after it are the next guesses
    idx = jnp.minimum(kept[:, None] + jnp.arange(n - 1), n - 1)
    return state.replace(extra=jnp.take_along_axis(argmax, idx, 1))
