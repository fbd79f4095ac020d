"""The released Jacobi Forcing loops' block rules, shared by `Jacobi(variant="released")` and
`JacobiMR(variant="released")`: the prefill with n tokens drawn from the prompt, fixed blocks
that slide until full, and the next block started from tokens drawn from the prompt and the
output so far (jacobi.py's docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paraflax.model import mask_structure
from paraflax.model.cache import commit, init_cache


def slide(argmax_BxN, kept_B, n: int):
  """The guesses after a step: argmax[kept - 1] was just decided, the ones after it guess
  the following positions (the last one repeated past the chunk)."""
  idx = jnp.minimum(kept_B[:, None] + jnp.arange(n - 1), n - 1)
  return jnp.take_along_axis(argmax_BxN, idx, 1)


def next_block(argmax_BxN, kept_B, left_B, draws_BxG, n: int):
  """("released") (guesses, left) after a step that kept `kept` tokens (the accepted guesses
  and the decided one) of a block with `left` guesses: the block's every guess accepted, the
  decided token starts a new block guessed by `draws` (n-1 left); else the block goes on with
  `left - kept` guesses, the argmaxes after the decided token."""
  full = kept_B - 1 >= left_B
  guesses = jnp.where(full[:, None], draws_BxG, slide(argmax_BxN, kept_B, n))
  return guesses, jnp.where(full, n - 1, left_B - kept_B)


def context_draws(key, prompts_BxP, prompt_lens_B, tokens_BxN, out_lens_B, k: int):
  """`[B, k]` tokens drawn uniformly with replacement from each row's context: its prompt,
  then its first `out_lens` output tokens."""
  b, p = prompts_BxP.shape
  size = prompt_lens_B + out_lens_B
  i = jnp.floor(jax.random.uniform(key, (b, k)) * size[:, None]).astype(jnp.int32)
  i = jnp.minimum(i, size[:, None] - 1)
  prompt = jnp.take_along_axis(prompts_BxP, jnp.clip(i, 0, max(p - 1, 0)), 1)
  out = jnp.take_along_axis(tokens_BxN, jnp.clip(i - prompt_lens_B[:, None], 0,
                                                 tokens_BxN.shape[1] - 1), 1)
  return jnp.where(i < prompt_lens_B[:, None], prompt, out)


def prefill_with_draws(fwd, prompts_BxP, prompt_lens_B, capacity: int, n: int, key):
  """("released") The prefill of the prompts followed, in each row, by n tokens drawn from its
  prompt at the next n positions: (the cache of the prompts alone, logits `[B, n, V]` at the
  last prompt token (the first output token's) and after the first n-1 draws (block 1's
  guesses'))."""
  b, p = prompts_BxP.shape
  rows = jnp.arange(b)[:, None]
  draws = context_draws(key, prompts_BxP, prompt_lens_B, prompts_BxP, jnp.zeros_like(
      prompt_lens_B), n)
  at = prompt_lens_B[:, None] + jnp.arange(n)  # [B, n]: right after each prompt
  chunk = jnp.pad(prompts_BxP, ((0, 0), (0, n))).at[rows, at].set(draws)
  positions = jnp.broadcast_to(jnp.arange(p + n, dtype=jnp.int32), (b, p + n))
  logits, kv = fwd.at(chunk, positions, mask_structure.causal(prompt_lens_B + n, p + n),
                      at - 1)
  cache = commit(init_cache(fwd.cfg, b, capacity, fwd.backend), kv, positions, prompt_lens_B)
  return cache, logits
