"""One draft-and-verify step over the target model, shared by every decoder whose drafts are
known before the forward (prompt lookup, Jacobi, speculative decoding).

Chunk = [last emitted token, d_1..d_k] at the next positions: chunk position i scores d_{i+1}
and position k gives the bonus token. The verifier accepts n drafts and decides one more
token; the cache later takes the fed rows whose successor is decided (last token + n drafts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paraflax import verify
from paraflax.decoding import state as st
from paraflax.decoding.checks import check_fits
from paraflax.model import masks


def verify_drafts(fwd, state: st.DecodeState, drafts_BxK, q_BxKxV, sampler, limit_B=None):
  """Returns (state, the target's argmax [B, K+1], emitted [B, K+1] = [d_1..d_n, next, ...],
  kept [B]: tokens emitted (n + 1, less after an EOS or at the buffer end, 0 once done)).
  A greedy sampler's forward writes no logits (`Forward.argmax`). `limit` [B] (greedy
  only): accept at most that many drafts; the next token is then the argmax after the last
  one accepted."""
  b, k = drafts_BxK.shape
  active = ~state.done
  cache = st.flush(state)
  chunk = jnp.concatenate([st.last_tokens(state)[:, None], drafts_BxK], 1)  # [B, K+1]
  pos = (state.prompt_lens + state.lengths - 1)[:, None] + jnp.arange(k + 1)
  mask = masks.decode(cache.lengths, cache.slots, k + 1)
  rng, sub = jax.random.split(state.rng)
  if sampler.greedy:
    g, kv = fwd.argmax(chunk, pos, mask, cache)
    n_acc, nxt = verify.greedy_tokens(drafts_BxK, g)
  else:
    logits, kv = fwd(chunk, pos, mask, cache)
    n_acc, nxt = verify.verify(sub, sampler, drafts_BxK, q_BxKxV, logits)
    g = jnp.argmax(logits, -1).astype(jnp.int32)
  if limit_B is not None:
    n_acc = jnp.minimum(n_acc, limit_B)
    nxt = g[jnp.arange(b), n_acc]
  new = jnp.concatenate([drafts_BxK, jnp.zeros((b, 1), drafts_BxK.dtype)], 1)
  new = new.at[jnp.arange(b), n_acc].set(nxt)  # [d_1..d_n, next, ...]
  src = jnp.broadcast_to(jnp.arange(k + 1), (b, k + 1))
  pending = st.PendingCommit(kv=kv, src=src, count=jnp.where(active, n_acc + 1, 0))
  state = state.replace(cache=cache, pending=pending, rng=rng, forwards=state.forwards + active)
  state, kept = st.emit(state, new, n_acc + 1)
  return state.replace(step=state.step + 1), g, new, kept


def start_with_drafter(decoder, fwd, draft, prompts, prompt_lens, max_new_tokens: int, rng,
                       eos_id, cls, fields):
  """`init` of a separate-drafter decoder (chunk and kept rows: block_size + 1): both models
  prefill the prompts; the first token is the target's (the drafter's prefill logits are not
  needed). `fields(draft_cache)` gives the decoder's own state fields."""
  k = decoder.block_size
  capacity = decoder.cache_capacity(prompts.shape[1], max_new_tokens)
  dcache, _ = st.prefill(draft, drafter_ids(prompts, draft.cfg.vocab_size), prompt_lens,
                         capacity)
  return st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens, capacity=capacity,
                  chunk=k + 1, keep=k + 1, sampler=decoder.sampler, rng=rng, eos_id=eos_id,
                  cls=cls, **fields(dcache))


def check_drafter(name: str, decoder, cfg, draft_cfg, what: str) -> None:
  """Host checks every separate-drafter decoder shares: block_size >= 1, a draft model
  (`what` it is), and a shared vocabulary (`decoder.vocab`) that both models have rows for.
  Row counts may differ (a tokenizer's padding rows, a drafter's method tokens): tokenizers
  are compared where they are known (`loading.load_drafter`), never by row count."""
  k = decoder.block_size
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"{name} needs block_size >= 1, got {k!r}")
  if draft_cfg is None:
    raise ValueError(f"{name} needs draft_model= (the {what} to draft with)")
  check_fits(name, f"block_size={k}", k + 1, cfg, draft_cfg)  # k drafts + the next token
  rows = min(cfg.vocab_size, draft_cfg.vocab_size)
  if decoder.vocab is not None and not (
      isinstance(decoder.vocab, int) and not isinstance(decoder.vocab, bool)
      and 1 <= decoder.vocab <= rows):
    raise ValueError(f"{name} vocab= must be an int in 1..{rows} (the verifier has "
                     f"{cfg.vocab_size} rows, the drafter {draft_cfg.vocab_size}), got "
                     f"{decoder.vocab!r}")


def shared_vocab(decoder, draft_cfg, rows: int) -> int:
  """Ids the drafter may propose: `decoder.vocab`, else the smaller row count."""
  return decoder.vocab if decoder.vocab is not None else min(rows, draft_cfg.vocab_size)


def proposal_logits(logits_xVd: jax.Array, shared: int, rows: int) -> jax.Array:
  """The drafter's logits [..., Vd] in the verifier's index space [..., rows]: ids >= `shared`
  (the drafter's extra rows cut, the verifier's padded) are -inf BEFORE sampling, so q, what
  drafts are drawn from and verified with, has no mass there and is over p's ids. Cutting q
  after sampling would not be exact (drafts past the cut, q no longer their distribution)."""
  kept = logits_xVd[..., :shared].astype(jnp.float32)
  pad = [(0, 0)] * (kept.ndim - 1) + [(0, rows - shared)]
  return jnp.pad(kept, pad, constant_values=-jnp.inf)


def drafter_ids(ids: jax.Array, draft_rows: int) -> jax.Array:
  """Ids as the drafter embeds them: one it has no row for (the verifier emitted one of its
  own padding rows) is fed as 0. Drafts only condition on it, so verification stays exact."""
  return jnp.where(ids < draft_rows, ids, 0)
