"""Greedy Jacobi decoding with a KV cache and a running window.

Each forward refines a block [pending token, g_1..g_{n-1}]: the model's argmax after every
block position is its next guess for the following position (one Jacobi iteration), the
longest prefix of guesses that equals those argmaxes is accepted plus one decided token
(`verify.greedy`), and the block slides on, full, with the unverified argmaxes as its new
guesses. The output is token for token greedy AR decoding.

With `num_blocks > 1` (multi-block decoding) and/or `pool_size > 0` (rejection recycling) the
step is Jacobi Forcing's MR decoding (`jacobi_mr.py`); the defaults keep this plain step and
its n-token chunk.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import jacobi_mr
from paraflax.decoding import state as st
from paraflax.decoding.draft_verify import verify_drafts
from paraflax.sampling import Greedy
from paraflax.sharding import axes


@struct.dataclass
class Guesses:
  """The plain step's `state.extra`."""
  tokens: jax.Array = axes("batch", None)  # [B, n-1] guesses after the pending token


@struct.dataclass
class Jacobi:
  """Jacobi decoding with blocks of `block_size` tokens (1 = plain AR).

  num_blocks: blocks in flight (K); > 1 adds pseudo-active blocks after the real-active one.
  spawn_threshold: r in (0, 1]; a block is spawned once the last one has ceil(r * n) decided
    (or pseudo-accepted) tokens.
  pool_size: recycled n-grams kept per row (0: no rejection recycling).
  num_candidates: pool n-grams verified per step next to the main block (C <= pool_size).
  """
  block_size: int = struct.field(pytree_node=False, default=16)
  num_blocks: int = struct.field(pytree_node=False, default=1)
  spawn_threshold: float = struct.field(pytree_node=False, default=0.5)
  pool_size: int = struct.field(pytree_node=False, default=0)
  num_candidates: int = struct.field(pytree_node=False, default=0)
  sampler: object = struct.field(default_factory=Greedy)
  uses_draft_model = False

  @property
  def plain(self) -> bool:
    """The single running window without a pool: the original n-token chunk."""
    return self.num_blocks == 1 and self.pool_size == 0

  @property
  def chunk_size(self) -> int:
    """Tokens per forward: K blocks in flight plus C candidate blocks (n when plain)."""
    return (self.num_blocks + self.num_candidates) * self.block_size

  @property
  def spawn_at(self) -> int:
    """ceil(r * n) decided tokens before a new block is spawned (rounded first, so that
    0.7 * 10 is 7, not 8)."""
    return math.ceil(round(self.spawn_threshold * self.block_size, 6))

  def validate(self, cfg, draft_cfg):
    def is_int(x):
      return isinstance(x, int) and not isinstance(x, bool)
    n, k, r, p, c = (self.block_size, self.num_blocks, self.spawn_threshold, self.pool_size,
                     self.num_candidates)
    if not is_int(n) or n < 1:
      raise ValueError(f"Jacobi needs block_size >= 1, got {n!r}")
    if not is_int(k) or k < 1:
      raise ValueError(f"Jacobi needs num_blocks >= 1, got {k!r}")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= 1:
      raise ValueError(f"Jacobi needs 0 < spawn_threshold <= 1, got {r!r}")
    if not is_int(p) or p < 0:
      raise ValueError(f"Jacobi needs pool_size >= 0, got {p!r}")
    if not is_int(c) or not 0 <= c <= p:
      raise ValueError(f"Jacobi needs 0 <= num_candidates <= pool_size ({p}), got {c!r}")
    if p > 0 and c == 0:
      raise ValueError(f"Jacobi with pool_size={p} needs num_candidates >= 1 to read the pool")
    if (k > 1 or c > 0) and n < 2:
      raise ValueError("multi-block decoding and pool candidates need block_size >= 2, "
                       f"got {n}")
    if not self.sampler.greedy:
      raise ValueError("Jacobi decoding is greedy (its fixed point is the greedy AR output); "
                       f"got sampler {type(self.sampler).__name__}")

  def cache_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
    # a step commits at most n rows (the RA block), possibly past max_new_tokens
    return prompt_len + max_new_tokens + self.block_size

  def max_steps(self, max_new_tokens: int) -> int:
    return max(max_new_tokens - 1, 1)  # every step decides at least one token

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    n = self.block_size
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=self.cache_capacity(prompts.shape[1], max_new_tokens),
                     steps=self.max_steps(max_new_tokens), chunk=self.chunk_size, keep=n,
                     sampler=self.sampler, rng=rng, eos_id=eos_id)
    if not self.plain:
      return jacobi_mr.init(state, n, self.num_blocks, self.pool_size, self.spawn_at)
    # initial guesses: the first decided token repeated (any tokens would do)
    return state.replace(extra=Guesses(tokens=jnp.repeat(state.tokens[:, :1], n - 1, axis=1)))

  def step(self, fwd, draft, state: st.DecodeState) -> st.DecodeState:
    del draft
    n = self.block_size
    if not self.plain:
      return jacobi_mr.step(fwd, state, n, self.num_blocks, self.num_candidates,
                            self.spawn_at)
    state, logits, _, kept = verify_drafts(fwd, state, state.extra.tokens, None, self.sampler)
    argmax = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, n]
    # argmax[kept - 1] was just decided; the ones after it are the next guesses
    idx = jnp.minimum(kept[:, None] + jnp.arange(n - 1), n - 1)
    return state.replace(extra=Guesses(tokens=jnp.take_along_axis(argmax, idx, 1)))
