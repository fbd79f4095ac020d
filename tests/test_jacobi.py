"""Greedy Jacobi decoding, plain and with rejection recycling / multi-block decoding (MR):
token-for-token greedy AR for every row, block size and configuration."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import paraflax as pf
from paraflax.decoding import jacobi as jac
from paraflax.decoding import jacobi_mr as mr
from paraflax.decoding import recycling
from paraflax.decoding import state as st
from paraflax.decoding.generate import TRACES
from test_generate import reference_greedy

PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3, 7, 1], [11, 11]]
# + a periodic prompt: the micro model's greedy continuation falls into the cycle 7 27 33, so
# rejected tails recur as correct n-grams and pseudo-active blocks converge
MR_PROMPTS = PROMPTS + [[7, 27, 33] * 4]


@pytest.mark.fast
@pytest.mark.parametrize("variant", ["window", "released"])
@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_jacobi_equals_greedy_ar_for_every_row(model, block_size, variant):
  out = pf.generate(model, PROMPTS, decoder=pf.decoders.Jacobi(block_size, variant=variant),
                    max_new_tokens=24)
  ar = pf.generate(model, PROMPTS, max_new_tokens=24)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, ar.lengths)
  assert np.all(out.forwards + 1 <= out.lengths)
  if block_size > 1:  # some guesses converged and some did not
    acc = np.asarray(out.accepted)
    assert acc.max() > 1 and np.any(acc == 1)


@pytest.mark.parametrize("variant", ["window", "released"])
def test_jacobi_matches_the_no_cache_reference_with_eos_and_loop_twin(model, variant):
  ar = pf.generate(model, PROMPTS, max_new_tokens=16)
  eos = int(ar.tokens[0, 5])
  kw = dict(decoder=pf.decoders.Jacobi(4, variant=variant), max_new_tokens=16, eos_id=eos)
  a = pf.generate(model, PROMPTS, **kw)
  b = pf.generate(model, PROMPTS, loop="python", **kw)
  np.testing.assert_array_equal(a.tokens, pf.generate(model, PROMPTS, max_new_tokens=16,
                                                      eos_id=eos).tokens)
  for f in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  assert pf.generate(model, [PROMPTS[1]], decoder=pf.decoders.Jacobi(4),
                     max_new_tokens=12).tokens[0].tolist() == reference_greedy(model, PROMPTS[1], 12)


@pytest.mark.fast
@pytest.mark.parametrize("variant", ["window", "released"])
def test_jacobi_compiles_once(model, variant):
  rng = np.random.default_rng(2)
  before = TRACES["Jacobi"]
  for i in range(20):
    prompts = [list(rng.integers(0, 48, rng.integers(1, 17))) for _ in range(3)]
    pf.generate(model, prompts, decoder=pf.decoders.Jacobi(4, variant=variant),
                max_new_tokens=8, rng=jax.random.key(i), max_prompt_len=16)
  assert TRACES["Jacobi"] - before == 1


@pytest.mark.parametrize("dec, match", [
    (pf.decoders.Jacobi(0), "block_size >= 1"),
    (pf.decoders.Jacobi(4, sampler=pf.Temperature(0.7)), "Jacobi decoding is greedy"),
    (pf.decoders.Jacobi(4, variant="paper"), "variant in"),
    (pf.decoders.JacobiMR(4, num_blocks=0), "num_blocks >= 1"),
    (pf.decoders.JacobiMR(4, num_blocks=2, spawn_threshold=0.0), "0 < spawn_threshold <= 1"),
    (pf.decoders.JacobiMR(4, num_blocks=2, spawn_threshold=1.5), "0 < spawn_threshold <= 1"),
    (pf.decoders.JacobiMR(4, pool_size=-1), "pool_size >= 0"),
    (pf.decoders.JacobiMR(4, pool_size=2, num_candidates=3), "num_candidates <= pool_size"),
    (pf.decoders.JacobiMR(4, pool_size=2), "needs num_candidates >= 1"),
    (pf.decoders.JacobiMR(4, pool_size=2, num_candidates=1, recycling="paper"), "recycling in"),
    (pf.decoders.JacobiMR(1, pool_size=2, num_candidates=1), "need block_size >= 2"),
    (pf.decoders.JacobiMR(1, num_blocks=2), "need block_size >= 2"),
    (pf.decoders.JacobiMR(0), "block_size >= 1"),
    (pf.decoders.JacobiMR(4, sampler=pf.Temperature(0.7)), "JacobiMR decoding is greedy"),
])
@pytest.mark.fast
def test_bad_parameters_are_clear_errors(model, dec, match):
  with pytest.raises(ValueError, match=match):
    pf.generate(model, [[1, 2]], decoder=dec)


# ---- rejection recycling and multi-block decoding (MR) ----

J, MR = pf.decoders.Jacobi, pf.decoders.JacobiMR
OLD = {"recycling": "rejected_drafts"}
MR_CONFIGS = {  # recycling (both pool rules), multi-block, both; block sizes 2, 4, 8; K 1-3
    "recycle-n2": MR(2, pool_size=4, num_candidates=2),
    "recycle-n8-old": MR(8, pool_size=8, num_candidates=4, **OLD),
    "blocks-n4-k2": MR(4, num_blocks=2),
    "blocks-n8-k3": MR(8, num_blocks=3, spawn_threshold=0.25),
    "mr-n2-k3": MR(2, num_blocks=3, pool_size=3, num_candidates=3, spawn_threshold=1.0),
    "mr-n4-k2": MR(4, num_blocks=2, pool_size=4, num_candidates=2, spawn_threshold=0.25),
    "mr-n8-k2-old": MR(8, num_blocks=2, pool_size=6, num_candidates=3, spawn_threshold=0.75, **OLD),
}


@pytest.fixture(scope="module")
def ar_mr(model):
  return pf.generate(model, MR_PROMPTS, max_new_tokens=24)


@pytest.mark.parametrize("name", list(MR_CONFIGS))
def test_mr_equals_greedy_ar_for_every_row(model, ar_mr, name):
  out = pf.generate(model, MR_PROMPTS, decoder=MR_CONFIGS[name], max_new_tokens=24)
  np.testing.assert_array_equal(out.tokens, ar_mr.tokens)
  np.testing.assert_array_equal(out.lengths, ar_mr.lengths)
  acc = np.asarray(out.accepted)
  assert np.all(out.forwards == (acc > 0).sum(1))  # one forward per step per active row
  assert np.all(acc.sum(1) == np.asarray(out.lengths) - 1)  # the first token is the prefill's


def test_mr_with_eos_matches_ar_and_the_loop_twin(model, ar_mr):
  eos = int(ar_mr.tokens[1, 6])  # eos_id is traced: no new compile for AR or the MR loop
  kw = {"decoder": MR_CONFIGS["mr-n4-k2"], "max_new_tokens": 24, "eos_id": eos}
  a = pf.generate(model, MR_PROMPTS, **kw)
  b = pf.generate(model, MR_PROMPTS, loop="python", **kw)
  ref = pf.generate(model, MR_PROMPTS, max_new_tokens=24, eos_id=eos)
  np.testing.assert_array_equal(a.tokens, ref.tokens)
  np.testing.assert_array_equal(a.lengths, ref.lengths)
  assert np.any(np.asarray(a.lengths) < 24)  # EOS cut at least one row short
  for f in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_exactness_check_catches_a_planted_candidate(model, ar_mr, monkeypatch):
  """Negative control: candidates whose slot 0 is not the pending token (a wrong token at its
  position) break exactness, so the exactness tests above would catch a broken lookup."""
  real = recycling.lookup

  def planted(pool, ptr, main, c, rule):
    cands, valid = real(pool, ptr, main, c, rule)
    wrong = (cands[..., 0] + 1) % model.cfg.vocab_size
    return cands.at[..., 0].set(jnp.where(valid, wrong, cands[..., 0])), valid

  @struct.dataclass
  class Planted(MR):  # a type of its own: a fresh trace, which calls the planted lookup
    pass

  monkeypatch.setattr(recycling, "lookup", planted)
  out = pf.generate(model, MR_PROMPTS, decoder=Planted(2, pool_size=4, num_candidates=2),
                    max_new_tokens=24)
  assert not np.array_equal(out.tokens, ar_mr.tokens)


@pytest.mark.fast
def test_recycling_and_multiblock_are_exercised(model, ar_mr):
  """Candidates win (with tokens taken from the pool) and pseudo-active blocks get promoted;
  the default stays the plain n-token chunk, MR feeds (K + C) * n."""
  n, c, max_new = 4, 2, 24
  dec = MR_CONFIGS["mr-n4-k2"]
  states = list(pf.generate_steps(model, MR_PROMPTS, decoder=dec, max_new_tokens=max_new))
  assert states[-1].pending.kv.k.shape[2] == (2 + c) * n
  np.testing.assert_array_equal(st.finish(states[-1]).tokens, ar_mr.tokens)
  checked, lookup = 0, jax.jit(recycling.lookup, static_argnums=(3, 4))
  for prev, cur in itertools.pairwise(states):
    won = np.asarray(cur.mr.wins - prev.mr.wins)
    if not won.any():
      continue
    main = jnp.concatenate([st.last_tokens(prev)[:, None], prev.mr.drafts[:, :n - 1]], 1)
    cands, valid = lookup(prev.mr.pool, prev.mr.ptr, main, c, dec.recycling)
    assert np.all(np.asarray(cands[..., 0]) == np.asarray(main[:, :1]))  # slot 0: pending
    for r in np.flatnonzero(won):
      lo, hi = int(prev.lengths[r]), int(cur.lengths[r])
      if hi == max_new:  # the buffer end may have cut the winner's tokens short
        continue
      drafts = np.asarray(cur.tokens[r, lo:hi - 1])  # accepted drafts; the last is decided
      assert len(drafts) >= 1  # a winner accepted more drafts than the main block
      assert any(v and np.array_equal(cd[1:1 + len(drafts)], drafts)
                 for cd, v in zip(np.asarray(cands[r]), np.asarray(valid[r])))
      checked += 1
  assert checked > 0
  assert int(states[-1].mr.promotions.sum()) > 0
  assert int(max(s.mr.pacc.max() for s in states)) > 0  # some pseudo-accepted tokens
  plain = next(pf.generate_steps(model, MR_PROMPTS, decoder=J(n), max_new_tokens=max_new))
  assert plain.pending.kv.k.shape[2] == n and plain.guesses.shape == (len(MR_PROMPTS), n - 1)


def test_mr_compiles_once(model):
  rng = np.random.default_rng(3)
  dec = MR(4, num_blocks=2, pool_size=5, num_candidates=2, spawn_threshold=0.75)
  before = TRACES["JacobiMR"]
  for i in range(8):
    prompts = [list(rng.integers(0, 48, rng.integers(1, 17))) for _ in range(3)]
    pf.generate(model, prompts, decoder=dec, max_new_tokens=8, rng=jax.random.key(i),
                max_prompt_len=16)
  assert TRACES["JacobiMR"] - before == 1


@pytest.mark.fast
def test_pool_ring_and_both_lookup_rules():
  """The ring is a deque(maxlen=P) (deduplicated for "rejected_drafts"); "rejected_drafts"
  matches an entry's first token, "stream" the first occurrence anywhere but in the newest
  entry; a candidate starts with the pending token and runs on into the main block."""
  insert = jax.jit(recycling.insert, static_argnames="dedup")  # one compile, not one per op
  lookup = jax.jit(recycling.lookup, static_argnums=(3, 4))
  pool, ptr = jnp.full((2, 3, 2), -1, jnp.int32), jnp.zeros((2,), jnp.int32)
  yes, no = jnp.array([True, False]), jnp.array([False, False])
  for entry, ok in [([1, 2], yes), ([3, 4], yes), ([1, 2], yes),  # a duplicate: skipped
                    ([5, 6], no), ([5, 6], yes), ([7, 8], yes)]:  # [7, 8] evicts [1, 2]
    pool, ptr = insert(pool, ptr, jnp.array([entry, entry]), ok, dedup=True)
  np.testing.assert_array_equal(pool[0], [[7, 8], [3, 4], [5, 6]])
  np.testing.assert_array_equal(pool[1], -np.ones((3, 2)))
  np.testing.assert_array_equal(ptr, [4, 0])
  main = jnp.array([[5, 0], [5, 0]])
  cands, valid = lookup(pool, ptr, main, 2, "rejected_drafts")
  np.testing.assert_array_equal(cands, [[[5, 6], [5, 5]], [[5, 5], [5, 5]]])
  np.testing.assert_array_equal(valid, [[True, False], [False, False]])
  pool, ptr = insert(pool, ptr, jnp.array([[5, 9], [5, 9]]), yes)  # evicts [3, 4]
  cands, valid = lookup(pool, ptr, main, 2, "rejected_drafts")
  np.testing.assert_array_equal(cands[0], [[5, 9], [5, 6]])  # newest first
  np.testing.assert_array_equal(valid[0], [True, True])
  # "stream", pending token 7, main block [7 5 6], entries oldest to newest
  pool = jnp.array([[[1, 7, 2, 9, 7], [7, 3, -1, -1, -1], [0, 7, 5, 6, -1],  # a main copy
                     [4, 4, 4, -1, -1], [7, 8, 8, -1, -1]]])  # no 7; the newest, skipped
  ptr = jnp.array([5])
  cands, valid = lookup(pool, ptr, jnp.array([[7, 5, 6]]), 4, "stream")
  np.testing.assert_array_equal(cands[0], [[7, 3, 6], [7, 2, 9], [7, 7, 7], [7, 7, 7]])
  np.testing.assert_array_equal(valid[0], [True, True, False, False])


def _stream(drafts, ra_len, blocks, pacc, n=4):
  b = len(drafts)
  zeros = jnp.zeros((b,), jnp.int32)
  return mr.MRState(drafts=jnp.array(drafts), ra_len=jnp.array(ra_len), blocks=jnp.array(blocks),
                    pacc=jnp.array(pacc), pool=jnp.zeros((b, 0, n), jnp.int32), ptr=zeros,
                    wins=zeros, promotions=zeros)


@pytest.mark.fast
def test_advance_promotes_a_pseudo_block_to_drafts_of_the_real_active_block():
  """n = 4, K = 2: [pending | RA draft 10 | pseudo block 20 21 22 23 (20 pseudo-accepted)]."""
  m = _stream([[10, 20, 21, 22, 23, 0, 0]], [1], [1], [[1]])
  yes = jnp.array([True])
  # the RA accepts its last draft 10 and decides 99: the pseudo block is promoted, its first
  # token replaced by 99, the rest (21 converged; 22, 23 Jacobi-updated to 30, 31) are drafts
  g = jnp.array([[10, 99, 21, 30, 31, 32, 33, 34]])
  out = mr.advance(m, g, g[:, :4], jnp.array([1]), jnp.array([99]), yes, 4, 2, 2)
  np.testing.assert_array_equal(out.drafts, [[21, 30, 31, 99, 99, 99, 99]])
  assert (int(out.ra_len[0]), int(out.blocks[0]), int(out.promotions[0])) == (3, 0, 1)
  # the RA rejects 10 (decides 11): the block stays pseudo-active, 20 frozen despite the
  # argmax 99 before it, 21 now pseudo-accepted too
  g = g.at[0, 0].set(11)
  out = mr.advance(m, g, g[:, :4], jnp.array([0]), jnp.array([11]), yes, 4, 2, 2)
  np.testing.assert_array_equal(out.drafts, [[20, 21, 30, 31, 11, 11, 11]])
  assert (int(out.ra_len[0]), int(out.blocks[0]), int(out.promotions[0])) == (0, 1, 0)
  np.testing.assert_array_equal(out.pacc, [[2]])


@pytest.mark.fast
def test_spawn_clones_and_pads_the_real_active_block():
  """n = 4, K = 3, s = 2: row 0's RA [5 | 6 7] has 2 decided tokens (spawns), row 1's 1."""
  m = _stream([[6, 7] + [0] * 9, [6, 7, 8] + [0] * 8], [2, 3], [0, 0], [[0, 0], [0, 0]])
  out = mr.spawn(m, jnp.array([5, 5]), 4, 3, 2)
  np.testing.assert_array_equal(out.drafts[0], [6, 7, 5, 6, 7, 7, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(out.drafts[1], m.drafts[1])
  np.testing.assert_array_equal(out.blocks, [1, 0])


@pytest.mark.fast
def test_stream_entries_are_the_last_n_tokens_and_the_in_flight_drafts():
  """n = 4, K = 2 (entries of 11): row 0 emitted 1..5 (5 pending), RA draft 10, pseudo block
  20-23; row 1 emitted only 7, a fresh RA 30 31 32. Then each row's fresh RA drafts."""
  m = _stream([[10, 20, 21, 22, 23, 0, 0], [30, 31, 32, 0, 0, 0, 0]], [1, 3], [1, 0], [[1], [0]])
  tokens = jnp.array([[1, 2, 3, 4, 5, -1], [7, -1, -1, -1, -1, -1]])
  entries = jax.jit(recycling.stream_entries, static_argnums=3)
  stream, fresh = entries(m, tokens, jnp.array([5, 1]), 4)
  np.testing.assert_array_equal(stream, [[2, 3, 4, 5, 10, 20, 21, 22, 23, -1, -1],
                                         [7, 30, 31, 32] + [-1] * 7])
  np.testing.assert_array_equal(fresh, [[10] + [-1] * 10, [30, 31, 32] + [-1] * 8])


