"""Jacobi decoding with rejection recycling and multi-block decoding (Jacobi Forcing's "MR",
Algorithm 1), in fixed shapes inside the one compiled loop. Greedy and exact.

Each step is one forward over T = K*n + C*n tokens (n block size, K blocks, C candidates):

    [pending | RA drafts | pseudo block 1 | ... | inactive] [cand 1] ... [cand C]
     \\______________ main stream: K*n slots _____________/   n slots each

Main stream: the last emitted token (not yet in the cache), then `drafts` [B, K*n-1]: the
real-active (RA) block's `ra_len` remaining drafts, `blocks` pseudo-active blocks of n tokens,
then inactive slots (the pending token repeated). It is causal over the concatenation, so a
pseudo block is conditioned on the noisy blocks before it; inactive slots come last, so they
cannot influence an active slot, and their outputs are ignored.

Candidates: up to C blocks from the pool (`recycling.lookup`): slot 0 is the pending token at
its own position p0, slot i sits at p0 + i (a match deep inside an entry never shifts
positions), each seeing the cache and itself (`masks.decode_candidates`). Unused candidate
slots repeat the pending token and can never win.

Per step and row:
  1. Verify the RA: the main block and each candidate accept their longest prefix of drafts
     equal to the argmax before them, capped at the RA's `ra_len` (only RA tokens are ever
     committed). The longest wins (main on ties); its drafts and the next argmax are emitted
     and its chunk rows committed (`PendingCommit(src=...)`).
  2. Recycle (`recycling.RULES`), into a per-row FIFO ring: "stream" (the default), after a
     step in which the RA rejected a draft, adds the new stream (the last n emitted tokens,
     then every draft; `stream_entries`) and the RA's fresh drafts; "rejected_drafts" adds
     the main block's rejected tail (n stream tokens from its first rejected draft, the last
     one repeated past the stream) unless already there or shorter than 2 tokens.
  3. Pseudo blocks keep a frozen pseudo-accepted prefix (`pacc`) that grows while its next
     token equals the argmax of the slot before it; their other tokens are Jacobi-updated.
  4. Promote: once the whole RA block is decided, the next block becomes the RA: its first
     token is replaced by the verified next token and the rest become drafts, verified again
     before anything is committed. Without a pseudo block a fresh RA starts.
  5. Spawn: with fewer than K blocks in flight and >= ceil(r*n) decided (RA, pending token
     included) or pseudo-accepted tokens in the last one, append a pseudo block initialised
     as a clone of the RA block padded with its last token (the paper's clone-and-pad).

With K = 1 the RA is plain Jacobi's running window (always n-1 drafts, never done).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from flax import struct

from paraflax.decoding import recycling
from paraflax.decoding import state as st
from paraflax.decoding.checks import check_fits
from paraflax.decoding.protocol import Decoder
from paraflax.model import masks
from paraflax.parallel.sharding import axes, subtree
from paraflax.sampling import Greedy

MR_FIELDS = ("num_blocks", "spawn_threshold", "pool_size", "num_candidates")


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


def stream_entries(m: MRState, tokens_BxN, lengths_B, n: int):
  """The "stream" rule's two pool entries after a step, each [B, (K+1)*n - 1], -1 past its
  end: the last n emitted tokens (the pending one last; fewer at the start) and every
  in-flight draft, then the RA's fresh drafts."""
  w = m.drafts.shape[1]
  j = jnp.arange(w + n)[None]
  a = jnp.minimum(n - 1, lengths_B - 1)[:, None]  # emitted tokens before the pending one
  emitted = jnp.take_along_axis(tokens_BxN, jnp.maximum(lengths_B[:, None] - 1 - a + j, 0), 1)
  drafts = jnp.take_along_axis(m.drafts, jnp.clip(j - a - 1, 0, w - 1), 1)
  end = a + 1 + m.ra_len[:, None] + n * m.blocks[:, None]
  stream = jnp.where(j < end, jnp.where(j <= a, emitted, drafts), -1)
  fresh = jnp.where(j < m.ra_len[:, None], jnp.pad(m.drafts, ((0, 0), (0, n))), -1)
  return stream, fresh


