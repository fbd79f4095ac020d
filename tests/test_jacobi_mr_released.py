"""`JacobiMR(variant="released")`, the released Jacobi Forcing MR loop: greedy AR for every row,
each rule on a hand-worked case, and the whole loop against a list-and-deque reference of the
released loop (no cache, variable-length blocks, the pseudo block of K = 2 tracked in full)."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paraflax as pf
from paraflax.decoding import jacobi_mr_released as rel
from paraflax.decoding import recycling
from paraflax.decoding import state as st
from paraflax.decoding.generate import TRACES
from test_jacobi import MR_PROMPTS

MR = pf.decoders.JacobiMR


def released(n, k=1, **kw):
  return MR(n, num_blocks=k, pool_size=kw.pop("pool_size", 4), variant="released", **kw)


@pytest.fixture(scope="module")
def ar24(model):
  return pf.generate(model, MR_PROMPTS, max_new_tokens=24)


@pytest.mark.fast
@pytest.mark.parametrize("n, k", [(2, 1), (4, 1), (8, 1), (4, 2), (8, 2)])
def test_released_mr_equals_greedy_ar_for_every_row(model, ar24, n, k):
  out = pf.generate(model, MR_PROMPTS, decoder=released(n, k), max_new_tokens=24,
                    rng=jax.random.key(n))
  np.testing.assert_array_equal(out.tokens, ar24.tokens)
  np.testing.assert_array_equal(out.lengths, ar24.lengths)
  acc = np.asarray(out.accepted)
  assert np.all(acc.sum(1) == np.asarray(out.lengths) - 1)
  if k == 1:  # one forward a step (K = 2 counts the all-pad block's forwards too)
    assert np.all(out.forwards == (acc > 0).sum(1))


def test_released_mr_with_eos_matches_ar_and_the_loop_twin(model, ar24):
  eos = int(ar24.tokens[1, 6])
  kw = {"decoder": released(4, 2), "max_new_tokens": 24, "eos_id": eos, "rng": jax.random.key(1)}
  a = pf.generate(model, MR_PROMPTS, **kw)
  b = pf.generate(model, MR_PROMPTS, loop="python", **kw)
  ref = pf.generate(model, MR_PROMPTS, max_new_tokens=24, eos_id=eos)
  np.testing.assert_array_equal(a.tokens, ref.tokens)
  assert np.any(np.asarray(a.lengths) < 24)
  for f in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


@pytest.mark.fast
def test_released_mr_compiles_once(model):
  rng = np.random.default_rng(4)
  before = TRACES["JacobiMR"]
  for i in range(6):
    prompts = [list(rng.integers(0, 48, rng.integers(1, 17))) for _ in range(3)]
    pf.generate(model, prompts, decoder=released(4, 2), max_new_tokens=8, rng=jax.random.key(i),
                max_prompt_len=16)
  assert TRACES["JacobiMR"] - before == 1


@pytest.mark.fast
def test_the_released_settings_as_written_and_clear_errors(model):
  dec = MR(block_size=16, num_blocks=1, pool_size=4, variant="released")
  dec.validate(model.cfg, None)
  assert (dec.candidates, dec.chunk_size, dec.pool_shape) == (3, 64, (4, 16))
  assert released(16, 2).spawn_at == 14 and MR(16, num_blocks=2).spawn_at == 8  # r 0.85, 0.5
  assert released(16, 2, spawn_threshold=0.5).spawn_at == 8
  released(4, num_candidates=3).validate(model.cfg, None)  # the rule's count, spelt out
  for dec, match in [
      (released(4, 3), r'variant="released"\) runs the released loop\'s K = 1 or 2'),
      (released(4, pool_size=1), "needs pool_size >= 2"),
      (released(4, num_candidates=2), "leave num_candidates at 0"),
      (released(4, recycling="rejected_drafts"), "has its own pool rule"),
      (released(1), "needs block_size >= 2"),
      (MR(4, variant="paper"), "variant in"),
      (released(4, spawn_threshold=0.0), "0 < spawn_threshold <= 1")]:
    with pytest.raises(ValueError, match=match) as err:
      pf.generate(model, [[1, 2]], decoder=dec)
    assert "\n" not in str(err.value)


# ---- each rule on a hand-worked case ----

@pytest.mark.fast
def test_block_entries_are_the_block_so_far_then_its_new_guesses():
  """n = 4. Row 0: emitted ... 8 9 | 5 (pending), 1 guess left [7]: the block is [8 9 5 7]
  (2 accepted, the next token, the guess), the tail [7]. Row 1: a block just started from
  the pending token 6 with 3 guesses [1 2 3]... after a step that kept 1: 2 guesses left."""
  tokens = jnp.array([[4, 8, 9, 5, -1], [6, 3, -1, -1, -1]])
  guesses = jnp.array([[7, 0, 0], [1, 2, 0]])
  block, tail = rel.block_entries(tokens, jnp.array([4, 2]), guesses, jnp.array([1, 2]), 4)
  assert block.tolist() == [[8, 9, 5, 7], [6, 3, 1, 2]]
  assert tail.tolist() == [[7, -1, -1, -1], [1, 2, -1, -1]]


@pytest.mark.fast
def test_the_pool_takes_two_entries_per_rejection_keeps_four_and_is_new_for_every_block():
  recycle = jax.jit(rel.recycle)
  pool, ptr = jnp.full((1, 4, 3), -1, jnp.int32), jnp.zeros((1,), jnp.int32)
  yes, no = jnp.array([True]), jnp.array([False])
  for i, (left, rejected) in enumerate([(2, yes), (1, yes), (0, yes), (1, no)]):
    block, tail = jnp.array([[i, i, i]]), jnp.array([[10 + i, -1, -1]])
    pool, ptr = recycle(pool, ptr, block, tail, jnp.array([left]), rejected, no)
  # FIFO, at most 4: [0 0 0] dropped; step 2 (no guesses left) added the block only; the
  # unrejected step added nothing
  order = [int(x) for x in (np.arange(4) + int(ptr[0])) % 4]  # oldest first
  assert [pool[0, s].tolist() for s in order] == [[10, -1, -1], [1, 1, 1], [11, -1, -1],
                                                   [2, 2, 2]]
  assert int(ptr[0]) == 5
  pool, ptr = recycle(pool, ptr, block, tail, jnp.array([1]), no, yes)  # the block finished
  assert (pool == -1).all() and ptr.tolist() == [0]


@pytest.mark.fast
def test_the_pool_is_a_deque_of_four():
  """The ring against `collections.deque(maxlen=4)`, one entry at a time."""
  insert = jax.jit(recycling.insert)
  pool, ptr = jnp.full((1, 4, 1), -1, jnp.int32), jnp.zeros((1,), jnp.int32)
  ref = collections.deque(maxlen=4)
  for i in range(7):
    pool, ptr = insert(pool, ptr, jnp.array([[i]]), jnp.array([True]))
    ref.append(i)
    oldest_first = [int(pool[0, (int(ptr[0]) + j) % 4, 0]) for j in range(4)]
    assert [x for x in oldest_first if x >= 0] == list(ref)


@pytest.mark.fast
def test_released_lookup_skips_the_newest_takes_the_first_occurrence_and_needs_two():
  """Pending token 7, main draft [7 5 6 4]; entries oldest to newest."""
  lookup = jax.jit(recycling.lookup, static_argnums=(3, 4))
  main = jnp.array([[7, 5, 6, 4]])
  pool = jnp.array([[[1, 7, 2, 7, 3], [0, 7, 5, 6, 4], [9, 9, 7, 8, -1], [7, 1, 1, 1, 1]]])
  cands, valid = lookup(pool, jnp.array([4]), main, 3, "released")
  # newest [7 1 1 1 1] skipped; then newest first: [7 8] padded with the draft's own 6 4; a
  # copy of the main draft (it counts); the first 7 of [1 7 2 7 3]
  assert cands[0].tolist() == [[7, 8, 6, 4], [7, 5, 6, 4], [7, 2, 7, 3]]
  assert valid[0].tolist() == [True, True, True]
  # one match only (the copy): no candidate at all; no match: none
  one = pool.at[0, 0].set(-1).at[0, 2].set(-1)
  cands, valid = lookup(one, jnp.array([4]), main, 3, "released")
  assert valid[0].tolist() == [False, False, False] and (cands == 7).all()
  # two matches in a pool of three entries (a fresh block's): both used
  three = jnp.array([[[7, 3, -1, -1, -1], [2, 7, 5, -1, -1], [6, 6, 6, 6, 6], [-1] * 5]])
  cands, valid = lookup(three, jnp.array([3]), main, 3, "released")
  assert cands[0, :2].tolist() == [[7, 5, 6, 4], [7, 3, 6, 4]]
  assert valid[0].tolist() == [True, True, False]
  # "stream" on the first pool: the copy is no candidate, a single one is used
  cands, valid = lookup(pool, jnp.array([4]), main, 3, "stream")
  assert valid[0].tolist() == [True, True, False] and cands[0, 1].tolist() == [7, 2, 7, 3]


@jax.jit
def _init(dec, fwd, prompts, lens, key):
  return dec.init(fwd, None, prompts, lens, 16, key, -1)


@jax.jit
def _step(dec, fwd, state):
  return dec.step(fwd, None, state)


def _pooled_state(model, n, pool, drafts):
  """A released state one step in: the pending token is greedy AR's first, its guesses
  `drafts`, the block's pool `pool` (oldest slot first, ptr = 4)."""
  prompt = MR_PROMPTS[1]
  dec = released(n)
  state = _init(dec, st.Forward.of(model), jnp.array([prompt]), jnp.array([len(prompt)]),
                jax.random.key(0))
  m = state.mr.replace(drafts=jnp.array([drafts]), pool=jnp.array([pool]),
                       ptr=jnp.array([4]))
  return dec, state.replace(mr=m)


