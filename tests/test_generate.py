"""AR generate: exact vs a no-cache reference, batch = rows alone, while = Python loop,
compile once, EOS handling, sampled joint by enumeration, and clear input errors."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_model
from flax import nnx
from test_verify import chi_square_pvalue, enumerated_ar_joint

import paraflax as pf
from paraflax.decoding.generate import TRACES
from paraflax.model import masks

PROMPTS = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3], [11]]


def reference_greedy(model, prompt, n):
  """Greedy decoding by full recomputation of the whole sequence each token: no cache, one
  row (right padding to a fixed width is invisible to the causal mask)."""
  graphdef, params = nnx.split(model)
  w = len(prompt) + n

  @jax.jit
  def next_token(seq, t):
    mask = masks.causal(t[None], w)
    logits, _ = nnx.merge(graphdef, params)(seq[None], jnp.arange(w)[None], mask)
    return jnp.argmax(logits[0, t - 1])

  seq = np.zeros(w, np.int32)
  seq[:len(prompt)] = prompt
  for t in range(len(prompt), w):
    seq[t] = next_token(seq, jnp.int32(t))
  return seq[len(prompt):].tolist()


@pytest.mark.fast
def test_greedy_equals_no_cache_reference_for_every_row_of_a_ragged_batch(model):
  out = pf.generate(model, PROMPTS, max_new_tokens=12)
  for row, prompt in enumerate(PROMPTS):
    assert out.tokens[row].tolist() == reference_greedy(model, prompt, 12)
  np.testing.assert_array_equal(out.lengths, [12, 12, 12])
  np.testing.assert_array_equal(out.forwards, [11, 11, 11])  # prefill not counted
  np.testing.assert_array_equal(out.prefill_forwards, [1, 1, 1])


def test_batch_rows_equal_each_prompt_alone(model):
  batch = pf.generate(model, PROMPTS, max_new_tokens=10)
  for row, prompt in enumerate(PROMPTS):
    alone = pf.generate(model, [prompt], max_new_tokens=10)
    np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])


@pytest.mark.parametrize("sampler", [pf.Greedy(), pf.TopP(0.9, temperature=0.8)])
def test_while_loop_and_python_loop_agree(model, sampler):
  kw = dict(decoder=pf.decoders.AR(sampler), max_new_tokens=9, rng=jax.random.key(4), eos_id=7)
  a = pf.generate(model, PROMPTS, **kw)
  b = pf.generate(model, PROMPTS, loop="python", **kw)
  for field in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  states = list(pf.generate_steps(model, PROMPTS, **kw))
  assert len(states) - 1 == int(np.sum(np.any(np.asarray(a.accepted) > 0, 0)))  # + the prefill


@pytest.mark.fast
@pytest.mark.parametrize("steps_per_iter", [1, 2])
def test_twenty_calls_with_new_prompts_seeds_and_temperatures_compile_once(model, steps_per_iter):
  rng = np.random.default_rng(0)
  before = TRACES["AR"]
  for i in range(20):
    prompts = [list(rng.integers(0, 48, rng.integers(1, 17))) for _ in range(3)]
    sampler = pf.TopK(k=int(rng.integers(1, 10)), temperature=float(rng.uniform(0.5, 1.5)))
    pf.generate(model, prompts, decoder=pf.decoders.AR(sampler), max_new_tokens=6,
                rng=jax.random.key(i), eos_id=int(rng.integers(0, 48)), max_prompt_len=16,
                steps_per_iter=steps_per_iter)
  assert TRACES["AR"] - before == 1


@pytest.mark.fast
def test_eos_ends_a_row_and_is_counted(model):
  free = pf.generate(model, PROMPTS, max_new_tokens=12)
  eos = int(free.tokens[1, 4])  # row 1 emits this token first at index <= 4
  first = free.tokens[1].tolist().index(eos)
  out = pf.generate(model, PROMPTS, max_new_tokens=12, eos_id=eos)
  assert out.lengths[1] == first + 1
  assert out.tokens[1, :first + 1].tolist() == free.tokens[1, :first + 1].tolist()
  assert np.all(np.asarray(out.tokens[1, first + 1:]) == -1)
  assert out.forwards[1] == first  # no forward after the EOS
  for row in range(3):  # rows never emit a token past their length
    assert np.all(np.asarray(out.tokens[row, out.lengths[row]:]) == -1)


@pytest.mark.fast
def test_single_new_token_needs_no_forward(model):
  out = pf.generate(model, PROMPTS, max_new_tokens=1)
  np.testing.assert_array_equal(out.forwards, [0, 0, 0])
  assert out.tokens[:, 0].tolist() == [reference_greedy(model, p, 1)[0] for p in PROMPTS]


@pytest.mark.fast
def test_padded_array_prompts_with_lengths(model):
  arr = np.zeros((3, 10), np.int32)
  for i, p in enumerate(PROMPTS):
    arr[i, :len(p)] = p
  a = pf.generate(model, arr, prompt_lengths=[len(p) for p in PROMPTS], max_new_tokens=5)
  b = pf.generate(model, PROMPTS, max_new_tokens=5)
  np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.slow
def test_sampled_ar_matches_the_enumerated_joint():
  """20k sampled continuations vs the exact joint of 3 tokens (top-k + temperature warp)."""
  model = micro_model(vocab_size=8, seed=1, logit_std=2.2)
  sampler = pf.TopK(k=5, temperature=0.9)
  prompt, n_new, rows = [3, 1], 3, 20000

  joint = enumerated_ar_joint(model, sampler, prompt, n_new)
  assert abs(joint.sum() - 1) < 1e-4

  def sample(s):
    out = pf.generate(model, [prompt] * rows, decoder=pf.decoders.AR(s), max_new_tokens=n_new,
                      rng=jax.random.key(0))
    return np.ravel_multi_index(tuple(np.asarray(out.tokens).T), (8,) * n_new)

  pvalue = chi_square_pvalue(sample(sampler), joint)
  assert pvalue > 1e-3, f"sampled AR deviates from the enumerated joint (p={pvalue:.2e})"
  wrong = chi_square_pvalue(sample(pf.TopK(k=5, temperature=1.3)), joint)
  assert wrong < 1e-6, f"the test cannot tell a different temperature apart (p={wrong:.2e})"


@pytest.mark.fast
@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1, 2], []]), "empty prompt at batch rows \\[1\\]"),
    (dict(prompts=[]), "at least one prompt"),
    (dict(prompts=[[1] * 20], max_prompt_len=16), "longer than the prompt buffer"),
    (dict(prompts=[[1, 48]]), "outside the vocabulary"),
    (dict(prompts=[[1, -1]]), "outside the vocabulary"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(prompts=[[1] * 100], max_new_tokens=40), "exceeds the model's max_seq_len"),
    (dict(prompts=[[1]], eos_id=99), "eos_id 99 is outside"),
    (dict(prompts=[[1]], decoder=pf.decoders.AR(pf.Temperature(0.0))), "temperature must be > 0"),
    (dict(prompts=[[1]], decoder=pf.decoders.AR(pf.TopP(1.5))), "top-p needs"),
    (dict(prompts=[[1]], decoder=pf.decoders.AR(pf.TopK(0))), "top-k needs k >= 1"),
    (dict(prompts=[[1]], loop="scan"), "loop must be"),
    # no silent guesses: 1.7 is not token 1, True is not 1, a flat list is not a batch
    (dict(prompts=[[5, 9], [3, 1.7]]), "prompt row 1 holds 1.7 \\(float\\) at position 1"),
    (dict(prompts=[[5, True]]), "prompt row 0 holds True \\(bool\\)"),
    (dict(prompts=np.array([[5.0, 9.0]])), "integer token ids, got a float64 array"),
    (dict(prompts=[np.array([5.0])]), "prompt row 0 must hold integer token ids"),
    (dict(prompts=[[1]], max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
    (dict(prompts=[[1]], max_new_tokens=4.0), "max_new_tokens must be an int >= 1, got 4.0"),
    (dict(prompts=[5, 6, 7]), "prompts must be a list of token-id lists.*row 0 is int 5"),
    (dict(prompts="def f():"), "prompts must be a list of token-id lists.*got str"),
    (dict(prompts=np.array([5, 6])), "prompts must be a list of token-id lists.*shape \\(2,\\)"),
    (dict(prompts=[[1]], eos_id=2.0), "eos_id must be an int or None, got 2.0"),
    (dict(prompts=[[1]], eos_id=True), "eos_id must be an int or None, got True"),
    (dict(prompts=[[1]], max_prompt_len=8.0), "max_prompt_len must be an int >= 1"),
    (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[1.5, 2]), "prompt_lengths must be ints"),
    (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[1, True]), "prompt_lengths must be ints"),
    # a sampler needs a key: without one every call would give the same "samples"
    (dict(prompts=[[1]], max_new_tokens=4, decoder=pf.decoders.AR(pf.TopK(5))),
     "AR with TopK samples: pass rng=jax.random.key\\(seed\\)"),
    (dict(prompts=[[1]], max_new_tokens=4, rng=3), "rng must be a JAX key: pass rng=jax.random.key\\(3\\)"),
    (dict(prompts=[[1]], max_new_tokens=4, rng="0"), "rng must be a JAX key"),
    (dict(prompts=[[1]], max_new_tokens=4, rng=np.zeros(3, np.float32)), "rng must be a JAX key"),
])
def test_bad_input_is_a_clear_error_before_device_work(model, kwargs, match):
  prompts = kwargs.pop("prompts")
  with jax.transfer_guard("disallow"), pytest.raises(ValueError, match=match) as err:
    pf.generate(model, prompts, **kwargs)
  assert "\n" not in str(err.value)


@pytest.mark.fast
@pytest.mark.parametrize("make", [lambda: jax.random.split(jax.random.key(0), 2),
                                  lambda: jax.random.split(jax.random.PRNGKey(0), 2)])
def test_a_batch_of_keys_is_refused(model, make):
  keys = make()
  sampled = pf.decoders.AR(pf.Temperature(1.0))
  with jax.transfer_guard("disallow"), pytest.raises(ValueError, match="rng must be one key"):
    pf.generate(model, [[1], [2]], sampled, max_new_tokens=4, rng=keys)


@pytest.mark.fast
def test_raw_and_typed_keys_give_the_same_samples(model):
  """`jax.random.PRNGKey(s)` is accepted as the same stream as `jax.random.key(s)`."""
  kw = dict(decoder=pf.decoders.AR(pf.TopP(0.9, temperature=0.8)), max_new_tokens=9, eos_id=7)
  typed = pf.generate(model, PROMPTS, rng=jax.random.key(4), **kw)
  raw = pf.generate(model, PROMPTS, rng=jax.random.PRNGKey(4), **kw)
  np.testing.assert_array_equal(typed.tokens, raw.tokens)
  other = pf.generate(model, PROMPTS, rng=jax.random.key(5), **kw)
  assert not np.array_equal(typed.tokens, other.tokens)


@pytest.mark.fast
def test_draft_model_is_refused_by_ar(model):
  with pytest.raises(ValueError, match="does not use a draft_model"):
    pf.generate(model, [[1]], draft_model=model)


@pytest.mark.fast
@pytest.mark.parametrize("decoder, draft, new, match", [
    (pf.decoders.Jacobi(block_size=129), False, 4, "Jacobi block_size=129 does not fit the "
     "model's max_seq_len 128: a step works on 129 tokens at once"),
    (pf.decoders.JacobiMR(block_size=32, num_blocks=2, pool_size=4, num_candidates=3), False, 4,
     r"JacobiMR \(num_blocks \+ num_candidates\) \* block_size = 160 does not fit"),
    (pf.decoders.PromptLookup(num_tokens=128), False, 4, "num_tokens=128 does not fit the model's"),
    (pf.decoders.PromptLookup(max_ngram=500), False, 4, "max_ngram=500 does not fit the model's"),
    (pf.decoders.Speculative(128), True, 4, "Speculative block_size=128 does not fit the model's"),
    (pf.decoders.Speculative(100), "short", 4, "block_size=100 does not fit the drafter's "
     "max_seq_len 64: a step works on 101 tokens at once"),
    (pf.decoders.Speculative(2), "short", 100, r"prompt \(1 tokens\) \+ max_new_tokens \(100\) "
     "exceeds the drafter's max_seq_len 64"),
])
def test_a_step_larger_than_the_context_is_refused_on_the_host(model, decoder, draft, new, match):
  """Block, draft length, n-gram length, candidates and the drafter's context against
  max_seq_len: one line before any device work, never a step of thousands of positions the
  model cannot hold. A block larger than max_new_tokens stays valid (decoded exactly by
  test_byo_recipes' jacobi runs)."""
  import dataclasses

  from paraflax.decoding.core import check_setup
  check_setup(model.cfg, pf.decoders.Jacobi(block_size=128), 2, None, None)
  drafter = None
  if draft:  # the graph only: the checks read configs
    cfg = model.cfg if draft is True else dataclasses.replace(model.cfg, max_seq_len=64)
    drafter = nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0)))
  with jax.transfer_guard("disallow"), pytest.raises(ValueError, match=match):
    pf.generate(model, [[1]], decoder=decoder, max_new_tokens=new, draft_model=drafter)


@pytest.mark.fast
def test_a_prefill_heads_only_the_rows_it_reads(model):
  """`Forward.at`: logits at the asked rows equal the full forward's there (float32), its keys
  and values too, and a compiled prefill holds no `[B, P, V]` logits."""
  from paraflax.decoding import state as st
  fwd = st.Forward.of(model)
  b, p = 2, 24
  tokens = jax.random.randint(jax.random.key(0), (b, p), 0, model.cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  mask = masks.causal(jnp.array([24, 9]), p)
  rows = jnp.array([[23, 0, 5], [8, 8, 2]])
  logits, kv = fwd(tokens, positions, mask)
  picked, picked_kv = fwd.at(tokens, positions, mask, rows)
  np.testing.assert_allclose(picked, jnp.take_along_axis(logits, rows[:, :, None], 1),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(picked_kv.k, kv.k)
  text = jax.jit(lambda *a: st.prefill(fwd, *a, 32)).lower(tokens, jnp.array([24, 9])).as_text()
  assert f"{b}x{p}x{model.cfg.vocab_size}xf32" not in text