def test_the_old_name_of_the_stream_rule_still_builds_it_with_a_warning():
  """`recycling="released"` named paraflax's own rule as the authors' algorithm: it is
  "stream" now, and the old spelling builds the same decoder (one compilation) with a
  DeprecationWarning."""
  with pytest.warns(DeprecationWarning, match='renamed recycling="stream"'):
    old = pf.decoders.JacobiMR(4, pool_size=2, num_candidates=1, recycling="released")
  assert old == pf.decoders.JacobiMR(4, pool_size=2, num_candidates=1, recycling="stream")
  assert pf.decoders.JacobiMR().recycling == "stream"



# ---- the released loop's rules (`Jacobi(variant="released")`), each on a hand-worked case ----

@pytest.mark.fast
def test_released_blocks_go_on_to_their_end_then_start_from_context_draws():
  """n = 4, argmaxes [10 11 12 13]: a step that keeps 2 of a block with 3 guesses left goes
  on with 1 (the argmaxes after the decided token); one that accepts every guess left, or
  decides the block's last token, starts a new block of 3 drawn guesses."""
  argmax = jnp.array([[10, 11, 12, 13]] * 3)
  draws = jnp.array([[7, 8, 9]] * 3)
  guesses, left = jac.next_block(argmax, jnp.array([2, 2, 1]), jnp.array([3, 1, 0]), draws, 4)
  assert guesses.tolist() == [[12, 13, 13], [7, 8, 9], [7, 8, 9]]
  assert left.tolist() == [1, 3, 3]


