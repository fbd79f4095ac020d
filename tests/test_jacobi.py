"""Greedy Jacobi decoding: token-for-token greedy AR for every row and block size."""

import jax
import numpy as np
import pytest

import paraflax as pf
from paraflax.decoding.generate import TRACES
from test_generate import reference_greedy

PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3, 7, 1], [11, 11]]

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_jacobi_equals_greedy_ar_for_every_row(model, block_size):
  out = pf.generate(model, PROMPTS, decoder=pf.decoders.Jacobi(block_size), max_new_tokens=24)
  ar = pf.generate(model, PROMPTS, max_new_tokens=24)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, ar.lengths)
  assert np.all(out.forwards + 1 <= out.lengths)
  if block_size > 1:  # some guesses converged and some did not
    acc = np.asarray(out.accepted)
    assert acc.max() > 1 and np.any(acc == 1)


def test_jacobi_matches_the_no_cache_reference_with_eos_and_loop_twin(model):
  ar = pf.generate(model, PROMPTS, max_new_tokens=16)
  eos = int(ar.tokens[0, 5])
  kw = dict(decoder=pf.decoders.Jacobi(4), max_new_tokens=16, eos_id=eos)
  a = pf.generate(model, PROMPTS, **kw)
  b = pf.generate(model, PROMPTS, loop="python", **kw)
  np.testing.assert_array_equal(a.tokens, pf.generate(model, PROMPTS, max_new_tokens=16,
                                                      eos_id=eos).tokens)
  for f in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  assert pf.generate(model, [PROMPTS[1]], decoder=pf.decoders.Jacobi(4),
                     max_new_tokens=12).tokens[0].tolist() == reference_greedy(model, PROMPTS[1], 12)


def test_jacobi_compiles_once(model):
  rng = np.random.default_rng(2)
  before = TRACES["Jacobi"]
  for i in range(20):
    prompts = [list(rng.integers(0, 48, rng.integers(1, 17))) for _ in range(3)]
    pf.generate(model, prompts, decoder=pf.decoders.Jacobi(4), max_new_tokens=8,
                rng=jax.random.key(i), max_prompt_len=16)
  assert TRACES["Jacobi"] - before == 1


@pytest.mark.parametrize("dec, match", [
    (pf.decoders.Jacobi(0), "block_size >= 1"),
    (pf.decoders.Jacobi(4, pf.Temperature(0.7)), "Jacobi decoding is greedy"),
])
def test_bad_parameters_are_clear_errors(model, dec, match):
  with pytest.raises(ValueError, match=match):
    pf.generate(model, [[1, 2]], decoder=dec)
