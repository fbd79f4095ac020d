"""Jacobi decoding with rejection recycling and multi-block decoding (Jacobi Forcing's "MR",
Algorithm 1), in fixed shapes inside the one compiled loop. Greedy and exact. Two variants:
paraflax's ("window", below) and the released code's ("released": `released_init`,
`released_step`, its rules in `jacobi_mr_released.py`).

Each step is one forward over T = K*n + C*n tokens (n block size, K blocks, C candidates):

    [pending | RA drafts | pseudo block 1 | ... | inactive] [cand 1] ... [cand C]
     \\______________ main stream: K*n slots _____________/   n slots each

Main stream: the last emitted token (not yet in the cache), then `drafts` [B, K*n-1]: the
real-active (RA) block's `ra_len` remaining drafts, `blocks` pseudo-active blocks of n tokens,
then inactive slots (the pending token repeated, after every active slot: no influence).
Candidates: up to C blocks from the pool (`recycling.lookup`), slot i at the pending token's
position + i, each seeing the cache and itself (`masks.decode_candidates`); unused ones repeat
the pending token and can never win. Per step and row:
  1. Verify the RA (`verify_ra`): the main block and each candidate accept their longest
     prefix of drafts equal to the argmax before them, capped at `ra_len`; the longest wins
     (main on ties), its drafts and the next argmax are emitted, its rows committed.
  2. Recycle into a per-row FIFO ring (`recycling.RULES`): "stream", after a step in which
     the RA rejected a draft, adds the new stream (the last n emitted tokens, then every
     draft; `recycling.stream_entries`) and the RA's fresh drafts; "rejected_drafts" adds
     the main block's rejected tail (n tokens) unless already there or shorter than 2.
  3. Pseudo blocks keep a frozen pseudo-accepted prefix (`pacc`) that grows while its next
     token equals the argmax before it; their other tokens are Jacobi-updated.
  4. Promote: once the whole RA block is decided, the next block becomes the RA: its first
     token is replaced by the verified next token, the rest become drafts, verified again
     before anything is committed. Without a pseudo block a fresh RA starts.
  5. Spawn: with fewer than K blocks in flight and >= ceil(r*n) decided (pending included) or
     pseudo-accepted tokens in the last one, append a clone of the RA block padded with its
     last token (the paper's clone-and-pad).

With K = 1 the RA is plain Jacobi's running window (always n-1 drafts, never done).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import jacobi_mr_released as rel
from paraflax.decoding.released_blocks import context_draws, next_block, prefill_with_draws
from paraflax.decoding import recycling
from paraflax.decoding import state as st
from paraflax.decoding.checks import check_fits
from paraflax.decoding.protocol import Decoder
from paraflax.model import masks
from paraflax.parallel.sharding import axes, subtree
from paraflax.sampling import Greedy

MR_FIELDS = ("num_blocks", "spawn_threshold", "pool_size", "num_candidates")
VARIANTS = ("window", "released")  # as `Jacobi`'s
RELEASED_SPAWN_THRESHOLD = 0.85  # r of the released loop (`jacobi_forward_greedy_multiblock`)


@struct.dataclass
class MRState:
  """The main stream and the n-gram pool."""
  drafts: jax.Array = axes("batch", None)  # [B, W] main stream after the pending token, W = K*n-1
  ra_len: jax.Array = axes("batch")  # [B] RA drafts left (always n-1 with K = 1)
  blocks: jax.Array = axes("batch")  # [B] pseudo-active blocks in flight, 0..K-1
  pacc: jax.Array = axes("batch", None)  # [B, K-1] pseudo-accepted prefix per pseudo block
  pool: jax.Array = axes("batch", None, None)  # [B, P, E] recycled entries, -1 = empty / past end
  ptr: jax.Array = axes("batch")  # [B] ring write pointer (insertions so far)
  wins: jax.Array = axes("batch")  # [B] steps won by a pool candidate
  promotions: jax.Array = axes("batch")  # [B] pseudo-active blocks promoted to real-active


def prefix_len(x: jax.Array) -> jax.Array:
  """Number of leading True entries along the last axis."""
  return jnp.sum(jnp.cumprod(x.astype(jnp.int32), -1), -1)


def spawn(m: MRState, pend_B, n: int, k: int, s: int) -> MRState:
  """Append a pseudo block (clone-and-pad of the RA block [pending, RA drafts]) where fewer
  than K blocks are in flight and the last one has >= s decided / pseudo-accepted tokens."""
  if k == 1:
    return m
  w = m.drafts.shape[1]
  last_pacc = jnp.take_along_axis(m.pacc, jnp.maximum(m.blocks - 1, 0)[:, None], 1)[:, 0]
  go = (m.blocks < k - 1) & (jnp.where(m.blocks == 0, n - m.ra_len, last_pacc) >= s)
  j = jnp.arange(w)[None] - (m.ra_len + m.blocks * n)[:, None]  # offset in the new block
  ra = jnp.concatenate([pend_B[:, None], m.drafts], 1)  # the RA block is ra[:, :ra_len + 1]
  clone = jnp.take_along_axis(ra, jnp.clip(j, 0, m.ra_len[:, None]), 1)
  put = go[:, None] & (j >= 0) & (j < n)
  return m.replace(drafts=jnp.where(put, clone, m.drafts), blocks=m.blocks + go)


def advance(m: MRState, g_main_BxT, g_win_BxN, n_win_B, nxt_B, active_B, n: int, k: int,
            s: int) -> MRState:
  """The stream after a step whose winner accepted n_win RA drafts and decided `nxt`.

  g_main: argmax of the main stream (g[i] predicts slot i+1); g_win: the winner's argmax.
  """
  b, w = m.drafts.shape
  t = w + 1
  d = jnp.arange(w)[None]  # draft index; chunk slot d + 1
  if k > 1:
    rel = d - m.ra_len[:, None]  # offset into the pseudo region
    blk = rel // n
    pseudo = (rel >= 0) & (blk < m.blocks[:, None])
    frozen = pseudo & (rel % n < jnp.take_along_axis(m.pacc, jnp.clip(blk, 0, k - 2), 1))
    # extend each frozen prefix while its tokens equal the argmax before them
    ok = frozen | (m.drafts == g_main_BxT[:, :w])
    idx = m.ra_len[:, None, None] + n * jnp.arange(k - 1)[:, None] + jnp.arange(n)  # [B, K-1, n]
    ok = jnp.take_along_axis(ok, jnp.minimum(idx, w - 1).reshape(b, -1), 1).reshape(b, k - 1, n)
    pacc = jnp.where(jnp.arange(k - 1) < m.blocks[:, None], prefix_len(ok), 0)
  else:
    frozen = jnp.zeros((b, w), bool)
  # Jacobi update, index i = value for chunk slot i + 1: frozen tokens stay, the RA and the
  # slot after it follow the winner, pseudo slots the main stream; then shift by `kept`
  i = jnp.arange(t)[None]
  pad = ((0, 0), (0, 1))
  upd = jnp.where(i <= m.ra_len[:, None], jnp.pad(g_win_BxN, ((0, 0), (0, t - n))), g_main_BxT)
  upd = jnp.where(jnp.pad(frozen, pad), jnp.pad(m.drafts, pad), upd)
  kept = n_win_B + 1
  drafts = jnp.take_along_axis(upd, jnp.minimum(kept[:, None] + d, t - 1), 1)
  if k == 1:  # the running window stays full: plain Jacobi's next guesses
    return m.replace(drafts=drafts)
  done = n_win_B == m.ra_len  # the whole RA block is decided: promote
  fresh = done & (m.blocks == 0)
  carried = jnp.where(fresh, 0, m.ra_len + m.blocks * n - kept)  # stream drafts carried over
  shifted = jnp.concatenate([pacc[:, 1:], jnp.zeros_like(pacc[:, :1])], 1)
  m = m.replace(
      drafts=jnp.where(d < carried[:, None], drafts, nxt_B[:, None]),
      ra_len=jnp.where(done, n - 1, m.ra_len - kept),
      blocks=jnp.where(done, jnp.maximum(m.blocks - 1, 0), m.blocks),
      pacc=jnp.where(done[:, None], shifted, pacc),
      promotions=m.promotions + (active_B & done & (m.blocks > 0)))
  return spawn(m, nxt_B, n, k, s)


@struct.dataclass
class JacobiMRState(st.DecodeState):
  mr: MRState = subtree()  # the main stream and the n-gram pool
  prompts: jax.Array = axes("batch", None)  # [B, P] the prompts ("released"; window: [B, 0])


def check_greedy_block(name: str, n, sampler):
  """What plain and MR Jacobi both need: an int block size >= 1 and a greedy sampler."""
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"{name} needs block_size >= 1, got {n!r}")
  if not sampler.greedy:
    raise ValueError(f"{name} decoding is greedy (its fixed point is the greedy AR output); "
                     f"got sampler {type(sampler).__name__}")


@struct.dataclass
class JacobiMR(Decoder):
  """Jacobi Forcing's MR decoding: blocks of `block_size` n, greedy and exact.

  num_blocks: blocks in flight (K); > 1 adds pseudo-active blocks after the real-active one.
  spawn_threshold: r in (0, 1]; a block is spawned once the last one has ceil(r * n) decided
    (or pseudo-accepted) tokens. None: 0.5, or the released code's 0.85 with "released".
  pool_size: recycled entries kept per row (0: no rejection recycling).
  num_candidates: pool candidates verified per step next to the main block (C <= pool_size).
  recycling: the pool's rule (`recycling.RULES`): "stream" (the default, paraflax's: stream
    entries matched anywhere, adapted from the released code's pool) or "rejected_drafts"
    (the paper's prose). "released", its old name, still works (a DeprecationWarning).
  variant: "window" (paraflax's) or "released" (the released code's loop, K = 1 or 2:
    `jacobi_mr_released.py`); its rule fixes C (num_candidates 0) and has its own pool.
  """
  block_size: int = struct.field(pytree_node=False, default=16)
  num_blocks: int = struct.field(pytree_node=False, default=1)
  spawn_threshold: float | None = struct.field(pytree_node=False, default=None)
  pool_size: int = struct.field(pytree_node=False, default=0)
  num_candidates: int = struct.field(pytree_node=False, default=0)
  sampler: object = struct.field(default_factory=Greedy)
  recycling: str = struct.field(pytree_node=False, default="stream")
  variant: str = struct.field(pytree_node=False, default="window")
  State = JacobiMRState

  @staticmethod
  def _old_spelling(*args, **kwargs):
    """`recycling="released"` (deprecated: the rule is paraflax's) is `recycling="stream"`."""
    if kwargs.get("recycling") != "released":
      return None
    warnings.warn('JacobiMR(recycling="released") is renamed recycling="stream": the rule is '
                  "paraflax's, adapted from the released code's pool (the released loop is "
                  'variant="released")', DeprecationWarning, stacklevel=3)
    return JacobiMR(*args, **{**kwargs, "recycling": "stream"})

  @property
  def released(self) -> bool:
    return self.variant == "released"

  @property
  def candidates(self) -> int:
    """C, the candidate blocks of a forward ("released": every pool entry but the newest)."""
    return max(self.pool_size - 1, 0) if self.released else self.num_candidates

  @property
  def chunk_size(self) -> int:
    """Tokens per forward: K blocks in flight plus C candidate blocks."""
    return (self.num_blocks + self.candidates) * self.block_size

  @property
  def spawn_at(self) -> int:
    """ceil(r * n) decided tokens before a new block is spawned (rounded first, so that
    0.7 * 10 is 7, not 8)."""
    r = self.spawn_threshold
    if r is None:
      r = RELEASED_SPAWN_THRESHOLD if self.released else 0.5
    return math.ceil(round(r * self.block_size, 6))

  @property
  def pool_shape(self) -> tuple[int, int]:
    """(P, E): entries per row and tokens per entry ("stream": n - 1 emitted tokens and
    the K*n stream; "rejected_drafts" and "released": n)."""
    n = self.block_size
    stream = self.recycling == "stream" and not self.released
    return self.pool_size, ((self.num_blocks + 1) * n - 1 if stream else n)

  @property
  def lookahead(self) -> int:
    return self.block_size  # a step commits at most n rows (the RA block)

  def validate(self, cfg, draft_cfg):
    def is_int(x):
      return isinstance(x, int) and not isinstance(x, bool)
    n, k, r, p, c = (self.block_size, self.num_blocks, self.spawn_threshold, self.pool_size,
                     self.num_candidates)
    check_greedy_block("JacobiMR", n, Greedy())
    if self.variant not in VARIANTS:
      raise ValueError(f"JacobiMR needs variant in {VARIANTS}, got {self.variant!r}")
    if not is_int(k) or k < 1:
      raise ValueError(f"JacobiMR needs num_blocks >= 1, got {k!r}")
    if r is not None and (not isinstance(r, (int, float)) or isinstance(r, bool)
                          or not 0 < r <= 1):
      raise ValueError(f"JacobiMR needs 0 < spawn_threshold <= 1, got {r!r}")
    if not is_int(p) or p < 0:
      raise ValueError(f"JacobiMR needs pool_size >= 0, got {p!r}")
    if self.recycling not in recycling.RULES:
      raise ValueError(f"JacobiMR needs recycling in {recycling.RULES}, got {self.recycling!r}")
    if self.released:
      rel.check_released(n, k, p, c, self.recycling)
    else:
      if not is_int(c) or not 0 <= c <= p:
        raise ValueError(f"JacobiMR needs 0 <= num_candidates <= pool_size ({p}), got {c!r}")
      if p > 0 and c == 0:
        raise ValueError(f"JacobiMR with pool_size={p} needs num_candidates >= 1 to read the "
                         "pool")
      if (k > 1 or c > 0) and n < 2:
        raise ValueError("multi-block decoding and pool candidates need block_size >= 2, "
                         f"got {n}")
    check_greedy_block("JacobiMR", n, self.sampler)
    check_fits("JacobiMR", f"(num_blocks + num_candidates) * block_size = {self.chunk_size}",
               self.chunk_size, cfg)

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    if self.released:
      return released_init(self, fwd, prompts, prompt_lens, max_new_tokens, rng, eos_id)
    n, k = self.block_size, self.num_blocks
    pend = jnp.zeros((prompts.shape[0],), jnp.int32)  # replaced once the first token exists
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=self.cache_capacity(prompts.shape[1], max_new_tokens),
                     chunk=self.chunk_size, keep=n, sampler=self.sampler, rng=rng,
                     eos_id=eos_id, cls=JacobiMRState, prompts=prompts[:, :0],
                     mr=new_stream(pend, n, k, self.pool_shape, self.spawn_at))
    return state.replace(mr=new_stream(state.tokens[:, 0], n, k, self.pool_shape, self.spawn_at))

  def step(self, fwd, draft, state: JacobiMRState) -> JacobiMRState:
    del draft
    if self.released:
      return released_step(self, fwd, state)
    return mr_step(fwd, state, self.block_size, self.num_blocks, self.num_candidates,
                   self.spawn_at, self.recycling)


def new_stream(pend_B, n: int, k: int, pool_shape: tuple[int, int], s: int) -> MRState:
  """A fresh RA guessing the pending token repeated, an empty pool [B, P, E]."""
  b = pend_B.shape[0]
  zeros = jnp.zeros((b,), jnp.int32)
  m = MRState(drafts=jnp.repeat(pend_B[:, None], k * n - 1, 1), ra_len=zeros + n - 1,
              blocks=zeros, pacc=jnp.zeros((b, k - 1), jnp.int32),
              pool=jnp.full((b, *pool_shape), -1, jnp.int32), ptr=zeros, wins=zeros,
              promotions=zeros)
  return spawn(m, pend_B, n, k, s)


def verify_ra(fwd, state, stream_BxT, ra_len_B, n: int, cands_BxCxN=None, valid_BxC=None):
  """One forward over [main stream | candidates] that verifies the real-active block: the
  main block (the stream's first n slots, the pending token first) and each valid candidate
  accept their longest prefix of drafts equal to the argmax before them, capped at `ra_len`;
  the first longest wins (the main block on ties); its drafts and the next argmax are
  emitted and its chunk rows committed (`PendingCommit(src=...)`). Returns (state, argmax of
  the whole chunk [B, T], n_acc [B, 1+C] (-1: invalid candidate), win [B], the winner's
  argmax [B, n], kept [B] (`st.emit`'s count))."""
  b, tm = stream_BxT.shape
  c = 0 if cands_BxCxN is None else cands_BxCxN.shape[1]
  rows = jnp.arange(b)
  active = ~state.done
  cache = st.flush(state)
  p0 = (state.prompt_lens + state.lengths - 1)[:, None]  # the pending token's position
  tokens, pos = stream_BxT, p0 + jnp.arange(tm)
  if c:
    tokens = jnp.concatenate([stream_BxT, cands_BxCxN.reshape(b, c * n)], 1)
    pos = jnp.concatenate([pos, jnp.tile(p0 + jnp.arange(n), (1, c))], 1)
  mask = masks.decode_candidates(cache.lengths, cache.slots, tm, n, c)
  g, kv = fwd.argmax(tokens, pos, mask, cache)  # [B, T]
  # the segments that verify the RA block, [B, 1+C, n]: the main block, then the candidates
  seg, seg_g = stream_BxT[:, None, :n], g[:, None, :n]
  if c:
    seg = jnp.concatenate([seg, cands_BxCxN], 1)
    seg_g = jnp.concatenate([seg_g, g[:, tm:].reshape(b, c, n)], 1)
  n_acc = jnp.minimum(prefix_len(seg[..., 1:] == seg_g[..., :-1]), ra_len_B[:, None])
  if c:
    n_acc = n_acc.at[:, 1:].set(jnp.where(valid_BxC, n_acc[:, 1:], -1))
  win = jnp.argmax(n_acc, -1)  # the first maximum: the main block on ties
  n_win, tok_win, g_win = n_acc[rows, win], seg[rows, win], seg_g[rows, win]
  nxt = g_win[rows, n_win]
  new = jnp.concatenate([tok_win[:, 1:], nxt[:, None]], 1).at[rows, n_win].set(nxt)
  src = jnp.where(win == 0, 0, tm + (win - 1) * n)[:, None] + jnp.arange(n)  # winner's rows
  pending = st.PendingCommit(kv=kv, src=src, count=jnp.where(active, n_win + 1, 0))
  state = state.replace(cache=cache, pending=pending, forwards=state.forwards + active)
  state, kept = st.emit(state, new, n_win + 1)
  return state, g, n_acc, win, g_win, kept


def mr_step(fwd, state: JacobiMRState, n: int, k: int, c: int, s: int,
            rule: str) -> JacobiMRState:
  """One forward over [main stream | candidates]; see the module docstring."""
  m: MRState = state.mr
  b, w = m.drafts.shape
  tm = w + 1  # main stream slots, K*n
  rows = jnp.arange(b)
  active = ~state.done
  main = jnp.concatenate([st.last_tokens(state)[:, None], m.drafts], 1)  # [B, K*n]
  cands = valid = None
  if c:
    cands, valid = recycling.lookup(m.pool, m.ptr, main[:, :n], c, rule)  # [B, C, n]
  state, g, n_acc, win, g_win, _ = verify_ra(fwd, state, main, m.ra_len, n, cands, valid)
  n_win = n_acc[rows, win]
  nxt = g_win[rows, n_win]
  if c and rule == "rejected_drafts":  # the main block's rejected tail
    n_main, end = n_acc[:, 0], m.ra_len + m.blocks * n  # end: drafts in the stream
    tail = jnp.take_along_axis(
        m.drafts, jnp.minimum(n_main[:, None] + jnp.arange(n), end[:, None] - 1), 1)
    ok = active & (n_main < m.ra_len) & (end - n_main >= 2)
    pool, ptr = recycling.insert(m.pool, m.ptr, tail, ok, dedup=True)
    m = m.replace(pool=pool, ptr=ptr)
  rejected = active & (n_win < m.ra_len)  # the RA rejected a draft
  m = advance(m, g[:, :tm], g_win, n_win, nxt, active, n, k, s)
  if c and rule == "stream":  # after a rejection: the new stream, then the RA's fresh drafts
    for entry in recycling.stream_entries(m, state.tokens, state.lengths, n):
      pool, ptr = recycling.insert(m.pool, m.ptr, entry, rejected)
      m = m.replace(pool=pool, ptr=ptr)
  if c:
    m = m.replace(wins=m.wins + (active & (win > 0)))
  return state.replace(step=state.step + 1, mr=m)


def released_init(dec: JacobiMR, fwd, prompts, prompt_lens, max_new_tokens: int, rng,
                  eos_id) -> JacobiMRState:
  """("released") `Jacobi(variant="released")`'s prefill and block 1 (the same draws for the
  same rng), an empty pool [B, P, n]."""
  n, b = dec.block_size, prompts.shape[0]
  capacity = dec.cache_capacity(prompts.shape[1], max_new_tokens)
  rng, sub = jax.random.split(rng)
  cache, logits = prefill_with_draws(fwd, prompts, prompt_lens, capacity, n, sub)
  m = new_stream(jnp.zeros((b,), jnp.int32), n, 1, dec.pool_shape, dec.spawn_at)
  m = m.replace(drafts=jnp.argmax(logits[:, 1:], -1).astype(jnp.int32))
  return st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens, capacity=capacity,
                  chunk=dec.chunk_size, keep=n, sampler=dec.sampler, rng=rng, eos_id=eos_id,
                  cls=JacobiMRState, prefilled=(cache, logits[:, 0]), mr=m, prompts=prompts)