@pytest.mark.fast
def test_context_draws_come_from_the_prompt_and_the_output_before_the_pending_token():
  prompts = jnp.array([[1, 2, 3, 0], [4, 5, 0, 0]])
  tokens = jnp.array([[20, 21, 22, -1], [30, 31, -1, -1]])
  key = jax.random.key(0)
  draws = jac.context_draws(key, prompts, jnp.array([3, 2]), tokens, jnp.array([2, 0]), 4000)
  assert set(draws[0].tolist()) == {1, 2, 3, 20, 21}  # not 22: the pending token
  assert set(draws[1].tolist()) == {4, 5}
  counts = np.bincount(np.asarray(draws[0]))[[1, 2, 3, 20, 21]]
  assert counts.min() > 700  # uniform over the 5 context tokens (800 each expected)
  again = jac.context_draws(key, prompts, jnp.array([3, 2]), tokens, jnp.array([2, 0]), 4000)
  assert (again == draws).all()  # the call's rng seeds them


def test_released_prefill_reads_draws_after_the_prompt_and_guesses_their_argmaxes(model):
  """Block 1 is the released prefill's: the argmax at the last prompt token (the first output
  token) and after each of the first n-1 tokens drawn from the prompt, read in one forward
  with the prompt; the cache keeps the prompt alone."""
  prompts = jnp.array([[5, 9, 2, 7, 0, 0], [7, 1, 1, 30, 4, 12]])
  lens = jnp.array([4, 6])
  fwd, key, n = st.Forward.of(model), jax.random.key(3), 4
  sub = jax.random.split(key)[1]  # what `init` draws with
  cache, logits = jac.prefill_with_draws(fwd, prompts, lens, 16, n, sub)
  argmax = jnp.argmax(logits, -1)
  draws = jac.context_draws(sub, prompts, lens, prompts, jnp.zeros_like(lens), n)
  assert cache.lengths.tolist() == [4, 6]
  for b in range(2):
    row = prompts[b, :lens[b]].tolist() + draws[b].tolist()
    logits = model(jnp.array([row]), jnp.arange(len(row))[None],
                   pf.masks.causal(jnp.array([len(row)]), len(row)))[0]
    want = jnp.argmax(logits[0, lens[b] - 1:lens[b] - 1 + n], -1)
    assert argmax[b].tolist() == want.tolist()
  state = pf.decoders.Jacobi(n, variant="released").init(fwd, None, prompts, lens, 8, key, -1)
  assert state.tokens[:, 0].tolist() == argmax[:, 0].tolist()
  assert state.guesses.tolist() == argmax[:, 1:].tolist() and state.left.tolist() == [3, 3]


def test_a_released_step_accepts_no_guess_past_its_blocks_end(model):
  """Guesses equal to greedy AR's continuation would all be accepted; with one guess left in
  the block the step keeps that one and the decided token, then starts a new block."""
  prompts, lens = jnp.array([PROMPTS[0]]), jnp.array([len(PROMPTS[0])])
  ar = pf.generate(model, [PROMPTS[0]], max_new_tokens=8).tokens[0]
  fwd, dec = st.Forward.of(model), pf.decoders.Jacobi(4, variant="released")
  state = dec.init(fwd, None, prompts, lens, 8, jax.random.key(0), -1)
  right = jnp.asarray(ar[1:4])[None]  # the three tokens after the first
  for left, kept in ((3, 4), (1, 2)):
    after = dec.step(fwd, None, state.replace(guesses=right, left=jnp.array([left])))
    assert after.lengths.tolist() == [1 + kept]
    assert after.tokens[0, :1 + kept].tolist() == ar[:1 + kept].tolist()
    assert after.left.tolist() == [3]  # the block ended: a new one of drawn guesses
