"""Greedy Jacobi decoding with a KV cache: paraflax's running window, or the released
Jacobi Forcing loop's fixed blocks.

Each forward refines a block [pending token, g_1..g_{n-1}]: the model's argmax after every
block position is its next guess for the following position (one Jacobi iteration), the
longest prefix of guesses that equals those argmaxes is accepted plus one decided token
(`verify.greedy`). Two variants:

* "window" (paraflax's): the block slides on, full, with the unverified argmaxes as its new
  guesses; the first guesses repeat the first token.
* "released" (`jacobi_forward_greedy` of hao-ai-lab/JacobiForcing and its driver): fixed
  blocks of n tokens. The prefill reads the prompt and n tokens drawn at random from it; its
  argmaxes after them are block 1's guesses. A step accepts no further than the block's end
  (`left` guesses remain), and its new guesses are the argmaxes after the decided token up
  to the block's end. Once the block's last guess is accepted, the decided token after it
  starts the next block, whose n-1 guesses are tokens drawn at random (uniform, with
  replacement, the call's rng) from the row's prompt and output before it. The forward
  still feeds n tokens; the ones past the block's end are never accepted, so a step's
  committed tokens and its count are the released loop's.

Both are token for token greedy AR decoding. Jacobi Forcing's multi-block decoding and
rejection recycling are `JacobiMR` (`jacobi_mr.py`).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import state as st
from paraflax.decoding.checks import check_fits
from paraflax.decoding.draft_verify import verify_drafts
from paraflax.decoding.jacobi_mr import MR_FIELDS, JacobiMR, check_greedy_block
from paraflax.decoding.protocol import Decoder
from paraflax.decoding.released_blocks import context_draws, next_block, prefill_with_draws, slide
from paraflax.parallel.sharding import axes
from paraflax.sampling import Greedy

VARIANTS = ("window", "released")


@struct.dataclass
class JacobiState(st.DecodeState):
  guesses: jax.Array = axes("batch", None)  # [B, n-1] guesses after the pending token
  left: jax.Array = axes("batch")  # [B] guesses of the current block ("released"; window: n-1)
  prompts: jax.Array = axes("batch", None)  # [B, P] the prompts ("released"; window: [B, 0])


@struct.dataclass
class Jacobi(Decoder):
  """Jacobi decoding with blocks of `block_size` tokens (1 = plain AR); greedy only.
  `variant`: "window" (paraflax's running window) or "released" (the released Jacobi Forcing
  loop's fixed blocks, each started from random context tokens; see the module docstring)."""
  block_size: int = struct.field(pytree_node=False, default=16)
  sampler: object = struct.field(default_factory=Greedy)
  variant: str = struct.field(pytree_node=False, default="window")
  State = JacobiState

  @staticmethod
  def _old_spelling(*args, **kwargs):
    """`Jacobi(n, num_blocks=..., pool_size=..., ...)` (deprecated) is `JacobiMR(...)`."""
    old = ("block_size",) + MR_FIELDS + ("sampler",)  # the old positional order
    if len(args) > 1 and not hasattr(args[1], "sample"):
      kwargs.update(zip(old, args))
      args = ()
    if not set(kwargs) & set(MR_FIELDS):
      return None
    warnings.warn("Jacobi(..., num_blocks=, pool_size=, num_candidates=, spawn_threshold=) is "
                  "deprecated: use pf.decoders.JacobiMR(...) (same arguments)",
                  DeprecationWarning, stacklevel=3)
    return JacobiMR(*args, **kwargs)

  @property
  def lookahead(self) -> int:
    return self.block_size  # a step commits at most n rows, possibly past max_new_tokens

  def validate(self, cfg, draft_cfg):
    check_greedy_block("Jacobi", self.block_size, self.sampler)
    if self.variant not in VARIANTS:
      raise ValueError(f"Jacobi needs variant in {VARIANTS}, got {self.variant!r}")
    check_fits("Jacobi", f"block_size={self.block_size}", self.block_size, cfg)

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    n, b = self.block_size, prompts.shape[0]
    capacity = self.cache_capacity(prompts.shape[1], max_new_tokens)
    released = self.variant == "released"
    prefilled, guesses, context = None, jnp.zeros((b, n - 1), jnp.int32), prompts[:, :0]
    if released:
      rng, sub = jax.random.split(rng)
      cache, logits = prefill_with_draws(fwd, prompts, prompt_lens, capacity, n, sub)
      prefilled, context = (cache, logits[:, 0]), prompts
      guesses = jnp.argmax(logits[:, 1:], -1).astype(jnp.int32)  # block 1's
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=capacity, chunk=n, keep=n, sampler=self.sampler, rng=rng,
                     eos_id=eos_id, cls=JacobiState, prefilled=prefilled, guesses=guesses,
                     left=jnp.full((b,), n - 1, jnp.int32), prompts=context)
    if released:
      return state
    # initial guesses: the first decided token repeated (any tokens would do)
    return state.replace(guesses=jnp.repeat(state.tokens[:, :1], n - 1, axis=1))

  def step(self, fwd, draft, state: JacobiState) -> JacobiState:
    del draft
    n = self.block_size
    released = self.variant == "released"
    state, argmax, _, kept = verify_drafts(fwd, state, state.guesses, None, self.sampler,
                                           limit_B=state.left if released else None)
    if not released:
      return state.replace(guesses=slide(argmax, kept, n))
    rng, sub = jax.random.split(state.rng)
    draws = context_draws(sub, state.prompts, state.prompt_lens, state.tokens, state.lengths - 1,
                          n - 1)
    guesses, left = next_block(argmax, kept, state.left, draws, n)
    return state.replace(guesses=guesses, left=left, rng=rng)