@struct.dataclass
class JacobiMRState(st.DecodeState):
  mr: MRState = subtree()  # the main stream and the n-gram pool


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
    (or pseudo-accepted) tokens.
  pool_size: recycled entries kept per row (0: no rejection recycling).
  num_candidates: pool candidates verified per step next to the main block (C <= pool_size).
  recycling: the pool's rule (`recycling.RULES`): "stream" (the default, paraflax's: stream
    entries matched anywhere, adapted from the released code's pool) or "rejected_drafts"
    (the paper's prose). "released", its old name, still works (a DeprecationWarning).
  """
  block_size: int = struct.field(pytree_node=False, default=16)
  num_blocks: int = struct.field(pytree_node=False, default=1)
  spawn_threshold: float = struct.field(pytree_node=False, default=0.5)
  pool_size: int = struct.field(pytree_node=False, default=0)
  num_candidates: int = struct.field(pytree_node=False, default=0)
  sampler: object = struct.field(default_factory=Greedy)
  recycling: str = struct.field(pytree_node=False, default="stream")
  State = JacobiMRState

  @staticmethod
  def _old_spelling(*args, **kwargs):
    """`recycling="released"` (deprecated: the rule is paraflax's) is `recycling="stream"`."""
    if kwargs.get("recycling") != "released":
      return None
    warnings.warn('JacobiMR(recycling="released") is renamed recycling="stream": the rule is '
                  "paraflax's, adapted from the released code's pool", DeprecationWarning,
                  stacklevel=3)
    return JacobiMR(*args, **{**kwargs, "recycling": "stream"})

  @property
  def chunk_size(self) -> int:
    """Tokens per forward: K blocks in flight plus C candidate blocks."""
    return (self.num_blocks + self.num_candidates) * self.block_size

  @property
  def spawn_at(self) -> int:
    """ceil(r * n) decided tokens before a new block is spawned (rounded first, so that
    0.7 * 10 is 7, not 8)."""
    return math.ceil(round(self.spawn_threshold * self.block_size, 6))

  @property
  def pool_shape(self) -> tuple[int, int]:
    """(P, E): entries per row and tokens per entry ("stream": n - 1 emitted tokens and
    the K*n stream; "rejected_drafts": n)."""
    n = self.block_size
    return self.pool_size, ((self.num_blocks + 1) * n - 1 if self.recycling == "stream" else n)

  @property
  def lookahead(self) -> int:
    return self.block_size  # a step commits at most n rows (the RA block)

  def validate(self, cfg, draft_cfg):
    def is_int(x):
      return isinstance(x, int) and not isinstance(x, bool)
    n, k, r, p, c = (self.block_size, self.num_blocks, self.spawn_threshold, self.pool_size,
                     self.num_candidates)
    check_greedy_block("JacobiMR", n, Greedy())
    if not is_int(k) or k < 1:
      raise ValueError(f"JacobiMR needs num_blocks >= 1, got {k!r}")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= 1:
      raise ValueError(f"JacobiMR needs 0 < spawn_threshold <= 1, got {r!r}")
    if not is_int(p) or p < 0:
      raise ValueError(f"JacobiMR needs pool_size >= 0, got {p!r}")
    if not is_int(c) or not 0 <= c <= p:
      raise ValueError(f"JacobiMR needs 0 <= num_candidates <= pool_size ({p}), got {c!r}")
    if self.recycling not in recycling.RULES:
      raise ValueError(f"JacobiMR needs recycling in {recycling.RULES}, got {self.recycling!r}")
    if p > 0 and c == 0:
      raise ValueError(f"JacobiMR with pool_size={p} needs num_candidates >= 1 to read the pool")
    if (k > 1 or c > 0) and n < 2:
      raise ValueError("multi-block decoding and pool candidates need block_size >= 2, "
                       f"got {n}")
    check_greedy_block("JacobiMR", n, self.sampler)
    check_fits("JacobiMR", f"(num_blocks + num_candidates) * block_size = {self.chunk_size}",
               self.chunk_size, cfg)

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    n, k = self.block_size, self.num_blocks
    pend = jnp.zeros((prompts.shape[0],), jnp.int32)  # replaced once the first token exists
    state = st.start(fwd, prompts, prompt_lens, max_new_tokens=max_new_tokens,
                     capacity=self.cache_capacity(prompts.shape[1], max_new_tokens),
                     chunk=self.chunk_size, keep=n, sampler=self.sampler, rng=rng,
                     eos_id=eos_id, cls=JacobiMRState,
                     mr=new_stream(pend, n, k, self.pool_shape, self.spawn_at))
    return state.replace(mr=new_stream(state.tokens[:, 0], n, k, self.pool_shape, self.spawn_at))

  def step(self, fwd, draft, state: JacobiMRState) -> JacobiMRState:
    del draft
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


def mr_step(fwd, state: JacobiMRState, n: int, k: int, c: int, s: int,
            rule: str) -> JacobiMRState:
  """One forward over [main stream | candidates]; see the module docstring."""
  m: MRState = state.mr
  b, w = m.drafts.shape
  tm = w + 1  # main stream slots, K*n
  rows = jnp.arange(b)
  active = ~state.done
  cache = st.flush(state)
  pend = st.last_tokens(state)
  p0 = (state.prompt_lens + state.lengths - 1)[:, None]  # the pending token's position
  main = jnp.concatenate([pend[:, None], m.drafts], 1)  # [B, K*n]
  tokens, pos = main, p0 + jnp.arange(tm)
  if c:
    cands, valid = recycling.lookup(m.pool, m.ptr, main[:, :n], c, rule)  # [B, C, n]
    tokens = jnp.concatenate([main, cands.reshape(b, c * n)], 1)
    pos = jnp.concatenate([pos, jnp.tile(p0 + jnp.arange(n), (1, c))], 1)
  mask = masks.decode_candidates(cache.lengths, cache.slots, tm, n, c)
  logits, kv = fwd(tokens, pos, mask, cache)
  g = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, T]
  # the segments that verify the RA block, [B, 1+C, n]: the main block, then the candidates
  seg, seg_g = main[:, None, :n], g[:, None, :n]
  if c:
    seg = jnp.concatenate([seg, cands], 1)
    seg_g = jnp.concatenate([seg_g, g[:, tm:].reshape(b, c, n)], 1)
  n_acc = jnp.minimum(prefix_len(seg[..., 1:] == seg_g[..., :-1]), m.ra_len[:, None])
  if c:
    n_acc = n_acc.at[:, 1:].set(jnp.where(valid, n_acc[:, 1:], -1))
  win = jnp.argmax(n_acc, -1)  # the first maximum: the main block on ties
  n_win, tok_win, g_win = n_acc[rows, win], seg[rows, win], seg_g[rows, win]
  nxt = g_win[rows, n_win]
  new = jnp.concatenate([tok_win[:, 1:], nxt[:, None]], 1).at[rows, n_win].set(nxt)
  src = jnp.where(win == 0, 0, tm + (win - 1) * n)[:, None] + jnp.arange(n)  # winner's rows
  pending = st.PendingCommit(kv=kv, src=src, count=jnp.where(active, n_win + 1, 0))
  state = state.replace(cache=cache, pending=pending, forwards=state.forwards + active)
  state, _ = st.emit(state, new, n_win + 1)
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
    for entry in stream_entries(m, state.tokens, state.lengths, n):
      pool, ptr = recycling.insert(m.pool, m.ptr, entry, rejected)
      m = m.replace(pool=pool, ptr=ptr)
  if c:
    m = m.replace(wins=m.wins + (active & (win > 0)))
  return state.replace(step=state.step + 1, mr=m)