@pytest.mark.fast
def test_a_winner_is_the_first_row_with_the_most_drafts_accepted(model):
  """n = 4, greedy AR continues a b c d e. Candidates (newest first): X [a b c z] from the
  first a of [9 a b c], Y [a b c y] (both accept 2 drafts, tie: the newer X wins, not Y nor
  the main draft with 0), then a copy of the main draft."""
  ar = pf.generate(model, [MR_PROMPTS[1]], max_new_tokens=8).tokens[0].tolist()
  a, b, c, d = ar[:4]
  assert len({a, b, c, d}) == 4 and 9 not in (a, b)
  wrong = [(t + 1) % 48 for t in (b, c, d)]
  y = (d + 2) % 48
  fwd = st.Forward.of(model)
  pool = [[a] + wrong, [a, b, c, y], [9, a, b, c], [a, a, a, a]]  # oldest first; the last newest
  dec, state = _pooled_state(model, 4, pool, wrong)
  assert state.tokens[0, 0] == a
  after = _step(dec, fwd, state)
  assert after.tokens[0, :4].tolist() == ar[:4] and int(after.lengths[0]) == 4
  assert int(after.pending.src[0, 0]) == 4  # chunk row 4: candidate 1 (X), rows 0-3 the main
  assert int(after.mr.wins[0]) == 1
  # a tie with the main draft is the main draft's: the copy [a wrong...] and the main
  pool = [[-1] * 4, [-1] * 4, [a] + wrong, [a, a, a, a]]
  pool[0] = [5, a] + wrong[:2]  # a second match: [a w1 w2] + the main's last guess
  dec, state = _pooled_state(model, 4, pool, wrong)
  after = _step(dec, fwd, state)
  assert int(after.pending.src[0, 0]) == 0 and int(after.mr.wins[0]) == 0
  # a better candidate found alone is not used: the released loop needs more than one
  pool = [[-1] * 4, [-1] * 4, [a, b, c, d], [a, a, a, a]]
  dec, state = _pooled_state(model, 4, pool, wrong)
  after = _step(dec, fwd, state)
  assert int(after.lengths[0]) == 2 and int(after.mr.wins[0]) == 0


