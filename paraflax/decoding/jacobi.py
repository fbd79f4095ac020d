"""Greedy Jacobi decoding with a KV cache and a running window.

Each forward refines a block [pending token, g_1..g_{n-1}]: the model's argmax after every
block position is its next guess for the following position (one Jacobi iteration), the
longest prefix of guesses that equals those argmaxes is accepted plus one decided token
(`verify.greedy`), and the block slides on, full, with the unverified argmaxes as its new
guesses. The output is token for token greedy AR decoding. Jacobi Forcing's multi-block
decoding and rejection recycling are `JacobiMR` (`jacobi_mr.py`).
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
from paraflax.parallel.sharding import axes
from paraflax.sampling import Greedy


@struct.dataclass
class JacobiState(st.DecodeState):
  guesses: jax.Array = axes("batch", None)  # [B, n-1] guesses after the pending token


@struct.dataclass
class Jacobi(Decoder):
  """Jacobi decoding with blocks of `block_size` tokens (1 = plain AR); greedy only."""
  block_size: int = struct.field(pytree_node=False, default=16)
  sampler: object = struct.field(default_factory=Greedy)
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
    check_fits("Jacobi", f"block_size={self.block_size}", self.block_size, cfg)

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    n = self.block_size
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=self.cache_capacity(prompts.shape[1], max_new_tokens),
                     chunk=n, keep=n, sampler=self.sampler, rng=rng, eos_id=eos_id,
                     cls=JacobiState, guesses=jnp.zeros((prompts.shape[0], n - 1), jnp.int32))
    # initial guesses: the first decided token repeated (any tokens would do)
    return state.replace(guesses=jnp.repeat(state.tokens[:, :1], n - 1, axis=1))

  def step(self, fwd, draft, state: JacobiState) -> JacobiState:
    del draft
    n = self.block_size
    state, logits, _, kept = verify_drafts(fwd, state, state.guesses, None, self.sampler)
    argmax = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, n]
    # argmax[kept - 1] was just decided; the ones after it are the next guesses
    idx = jnp.minimum(kept[:, None] + jnp.arange(n - 1), n - 1)
    return state.replace(guesses=jnp.take_along_axis(argmax, idx, 1))