def released_step(dec: JacobiMR, fwd, state: JacobiMRState) -> JacobiMRState:
  """("released") One forward over [main block | pseudo slots (K = 2) | P - 1 candidates]
  (`jacobi_mr_released`): `mr.drafts` are the block's n-1 guesses, `mr.ra_len` its guesses
  left, `mr.blocks` 1 while a pseudo block is in flight."""
  n, k, c = dec.block_size, dec.num_blocks, dec.candidates
  m: MRState = state.mr
  active = ~state.done
  pend = st.last_tokens(state)
  main = jnp.concatenate([pend[:, None], m.drafts], 1)  # [B, n]
  cands, valid = recycling.lookup(m.pool, m.ptr, main, c, "released")
  stream = main if k == 1 else jnp.concatenate([main, jnp.repeat(pend[:, None], n, 1)], 1)
  state, _, _, win, g_win, kept = verify_ra(fwd, state, stream, m.ra_len, n, cands, valid)
  # `Jacobi(variant="released")`'s key schedule (its verify step splits once): the same draws
  rng, sub = jax.random.split(jax.random.split(state.rng)[0])
  draws = context_draws(sub, state.prompts, state.prompt_lens, state.tokens, state.lengths - 1,
                        n - 1)
  guesses, left = next_block(g_win, kept, m.ra_len, draws, n)
  full = kept - 1 >= m.ra_len  # the block is finished: the next one starts
  block, tail = rel.block_entries(state.tokens, state.lengths, guesses, left, n)
  pool, ptr = rel.recycle(m.pool, m.ptr, block, tail, left, active & ~full, full)
  blocks, lone = rel.pseudo_block(m.blocks, left, full, n, k, dec.spawn_at)
  lone &= ~state.done
  m = m.replace(drafts=guesses, ra_len=left, pool=pool, ptr=ptr, blocks=blocks,
                wins=m.wins + (active & (win > 0)),
                promotions=m.promotions + (full & (m.blocks + lone > 0) & ~state.done))
  return state.replace(step=state.step + 1, rng=rng, mr=m, forwards=state.forwards + lone)