@pytest.mark.fast
def test_the_pseudo_block_is_spawned_once_per_block_and_alone_when_it_finishes_it():
  """n = 8, s = 7 (r = 0.85): the accepted tokens (the pending one not counted) are
  n - 1 - left, n once the block is finished."""
  blocks, left = jnp.array([0, 0, 0, 1, 1, 0]), jnp.array([1, 0, 3, 0, 0, 3])
  full = jnp.array([False, False, False, False, True, True])
  got, lone = rel.pseudo_block(blocks, left, full, 8, 2, 7)
  # 6 accepted: none; 7: spawned; 4: none; in flight: stays; finished: gone; finished by a
  # step that reached 7 from 4: spawned as it finished, so one forward alone
  assert got.tolist() == [0, 1, 0, 1, 0, 0] and lone.tolist() == [0, 0, 0, 0, 0, 1]
  got, lone = rel.pseudo_block(blocks, left, full, 8, 1, 7)
  assert got.tolist() == blocks.tolist() and not lone.any()


def test_without_candidates_it_is_released_jacobi(model):
  """Same prefill, draws and blocks as `Jacobi(variant="released")`: with a pool of 2 (one
  entry looked up, never the two matches candidates need) the same tokens and forwards."""
  fwd, key, n = st.Forward.of(model), jax.random.key(3), 4
  prompts, lens = jnp.array([[5, 9, 2, 7, 0, 0], [7, 1, 1, 30, 4, 12]]), jnp.array([4, 6])
  a = _init(released(n), fwd, prompts, lens, key)
  b = _init(pf.decoders.Jacobi(n, variant="released"), fwd, prompts, lens, key)
  assert a.mr.drafts.tolist() == b.guesses.tolist() and a.tokens.tolist() == b.tokens.tolist()
  kw = {"max_new_tokens": 24, "rng": jax.random.key(5)}
  two = pf.generate(model, MR_PROMPTS, decoder=released(8, pool_size=2), **kw)
  jac = pf.generate(model, MR_PROMPTS, decoder=pf.decoders.Jacobi(8, variant="released"), **kw)
  for f in ("tokens", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(two, f), getattr(jac, f))


