"""Any-subset decoding with AS-ARMs: ASSD (self and n-gram drafts) against the sequential
any-order sampler. Greedy equality, Theorem 1 (model calls <= tokens), the enumerated joint
on a tiny vocabulary, compile once, clear errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_model
from test_verify import assert_samples_the_joint, chi_square_pvalue

import paraflax as pf
from paraflax.decoders import ASSD, AnyOrder
from paraflax.decoding.generate import TRACES
from paraflax.decoding.lattice import HOLE
from paraflax.model import masks


@pytest.fixture(scope="module")
def asarm():
  return micro_model(seed=4, two_stream=True)


def random_canvases(rng, b, n, vocab, low=0.05, high=0.95):
  """[B, N] rows with a random share of holes, at least one hole and one visible token."""
  rate = rng.uniform(low, high, (b, 1))
  canvas = rng.integers(0, vocab, (b, n))
  holes = rng.random((b, n)) < rate
  holes[np.arange(b), rng.integers(0, n, b)] = True
  keep = rng.integers(0, n, b)
  holes[np.arange(b), keep] = False
  holes[np.arange(b), (keep + 1 + rng.integers(0, n - 1, b)) % n] = True
  return np.where(holes, HOLE, canvas)


@pytest.mark.parametrize("draft", ["self", pytest.param("ngram", marks=pytest.mark.fast)])
def test_greedy_assd_equals_sequential_any_order_decoding(asarm, draft):
  canvas = random_canvases(np.random.default_rng(0), 6, 24, 48)
  seq = pf.infill(asarm, canvas)
  assert np.all(np.asarray(seq.calls) == (canvas == HOLE).sum(1))  # one call per token
  for k in (2, 5):
    out = pf.infill(asarm, canvas, ASSD(k, draft=draft))
    np.testing.assert_array_equal(out.tokens, seq.tokens)
    np.testing.assert_array_equal(np.asarray(out.tokens)[canvas != HOLE], canvas[canvas != HOLE])
    assert np.all(np.asarray(out.calls) <= np.asarray(out.holes))
  assert np.any(np.asarray(out.calls) < np.asarray(out.holes)), "drafts get accepted"


@pytest.mark.fast
def test_bigram_drafter_normalises_over_observed_bigrams_with_a_unigram_fallback():
  from paraflax.decoding.assd import bigram_probs
  canvas = jnp.array([[1, 2, 1, 3, 1, HOLE, 2, 2]] * 3)
  dist = np.asarray(bigram_probs(canvas, jnp.array([1, 4, HOLE]), 5))
  np.testing.assert_allclose(dist[0], [0, 0, 0.5, 0.5, 0])  # (1,2), (1,3); (1, hole) skipped
  unigram = np.array([0, 3, 3, 1, 0]) / 7  # 4 starts no bigram / no left neighbour
  np.testing.assert_allclose(dist[1], unigram)
  np.testing.assert_allclose(dist[2], unigram)
  two = np.asarray(bigram_probs(canvas, jnp.array([2, 2, 2]), 5))[0]
  np.testing.assert_allclose(two, [0, 0.5, 0.5, 0, 0])  # (2,1), (2,2); (2, hole) skipped


def test_theorem_1_model_calls_never_exceed_tokens(asarm):
  """Sampled fills of many random hole patterns: calls <= generated tokens on every row, and
  a self-draft iteration (draft + verify call) decides >= 2 tokens."""
  rng = np.random.default_rng(1)
  for i, (k, draft) in enumerate([(2, "self"), (3, "ngram"), (5, "self")]):
    canvas = random_canvases(rng, 16, 20, 48, low=0.05, high=1.0)
    dec = ASSD(k, draft=draft, sampler=pf.Temperature(float(rng.uniform(0.7, 1.5))))
    out = jax.device_get(pf.infill(asarm, canvas, dec, rng=jax.random.key(i)))
    assert np.all(out.calls <= out.holes), (k, draft, out.calls, out.holes)
    if draft == "self":  # every iteration but a lone last token verifies: 2 calls, >= 2 tokens
      assert np.all(out.calls <= 2 * out.iterations)
      assert np.all(out.holes >= 2 * out.iterations - 1)


def test_loop_twin_and_compile_once(asarm):
  rng = np.random.default_rng(2)
  canvas = random_canvases(rng, 4, 16, 48)
  dec = ASSD(4, sampler=pf.TopK(5, 1.2))
  a = pf.infill(asarm, canvas, dec, rng=jax.random.key(3))
  b = pf.infill(asarm, canvas, dec, rng=jax.random.key(3), loop="python")
  for f in ("tokens", "calls", "iterations"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  before = TRACES["ASSD"]
  for i in range(6):
    dec = ASSD(4, sampler=pf.Temperature(float(rng.uniform(0.5, 2))), epsilon=float(i % 2) / 10)
    pf.infill(asarm, random_canvases(rng, 4, 16, 48), dec, rng=jax.random.key(i))
  assert TRACES["ASSD"] - before == 1


@pytest.mark.fast
def test_bad_inputs_are_clear_errors(asarm, model):
  canvas = [[1, HOLE, 3]]
  with pytest.raises(ValueError, match="k >= 2"):
    pf.infill(asarm, canvas, ASSD(1))
  with pytest.raises(ValueError, match="draft must be one of"):
    pf.infill(asarm, canvas, ASSD(3, draft="bigram"))
  with pytest.raises(ValueError, match="epsilon >= 0"):
    pf.infill(asarm, canvas, ASSD(3, epsilon=-0.1))
  with pytest.raises(ValueError, match="no holes"):
    pf.infill(asarm, [[1, 2, 3], [1, HOLE, 2]], ASSD(3))
  with pytest.raises(ValueError, match="all holes"):
    pf.infill(asarm, [[HOLE, HOLE]], ASSD(3))
  with pytest.raises(ValueError, match="max_seq_len 128"):
    pf.infill(asarm, [[1] + [HOLE] * 200], ASSD(3))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    pf.infill(asarm, [[1, HOLE, 48]], ASSD(3))
  with pytest.raises(ValueError, match="equal length"):
    pf.infill(asarm, [[1, HOLE], [1, HOLE, 2]])
  with pytest.raises(ValueError, match="two_stream=True"):
    pf.infill(model, canvas, ASSD(3))
  sampled = ASSD(3, sampler=pf.Temperature(1.0))
  with jax.transfer_guard("disallow"):
    with pytest.raises(ValueError, match="ASSD with Temperature samples: pass rng="):
      pf.infill(asarm, canvas, sampled)
    with pytest.raises(ValueError, match="not the int 7"):
      pf.infill(asarm, canvas, sampled, rng=7)


def enumerated_infill_joint(model, sampler, canvas):
  """Exact probability of every filling of `canvas`'s holes under the model's lattice-order
  conditionals (sampler-warped): [V**H] in `np.ravel_multi_index` order."""
  v = model.cfg.vocab_size
  holes = np.flatnonzero(np.asarray(canvas) == HOLE)
  fills = np.array(list(itertools.product(range(v), repeat=len(holes))))
  full = np.broadcast_to(np.asarray(canvas), (len(fills), len(canvas))).copy()
  full[:, holes] = fills
  visible = jnp.asarray(np.asarray(canvas) != HOLE)[None].repeat(len(fills), 0)
  content, query = masks.lattice(visible)
  pos = jnp.broadcast_to(jnp.arange(len(canvas)), full.shape)
  logits, _ = model(jnp.asarray(full), pos, content, queries=pf.Queries(pos, query))
  probs = np.asarray(sampler.probs(logits[:, holes]), np.float64)  # [F, H, V]
  return np.prod(np.take_along_axis(probs, fills[..., None], -1)[..., 0], -1)


@pytest.mark.slow
@pytest.mark.parametrize("decoder", [AnyOrder, lambda s: ASSD(3, sampler=s),
                                     lambda s: ASSD(3, draft="ngram", sampler=s)],
                         ids=["sequential", "assd_self", "assd_ngram"])
def test_sampled_fills_follow_the_enumerated_joint(monkeypatch, decoder):
  """20k fills of one pattern (4 holes, vocabulary 5) vs the exact joint; for ASSD the same
  test rejects a verifier that resamples from p instead of the residual."""
  model = micro_model(vocab_size=5, seed=6, logit_std=2.0, two_stream=True)
  sampler = pf.Temperature(1.0)
  canvas = [1, HOLE, HOLE, 3, HOLE, HOLE, 2]  # n-gram drafts see the bigrams (1, ?), (3, ?)
  joint = enumerated_infill_joint(model, sampler, canvas)
  holes = [i for i, t in enumerate(canvas) if t == HOLE]
  dec = decoder(sampler)

  def sample():
    out = jax.device_get(pf.infill(model, [canvas] * 20000, dec, rng=jax.random.key(0)))
    assert np.all(out.calls <= out.holes)
    if not isinstance(dec, AnyOrder):
      assert out.calls.min() < 4 and out.calls.max() == 4, np.bincount(out.calls)
    return np.ravel_multi_index(tuple(out.tokens[:, holes].T), (5,) * 4)

  if isinstance(dec, AnyOrder):
    assert chi_square_pvalue(sample(), joint) > 1e-3
  else:
    assert_samples_the_joint(sample, joint, monkeypatch, f"ASSD {dec.draft}")
