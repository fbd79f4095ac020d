"""Any-subset decoding with AS-ARMs (two-stream models): fill the holes of a sequence in the
lattice order (holes in ascending position), batched in one compiled `lax.while_loop`.

`AnyOrder` is the sequential baseline: one model call per token. `ASSD` is Any-Subset
Speculative Decoding (Algorithm 1): a draft call samples the next k holes in parallel from
the query stream given what is decided (p(. | x_<n)); a verify call feeds those k drafts as
content, causal in order, and queries each hole given the drafts before it (the exact
conditional); drafts are accepted through `verify.py` and the first rejection is resampled
from the residual. The first draft is the exact conditional, so it is accepted by
construction and every draft + verify pair decides >= 2 tokens (Theorem 1: model calls <=
tokens).

Content keys/values of decided tokens live in a KV cache (any position order: positions are
explicit). They are the teacher-forced content stream (`masks.lattice`): the prompt's content
comes from the first call, where the prompt sees itself bidirectionally (fused with the first
draft, no separate prefill call); an accepted draft's content comes from the verify call
(causal in order); a resampled token's content (and `AnyOrder`'s last token) is fed with the
next call. A row is done when its holes are filled; a call is counted for the rows that
needed it, and the verify call is skipped when no row has drafts left to verify.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax import masks, verify
from paraflax.cache import KVCache, commit, init_cache
from paraflax.model import Queries
from paraflax.sampling import Greedy
from paraflax.sharding import axes, subtree

HOLE = -1  # a position to fill
DRAFTS = ("self", "ngram")


@struct.dataclass
class AnyOrder:
  """Sequential any-subset decoding: one model call per hole, in lattice order."""
  sampler: object = struct.field(default_factory=Greedy)
  block = 1
  pending_first = True  # a decided first draft's content is fed with the next call

  def validate(self, cfg):
    _two_stream(cfg, "AnyOrder")
    self.sampler.validate()


@struct.dataclass
class ASSD:
  """Any-Subset Speculative Decoding: draft `k` >= 2 holes per call from the model itself
  (`draft="self"`, Algorithm 1) or from the context's bigrams (`draft="ngram"`, Algorithm 2:
  no draft call, every draft verified), verify them in one call. `epsilon` > 0 loosens acceptance (faster, no
  longer exact); `sampler` warps both draft and target distributions."""
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
    _two_stream(cfg, "ASSD")
    if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 2:
      raise ValueError(f"ASSD needs k >= 2 (k = 1 is sequential decoding: AnyOrder), got "
                       f"{self.k!r}")
    if self.draft not in DRAFTS:
      raise ValueError(f"ASSD draft must be one of {DRAFTS}, got {self.draft!r}")
    if not float(self.epsilon) >= 0.0:
      raise ValueError(f"ASSD needs epsilon >= 0 (0 is exact), got {self.epsilon!r}")
    self.sampler.validate()


def _two_stream(cfg, name):
  if not cfg.two_stream:
    raise ValueError(f"{name} needs an any-subset model with a query stream "
                     "(ModelConfig.two_stream=True)")


@struct.dataclass
class InfillState:
  canvas: jax.Array = axes("batch", None)  # [B, N] tokens, HOLE where still undecided
  order: jax.Array = axes("batch", None)  # [B, N] hole positions ascending, then the prompt's
  holes: jax.Array = axes("batch")  # [B] number of holes
  n: jax.Array = axes("batch")  # [B] holes decided
  start: jax.Array = axes("batch")  # [B] order index of the block awaiting verification
  drafts: jax.Array = axes("batch", None)  # [B, k] that block's drafts
  q: jax.Array | None = axes("batch", None, None)  # [B, k, V] their distributions (None: greedy)
  cache: KVCache = subtree()  # content keys/values of decided tokens (prompt included)
  pend_tok: jax.Array = axes("batch")  # [B] a decided token whose content is not cached yet
  pend_pos: jax.Array = axes("batch")  # [B]   its position
  pend: jax.Array = axes("batch")  # [B] 1 when there is one
  calls: jax.Array = axes("batch")  # [B] model calls this row needed
  iterations: jax.Array = axes("batch")  # [B] draft calls (one per draft-and-verify iteration)
  rng: jax.Array = axes()  # PRNG key


@struct.dataclass
class InfillOutput:
  tokens: jax.Array  # [B, N] the filled sequences
  holes: jax.Array  # [B] tokens generated
  calls: jax.Array  # [B] model calls (<= holes for ASSD and AnyOrder)
  iterations: jax.Array  # [B] draft calls


def _take(x_BxN, idx_BxK):
  return jnp.take_along_axis(x_BxN, jnp.clip(idx_BxK, 0, x_BxN.shape[1] - 1), 1)


def _write(canvas, pos_BxK, tokens_BxK, keep_BxK):
  """canvas with tokens written at pos where keep (other entries dropped)."""
  b, n = canvas.shape
  idx = jnp.where(keep_BxK, pos_BxK, n)  # out of bounds: dropped
  return canvas.at[jnp.arange(b)[:, None], idx].set(tokens_BxK, mode="drop")


def _sample(dec, state: InfillState, logits_BxKxV, active):
  """Draft the block from query logits; its first draft is decided at once."""
  rng, sub = jax.random.split(state.rng)
  drafts, q = dec.sampler.draft(sub, logits_BxKxV)
  first = _take(state.order, state.n[:, None])
  canvas = _write(state.canvas, first, drafts[:, :1], active[:, None])
  n = state.n + active
  state = state.replace(canvas=canvas, n=n, start=jnp.where(active, n - 1, state.start),
                        drafts=drafts, q=q, rng=rng, calls=state.calls + active,
                        iterations=state.iterations + active)
  if dec.pending_first:  # no verify call computes its content: feed it with the next call
    state = state.replace(pend_tok=drafts[:, 0], pend_pos=first[:, 0],
                          pend=active.astype(jnp.int32))
  return state


def init(fwd, dec, canvas_BxN, rng) -> InfillState:
  """The first call: the prompt's content (bidirectional) and the first block's queries."""
  b, n = canvas_BxN.shape
  k = dec.block
  hole = canvas_BxN == HOLE
  pos = jnp.broadcast_to(jnp.arange(n), (b, n))
  order = jnp.argsort(jnp.where(hole, pos, n + pos), axis=1).astype(jnp.int32)
  holes = hole.sum(1).astype(jnp.int32)
  visible = ~hole
  content, _ = masks.lattice(visible, valid_BxN=visible)  # holes: padding rows
  queries = Queries(_take(order, jnp.broadcast_to(jnp.arange(k), (b, k))),
                    jnp.broadcast_to(visible[:, None, :], (b, k, n)))  # see the prompt only
  logits, kv = fwd(jnp.where(hole, 0, canvas_BxN), pos, content, None, queries)
  cache = commit(init_cache(fwd.cfg, b, n), kv, jnp.argsort(hole, axis=1, stable=True),
                 n - holes)
  zeros = jnp.zeros((b,), jnp.int32)
  state = InfillState(canvas=canvas_BxN, order=order, holes=holes, n=zeros, start=zeros,
                      drafts=jnp.zeros((b, k), jnp.int32), q=None, cache=cache,
                      pend_tok=zeros, pend_pos=zeros, pend=zeros, calls=zeros,
                      iterations=zeros, rng=rng)
  return _sample(dec, state, logits, jnp.ones((b,), bool))


def _draft(fwd, dec, state: InfillState) -> InfillState:
  """A draft call: the pending token's content, and queries for the next block of holes
  given everything decided."""
  b = state.n.shape[0]
  k = dec.block
  active = state.n < state.holes
  cache = state.cache
  pend = state.pend.astype(bool)[:, None, None]
  content = masks.over_cache(cache.lengths, cache.slots, jnp.ones((b, 1, 1), bool))
  qpos = _take(state.order, state.n[:, None] + jnp.arange(k))
  qmask = masks.over_cache(cache.lengths, cache.slots, jnp.broadcast_to(pend, (b, k, 1)))
  logits, kv = fwd(state.pend_tok[:, None], state.pend_pos[:, None], content, cache,
                   Queries(qpos, qmask))
  cache = commit(cache, kv, jnp.zeros((b, 1), jnp.int32), jnp.where(active, state.pend, 0))
  state = state.replace(cache=cache, pend=jnp.zeros_like(state.pend))
  return _sample(dec, state, logits, active)


def _verify(fwd, dec, state: InfillState) -> InfillState:
  """A verify call: the block's drafts as content (causal in order), a query per draft that
  sees the drafts before it; accept, resample the first rejection, cache accepted content."""
  b = state.n.shape[0]
  k = dec.block
  active = state.n < state.holes  # rows whose block has drafts after the first
  k_eff = jnp.minimum(k, state.holes - state.start)  # real drafts in the block (>= 2 here)
  cache = state.cache
  pos = _take(state.order, state.start[:, None] + jnp.arange(k))
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
  resampled = _take(pos, (acc + 1)[:, None])[:, 0]
  return state.replace(
      canvas=_write(state.canvas, pos, tokens, keep), cache=cache, rng=rng,
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
  pos = _take(state.order, state.n[:, None] + jnp.arange(dec.k))  # [B, k]
  left = _take(state.canvas, pos - 1)  # [B, k] HOLE where the left neighbour is a hole
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
  pos = _take(state.order, state.n[:, None] + jnp.arange(k))
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
      canvas=_write(state.canvas, pos, tokens, keep), cache=cache, rng=rng,
      n=jnp.where(active, state.n + acc + rejected, state.n),
      pend_tok=jnp.where(rejected, nxt, state.pend_tok),
      pend_pos=jnp.where(rejected, _take(pos, acc[:, None])[:, 0], state.pend_pos),
      pend=jnp.where(active, rejected, state.pend).astype(jnp.int32),
      calls=state.calls + active, iterations=state.iterations + active)


def cond(state: InfillState):
  return jnp.any(state.n < state.holes)


def step(fwd, dec, state: InfillState) -> InfillState:
  """One iteration: verify the pending block (ASSD), then draft the next one."""
  if getattr(dec, "draft", None) == "ngram":
    return _verify_ngram(fwd, dec, _ngram_draft(dec, state, fwd.cfg.vocab_size))
  if dec.block > 1:
    state = _verify(fwd, dec, state)
  return jax.lax.cond(cond(state), lambda s: _draft(fwd, dec, s), lambda s: s, state)


def finish(state: InfillState) -> InfillOutput:
  return InfillOutput(tokens=state.canvas, holes=state.holes, calls=state.calls,
                      iterations=state.iterations)