@pytest.mark.parametrize("n", [4, 8])
def test_k2_commits_k1s_tokens_with_one_forward_more_per_all_pad_block(model, n):
  """K = 2 equals K = 1 token for token; its forwards are K = 1's plus one for every block
  whose finishing step first reached ceil(r*n) accepted tokens (from K = 1's trace)."""
  key, s = jax.random.key(7), released(n, 2).spawn_at
  steps = list(pf.generate_steps(model, MR_PROMPTS, decoder=released(n), max_new_tokens=24,
                                 rng=key))
  two = pf.generate(model, MR_PROMPTS, decoder=released(n, 2), max_new_tokens=24, rng=key)
  np.testing.assert_array_equal(two.tokens, st.finish(steps[-1]).tokens)
  lone = np.zeros(len(MR_PROMPTS), int)
  for prev, cur in zip(steps, steps[1:]):
    full = ~np.asarray(prev.done) & (np.asarray(cur.mr.ra_len) == n - 1)
    lone += full & ~np.asarray(cur.done) & (n - 1 - np.asarray(prev.mr.ra_len) < s)
  assert lone.any()
  np.testing.assert_array_equal(two.forwards, np.asarray(steps[-1].forwards) + lone)


# ---- the whole loop against a reference of the released loop ----

PAD = 0  # the reference's pad token (the micro model's greedy outputs never hold it here)


@functools.cache
def _argmax_fn():
  @jax.jit
  def f(fwd, tokens_RxL, lens_R):
    r, length = tokens_RxL.shape
    pos = jnp.broadcast_to(jnp.arange(length), (r, length))
    return jnp.argmax(fwd(tokens_RxL, pos, pf.masks.causal(lens_R, length))[0], -1)
  return f


def _argmaxes(fwd, seqs):
  """The model's argmax after every token of each sequence, no cache."""
  buf = np.zeros((4, 128), np.int32)
  for i, q in enumerate(seqs):
    buf[i, :len(q)] = q
  lens = np.array([max(len(q), 1) for q in seqs] + [1] * (4 - len(seqs)), np.int32)
  return np.asarray(_argmax_fn()(fwd, jnp.asarray(buf), jnp.asarray(lens)))[:len(seqs)].tolist()


def _prefix(a, b):
  i = 0
  while i < min(len(a), len(b)) and a[i] == b[i]:
    i += 1
  return i


