"""Prompt lookup: the vectorised match, greedy = AR, stochastic exactness, compile once."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paraflax as pf
from paraflax.decoding.generate import TRACES
from paraflax.decoding.prompt_lookup import lookup
from conftest import micro_model
from test_generate import reference_greedy
from test_verify import assert_samples_the_joint, enumerated_ar_joint

# repetitive prompts make lookups hit (accept path) and miss (reject path)
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3, 7, 1], [11, 11],
           [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3]]


def _lookup_reference(ctx, max_ngram, k):
  """Plain-Python prompt lookup (the HF algorithm) for one row."""
  for n in range(max_ngram, 0, -1):
    if len(ctx) <= n:
      continue
    suffix = ctx[-n:]
    for start in range(len(ctx) - n - 1, -1, -1):  # most recent earlier occurrence
      if ctx[start:start + n] == suffix:
        follow = ctx[start + n:start + n + k]
        return follow + [ctx[-1]] * (k - len(follow)), True
  return [ctx[-1]] * k, False


def test_vectorised_lookup_equals_the_python_reference():
  rng = np.random.default_rng(0)
  rows = [list(rng.integers(0, 4, rng.integers(1, 20))) for _ in range(200)]
  width = 24
  ctx = np.full((len(rows), width), -1, np.int32)
  for i, r in enumerate(rows):
    ctx[i, :len(r)] = r
  for max_ngram, k in [(1, 3), (3, 4), (4, 2)]:
    drafts, hit = lookup(jnp.asarray(ctx), jnp.array([len(r) for r in rows]), max_ngram, k)
    for i, r in enumerate(rows):
      want, want_hit = _lookup_reference([int(t) for t in r], max_ngram, k)
      assert drafts[i].tolist() == want and bool(hit[i]) == want_hit, (r, max_ngram)


@pytest.mark.fast
@pytest.mark.parametrize("max_ngram, k", [(3, 4), (1, 1), (2, 7)])
def test_greedy_equals_ar_for_every_row(model, max_ngram, k):
  dec = pf.decoders.PromptLookup(max_ngram=max_ngram, num_tokens=k)
  out = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=20)
  ar = pf.generate(model, PROMPTS, max_new_tokens=20)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  acc = np.asarray(out.accepted)
  assert acc.max() > 1 and np.any(acc == 1), "accept and reject paths both exercised"
  assert np.all(out.forwards + 1 <= out.lengths)  # never more forwards than tokens
  assert out.tokens[0].tolist() == reference_greedy(model, PROMPTS[0], 20)


def test_eos_and_loop_twin(model):
  dec = pf.decoders.PromptLookup(max_ngram=2, num_tokens=5)
  ar = pf.generate(model, PROMPTS, max_new_tokens=16)
  eos = int(ar.tokens[3, 6])
  a = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=16, eos_id=eos)
  b = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=16, eos_id=eos, loop="python")
  ar_eos = pf.generate(model, PROMPTS, max_new_tokens=16, eos_id=eos)
  np.testing.assert_array_equal(a.tokens, ar_eos.tokens)
  np.testing.assert_array_equal(a.lengths, ar_eos.lengths)
  for f in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_compiles_once(model):
  rng = np.random.default_rng(1)
  before = TRACES["PromptLookup"]
  for i in range(20):
    prompts = [list(rng.integers(0, 6, rng.integers(1, 17))) for _ in range(2)]
    pf.generate(model, prompts, decoder=pf.decoders.PromptLookup(3, 4, pf.Temperature(
        float(rng.uniform(0.5, 2)))), max_new_tokens=8, rng=jax.random.key(i), max_prompt_len=16)
  assert TRACES["PromptLookup"] - before == 1


@pytest.mark.fast
@pytest.mark.parametrize("dec, match", [
    (pf.decoders.PromptLookup(num_tokens=0), "num_tokens >= 1"),
    (pf.decoders.PromptLookup(max_ngram=0), "max_ngram >= 1"),
])
def test_bad_parameters_are_clear_errors(model, dec, match):
  with pytest.raises(ValueError, match=match):
    pf.generate(model, [[1, 2]], decoder=dec)


@pytest.mark.slow
def test_stochastic_prompt_lookup_samples_the_ar_joint(monkeypatch):
  """20k sampled continuations of a repetitive prompt vs the exactly enumerated joint; the
  same test rejects a verifier that resamples from p instead of the residual."""
  model = micro_model(vocab_size=6, seed=2, logit_std=2.2)
  sampler = pf.Temperature(1.0)
  prompt, n_new, rows, v = [1, 2, 1, 2, 1], 3, 20000, 6
  joint = enumerated_ar_joint(model, sampler, prompt, n_new)

  dec = pf.decoders.PromptLookup(max_ngram=2, num_tokens=2, sampler=sampler)

  def sample():
    out = pf.generate(model, [prompt] * rows, decoder=dec, max_new_tokens=n_new,
                      rng=jax.random.key(0))
    acc = np.asarray(out.accepted)
    # step 1 has room for 2 tokens: 1 means the draft was rejected, 2 that it was accepted
    assert np.any(acc[:, 0] == 1) and np.any(acc[:, 0] == 2)
    return np.ravel_multi_index(tuple(np.asarray(out.tokens).T), (v,) * n_new)

  assert_samples_the_joint(sample, joint, monkeypatch, "prompt lookup")
