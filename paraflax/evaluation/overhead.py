"""Bookkeeping overhead of the compiled AR loop: its per-token time versus a bare jitted
one-token forward over the same cache shape (both warm, both on device in one loop)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from paraflax.decoding import state as st
from paraflax.decoding.generate import generate
from paraflax.model import masks
from paraflax.model.cache import init_cache
from paraflax.model.config import ModelConfig
from paraflax.training.run.step import init_params


@dataclasses.dataclass(frozen=True)
class OverheadResult:
  loop_ms_per_token: float  # AR while_loop, prefill subtracted
  forward_ms: float  # bare one-token forward, repeated in a fori_loop
  ratio: float


def best_of(fn, repeats: int) -> float:
  """Fastest of `repeats` warm calls of `fn`, seconds."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return min(times)


def measure(cfg: ModelConfig, batch: int = 1, prompt_len: int = 64, new_tokens: int = 256,
            repeats: int = 5, seed: int = 0) -> OverheadResult:
  model = nnx.merge(*init_params(cfg, seed))  # one compiled init, not one dispatch per weight
  prompts = jax.random.randint(jax.random.key(seed), (batch, prompt_len), 0, cfg.vocab_size)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  fwd = st.Forward.of(model)
  capacity = prompt_len + new_tokens

  run = lambda: generate(model, prompts, max_new_tokens=new_tokens, prompt_lengths=lengths,
                         max_prompt_len=prompt_len).tokens
  prefill = jax.jit(lambda f, p, n: st.prefill(f, p, n, capacity))
  loop_s = best_of(run, repeats) - best_of(lambda: prefill(fwd, prompts, lengths), repeats)

  cache = init_cache(cfg, batch, capacity).replace(lengths=jnp.full((batch,), capacity // 2))
  mask = masks.decode(cache.lengths, cache.slots, 1)
  pos = cache.lengths[:, None]
  steps = new_tokens - 1

  @jax.jit
  def bare(f, cache):
    def body(i, acc):  # the token depends on i so XLA cannot hoist the forward
      tok = (prompts[:, :1] + i) % cfg.vocab_size
      logits, _ = f(tok, pos, mask, cache)
      return acc + logits[:, 0, 0]
    return jax.lax.fori_loop(0, steps, body, jnp.zeros((batch,), jnp.float32))

  fwd_s = best_of(lambda: bare(fwd, cache), repeats) / steps
  loop_tok = loop_s / steps
  return OverheadResult(loop_tok * 1e3, fwd_s * 1e3, loop_tok / fwd_s)