def released_call(fwd, ctx, draft, n, k, s, pool_size, eos, budget):
  """One call of the released MR loop, in lists (as the released code reads; a reference of
  its rules written for this test). Returns (block tokens, next token or None (EOS or the
  budget: emitted tokens reaching `budget` stop it there, as `max_new_tokens` does), forwards).
  """
  pool = collections.deque(maxlen=pool_size)
  acc, rows, nxt = [], [list(draft)], None  # the real block: accepted, [main, candidates...]
  pseudo = None  # K = 2: [accepted, draft] of the pseudo block
  forwards = 0
  while True:
    forwards += 1
    ptoks = pseudo[0] + pseudo[1] if pseudo else []
    feed = [r + ptoks for r in rows] if rows[0] else [ptoks]
    g = [x[len(ctx) + len(acc) - 1:] for x in _argmaxes(fwd, [ctx + acc + f for f in feed])]
    # g[i][j]: the argmax before feed slot j (j = 0: after the committed context)
    ra = len(rows[0])
    if ra:
      cnt = [1 + _prefix(r[1:], x[1:ra]) for r, x in zip(rows, g)]
      w = cnt.index(max(cnt))
      a, d, gw = cnt[w], rows[w], g[w][1:ra + 1]  # gw[j]: the argmax after slot j
      if eos in d[:a]:
        return acc + d[:d.index(eos) + 1], None, forwards
      acc += d[:a]
      if len(acc) + 1 >= budget:  # the emitted tokens, the next one included
        return acc, gw[a - 1], forwards
      if a < ra:
        nxt = gw[a - 1]
        rows = [[nxt] + gw[a:ra - 1]]
        pool.append([t for t in acc + rows[0] + ptoks if t != PAD])
        if gw[a:ra - 1]:
          pool.append(gw[a:ra - 1])
        cands = []
        for e in reversed(list(pool)[:-1]):
          if nxt in e:
            c = e[e.index(nxt):][:len(rows[0])]
            cands.append(c + rows[0][len(c):])
        if len(cands) > 1:
          rows += cands
      else:
        nxt, rows = gw[ra - 1], [[]]
      if nxt == eos:
        return acc + [nxt], None, forwards
    if pseudo and pseudo[1]:  # Jacobi update from the main row's argmaxes, prefix frozen
      off = ra + len(pseudo[0])
      pg = g[0][off + 1:off + 1 + len(pseudo[1])]
      c = 1 + _prefix(pseudo[1][1:], pg[:-1])
      pseudo = [pseudo[0] + pseudo[1][:c],
                [pg[c - 1]] + pg[c:-1] if c < len(pseudo[1]) else []]
      # (an all-pad block run alone that reaches s would make the released call go on)
      assert ra or len(pseudo[0]) < s, "not reproduced: see jacobi_mr_released"
    if k == 2 and pseudo is None and len(acc) >= s:
      pseudo = [[], rows[0] + [PAD] * (n - len(rows[0]))]
    if len(acc) == n:
      if pseudo and pseudo[0]:  # promoted, then the call returns: its work is thrown away
        return acc, nxt, forwards
      if pseudo is None:
        return acc, nxt, forwards
      # spawned just now: the all-pad block runs alone next


def released_generate(fwd, prompt, blocks, n, k, s, max_new, eos):
  """The released driver over `blocks`: block 1's draft, then each later block's drawn
  guesses. Returns (tokens, forwards). A first token that is EOS ends the row (AR's
  stopping; the released driver would run its block's first forward)."""
  out, forwards, draft = [], 0, blocks[0]
  if draft[0] == eos:
    return [eos], 0
  for draws in blocks[1:] + [None]:
    block, nxt, f = released_call(fwd, prompt + out, draft, n, k, s, 4, eos,
                                  max_new - len(out))
    out, forwards = out + block, forwards + f
    if nxt is None or len(out) + 1 >= max_new:
      return (out + ([nxt] if nxt is not None else []))[:max_new], forwards
    assert draws is not None, "paraflax started fewer blocks"
    draft = [nxt] + draws
  raise AssertionError("unreachable")


@pytest.mark.parametrize("n, k, eos_at", [(8, 1, None), (4, 2, None), (8, 2, None), (8, 2, 9)])
def test_the_loop_matches_a_reference_of_the_released_loop(model, ar24, n, k, eos_at):
  """Tokens and forwards of every row equal the reference's, run on paraflax's draws (block
  1's draft, then the guesses each new block started from), n - ceil(r*n) <= 2."""
  eos = -1 if eos_at is None else int(ar24.tokens[1, eos_at])
  dec = released(n, k)
  assert n - dec.spawn_at <= 2
  states = list(pf.generate_steps(model, MR_PROMPTS, decoder=dec, max_new_tokens=24,
                                  rng=jax.random.key(11),
                                  eos_id=None if eos_at is None else eos))
  final = st.finish(states[-1])
  fwd = st.Forward.of(model)
  for r, prompt in enumerate(MR_PROMPTS):
    blocks = [[int(states[0].tokens[r, 0])] + states[0].mr.drafts[r].tolist()]
    for prev, cur in zip(states, states[1:]):
      if not prev.done[r] and int(cur.mr.ra_len[r]) == n - 1:
        blocks.append(cur.mr.drafts[r].tolist())
    tokens, forwards = released_generate(fwd, prompt, blocks, n, k, dec.spawn_at, 24, eos)
    got = final.tokens[r, :int(final.lengths[r])].tolist()
    assert got == tokens, r
    assert int(final.forwards[r]) == forwards, r
  if n == 8 and eos_at is None:
    assert int(states[-1].mr.wins.sum()) > 0  # candidates won
  if k == 2 and eos_at is None:
    assert int(states[-1].mr.promotions.sum()) > 0  # pseudo blocks thrown away
