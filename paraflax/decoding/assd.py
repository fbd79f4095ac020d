"""Any-Subset Speculative Decoding (ASSD) with AS-ARMs (two-stream models), batched in one
compiled `lax.while_loop` (`lattice.py` holds the state and calls it shares with `AnyOrder`).

Algorithm 1 (`draft="self"`): a draft call samples the next k holes in parallel from the
query stream given what is decided (p(. | x_<n)); a verify call feeds those k drafts as
content, causal in order, and queries each hole given the drafts before it (the exact
conditional); drafts are accepted through `verify.py` and the first rejection is resampled
from the residual. The first draft is the exact conditional, so it is accepted by
construction and every draft + verify pair decides >= 2 tokens (Theorem 1: model calls <=
tokens). The verify call is skipped when no row has drafts left to verify. Algorithm 2
(`draft="ngram"`): drafts from the decided context's bigrams, no draft call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax import verify
from paraflax.decoding import lattice
from paraflax.decoding.lattice import HOLE, InfillState, take, write
from paraflax.decoding.protocol import InfillDecoder
from paraflax.model import masks
from paraflax.model.cache import commit
from paraflax.model.transformer import Queries
from paraflax.sampling import Greedy

DRAFTS = ("self", "ngram")


@struct.dataclass
class ASSD(InfillDecoder):
  """Any-Subset Speculative Decoding: draft `k` >= 2 holes per call from the model itself
  (`draft="self"`, Algorithm 1) or from the context's bigrams (`draft="ngram"`, Algorithm 2:
  no draft call, every draft verified), verify them in one call. `epsilon` > 0 loosens
  acceptance (faster, no longer exact); `sampler` warps both draft and target distributions."""
  k: int = struct.field(pytree_node=False, default=5)
  draft: str = struct.field(pytree_node=False, default="self")
  epsilon: float = 0.0
  sampler: object = struct.field(default_factory=Greedy)

  @property
  def block(self) -> int:
    return self.k

  @property
  def pending_first(self) -> bool:
    return self.draft == "ngram"  # "self": the verify call computes its content

  def validate(self, cfg):
    lattice.check_two_stream(cfg, "ASSD")
    if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 2:
      raise ValueError(f"ASSD needs k >= 2 (k = 1 is sequential decoding: AnyOrder), got "
                       f"{self.k!r}")
    if self.draft not in DRAFTS:
      raise ValueError(f"ASSD draft must be one of {DRAFTS}, got {self.draft!r}")
    if not float(self.epsilon) >= 0.0:
      raise ValueError(f"ASSD needs epsilon >= 0 (0 is exact), got {self.epsilon!r}")
    self.sampler.validate()

  def init(self, fwd, canvas_BxN, rng) -> InfillState:
    return lattice.first_call(fwd, self, canvas_BxN, rng)

  def step(self, fwd, state: InfillState) -> InfillState:
    """One iteration: verify the pending block, then draft the next one."""
    if self.draft == "ngram":
      return _verify_ngram(fwd, self, _ngram_draft(self, state, fwd.cfg.vocab_size))
    state = _verify(fwd, self, state)
    return jax.lax.cond(lattice.cond(state), lambda s: lattice.draft_call(fwd, self, s),
                        lambda s: s, state)


def _verify(fwd, dec, state: InfillState) -> InfillState:
  """A verify call: the block's drafts as content (causal in order), a query per draft that
  sees the drafts before it; accept, resample the first rejection, cache accepted content."""
  b = state.n.shape[0]
  k = dec.block
  active = state.n < state.holes  # rows whose block has drafts after the first
  k_eff = jnp.minimum(k, state.holes - state.start)  # real drafts in the block (>= 2 here)
  cache = state.cache
  pos = take(state.order, state.start[:, None] + jnp.arange(k))
  causal = masks.causal(k_eff, k)
  strict = causal & ~jnp.eye(k, dtype=bool)[None]
  logits, kv = fwd(state.drafts, pos, masks.over_cache(cache.lengths, cache.slots, causal), cache,
                   Queries(pos, masks.over_cache(cache.lengths, cache.slots, strict)))
  rng, sub = jax.random.split(state.rng)
  # draft 0 is decided; drafts 1..k-1 against their exact conditionals (+ an unused bonus row)
  target = jnp.concatenate([logits[:, 1:], logits[:, -1:]], 1)
  q = None if state.q is None else state.q[:, 1:]
  n_raw, nxt = verify.verify(sub, dec.sampler, state.drafts[:, 1:], q, target, dec.epsilon)
  acc = jnp.minimum(n_raw, k_eff - 1)  # accepted drafts after the first
  rejected = active & (n_raw < k_eff - 1)
  i = jnp.arange(k)[None]
  tokens = jnp.where(i <= acc[:, None], state.drafts, nxt[:, None])
  keep = active[:, None] & (i >= 1) & ((i <= acc[:, None]) | ((i == acc[:, None] + 1)
                                                              & rejected[:, None]))
  cache = commit(cache, kv, jnp.broadcast_to(jnp.arange(k), (b, k)), jnp.where(active, acc + 1, 0))
  resampled = take(pos, (acc + 1)[:, None])[:, 0]
  return state.replace(
      canvas=write(state.canvas, pos, tokens, keep), cache=cache, rng=rng,
      n=jnp.where(active, state.start + 1 + acc + rejected, state.n),
      pend_tok=jnp.where(rejected, nxt, state.pend_tok),
      pend_pos=jnp.where(rejected, resampled, state.pend_pos),
      pend=rejected.astype(jnp.int32), calls=state.calls + active)


def bigram_probs(canvas_BxN, cond_B, vocab: int):
  """Algorithm 2's context n-gram c(. | cond) `[B, V]`: the tokens that follow `cond` in the
  decided bigrams of the canvas, normalised over those bigrams (as the official
  `context_ngram.py`; Eq. 23's denominator does not normalise); the decided tokens' unigram
  frequencies where `cond` starts no bigram or is HOLE (no left neighbour)."""
  b = canvas_BxN.shape[0]
  rows = jnp.arange(b)[:, None]
  known = canvas_BxN != HOLE
  unigram = jnp.zeros((b, vocab)).at[rows, jnp.where(known, canvas_BxN, 0)].add(known)
  pair = known[:, :-1] & known[:, 1:]
  hit = pair & (canvas_BxN[:, :-1] == cond_B[:, None]) & (cond_B[:, None] != HOLE)
  counts = jnp.zeros((b, vocab)).at[rows, jnp.where(pair, canvas_BxN[:, 1:], 0)].add(hit)
  dist = jnp.where(counts.sum(-1, keepdims=True) > 0, counts, unigram)
  return dist / dist.sum(-1, keepdims=True)


def _ngram_draft(dec, state: InfillState, vocab: int) -> InfillState:
  """Drafts for the next k holes from the decided context's bigrams (Algorithm 2): a hole
  conditions on its left neighbour, the block's previous draft when that is a hole too."""
  b = state.canvas.shape[0]
  pos = take(state.order, state.n[:, None] + jnp.arange(dec.k))  # [B, k]
  left = take(state.canvas, pos - 1)  # [B, k] HOLE where the left neighbour is a hole
  rng, sub = jax.random.split(state.rng)

  def one(prev_draft, xs):
    i, key = xs
    cond = jnp.where(pos[:, i] == 0, HOLE, jnp.where(left[:, i] == HOLE, prev_draft, left[:, i]))
    dist = bigram_probs(state.canvas, cond, vocab)
    if dec.sampler.greedy:
      d = jnp.argmax(dist, -1).astype(jnp.int32)
    else:
      d = jax.random.categorical(key, jnp.log(dist), -1).astype(jnp.int32)
    return d, (d, dist)

  _, (drafts, q) = jax.lax.scan(one, jnp.full((b,), HOLE, jnp.int32),
                                (jnp.arange(dec.k), jax.random.split(sub, dec.k)))
  q = None if dec.sampler.greedy else jnp.moveaxis(q, 0, 1)
  return state.replace(drafts=drafts.T, q=q, start=state.n, rng=rng)


def _verify_ngram(fwd, dec, state: InfillState) -> InfillState:
  """One call: the pending token's content, then the k drafts (causal in order), a query per
  draft that sees the drafts before it. Every draft is verified (none is exact)."""
  k = dec.k
  active = state.n < state.holes
  k_eff = jnp.minimum(k, state.holes - state.n)
  cache = state.cache
  pos = take(state.order, state.n[:, None] + jnp.arange(k))
  valid = jnp.concatenate([state.pend[:, None] > 0, jnp.arange(k)[None] < k_eff[:, None]], 1)
  tri = jnp.tril(jnp.ones((k + 1, k + 1), bool))[None]
  content = (tri & valid[:, None, :]) | (jnp.eye(k + 1, dtype=bool)[None] & ~valid[:, :, None])
  query = jnp.tril(jnp.ones((k, k + 1), bool))[None] & valid[:, None, :]  # drafts before it
  over = lambda m: masks.over_cache(cache.lengths, cache.slots, m)
  logits, kv = fwd(jnp.concatenate([state.pend_tok[:, None], state.drafts], 1),
                   jnp.concatenate([state.pend_pos[:, None], pos], 1), over(content), cache,
                   Queries(pos, over(query)))
  rng, sub = jax.random.split(state.rng)
  target = jnp.concatenate([logits, logits[:, -1:]], 1)  # + an unused bonus row
  n_raw, nxt = verify.verify(sub, dec.sampler, state.drafts, state.q, target, dec.epsilon)
  acc = jnp.minimum(n_raw, k_eff)
  rejected = active & (n_raw < k_eff)
  i = jnp.arange(k)[None]
  tokens = jnp.where(i < acc[:, None], state.drafts, nxt[:, None])
  keep = active[:, None] & ((i < acc[:, None]) | ((i == acc[:, None]) & rejected[:, None]))
  src = jnp.arange(k + 1)[None] + 1 - state.pend[:, None]  # the pending row (if any), drafts
  cache = commit(cache, kv, src, jnp.where(active, state.pend + acc, 0))
  return state.replace(
      canvas=write(state.canvas, pos, tokens, keep), cache=cache, rng=rng,
      n=jnp.where(active, state.n + acc + rejected, state.n),
      pend_tok=jnp.where(rejected, nxt, state.pend_tok),
      pend_pos=jnp.where(rejected, take(pos, acc[:, None])[:, 0], state.pend_pos),
      pend=jnp.where(active, rejected, state.pend).astype(jnp.int32),
      calls=state.calls + active, iterations=state.iterations + active)


