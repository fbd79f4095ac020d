"""Several decode steps per `while_loop` iteration (`steps_per_iter`): every decoder's output,
counts and acceptance trace are those of one step per iteration and of the Python-loop twin,
greedy equals AR, sampling draws the same tokens, one compile per setting, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.decoding import core
from paraflax.decoding import state as st
from conftest import micro_model

PROMPTS = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3], [11], [3, 4, 3, 4, 3, 4, 3]]
N_NEW = 12  # 11 steps at most: the last iteration of four steps idles in its last
MR = pf.decoders.JacobiMR(4, num_blocks=2, pool_size=4, num_candidates=2)
FIELDS = ("tokens", "lengths", "forwards", "draft_forwards", "accepted")


@pytest.fixture(scope="module")
def models(model):
  """The session's micro model with a mask token (for TiDAR; same weights), and a DEER
  drafter for it."""
  cfg = dataclasses.replace(model.cfg, mask_token_id=47)
  target = nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0)))
  nnx.update(target, nnx.state(model))
  return target, micro_model(seed=12, d_model=16, n_layers=1, mask_token_id=46, sep_token_id=47)


def decoder_case(name, models):
  """(decoder, draft_model) of each greedy decoder; Speculative drafts with the target itself,
  so every draft is accepted and rows end inside an iteration."""
  target, deer_drafter = models
  return {"ar": (pf.decoders.AR(), None), "jacobi": (pf.decoders.Jacobi(4), None),
          "jacobi-mr": (MR, None), "prompt-lookup": (pf.decoders.PromptLookup(3, 4), None),
          "speculative": (pf.decoders.Speculative(3), target),
          "deer": (pf.decoders.DEER(3), deer_drafter),
          "tidar": (pf.decoders.TiDAR(3), None)}[name]


@pytest.mark.parametrize("name", [  # the fast tier: one drafter of each kind, and TiDAR
    "ar", "jacobi", "jacobi-mr", "prompt-lookup",
    *(pytest.param(n, marks=pytest.mark.fast) for n in ("speculative", "deer", "tidar"))])
def test_four_steps_per_iteration_equal_ar_and_the_python_loop(models, name):
  """Four, what a GPU or TPU runs (`core.resolve_steps_per_iter`)."""
  target = models[0]
  decoder, draft = decoder_case(name, models)
  free = pf.generate(target, PROMPTS, max_new_tokens=N_NEW)
  eos = int(free.tokens[1, 5])  # row 1 ends early, the others run on
  kw = dict(decoder=decoder, max_new_tokens=N_NEW, eos_id=eos, draft_model=draft)
  ar = pf.generate(target, PROMPTS, max_new_tokens=N_NEW, eos_id=eos)
  out = pf.generate(target, PROMPTS, steps_per_iter=4, **kw)
  twin = pf.generate(target, PROMPTS, loop="python", **kw)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, ar.lengths)
  assert int(out.lengths[1]) < N_NEW
  for f in FIELDS:  # forwards count the real forwards: none for a done row
    np.testing.assert_array_equal(getattr(out, f), getattr(twin, f), err_msg=f)
  assert np.all(np.asarray(out.lengths) <= N_NEW)


def _on_tpu(model):
  """A copy of `model` run as on a TPU (`RunControl(platform="tpu")`), on this machine."""
  copy = nnx.eval_shape(lambda: pf.Transformer(model.cfg, rngs=nnx.Rngs(0),
                                               run=pf.RunControl(platform="tpu")))
  nnx.update(copy, nnx.state(model))
  return copy


@pytest.mark.parametrize("name", [
    *(pytest.param(n, marks=pytest.mark.fast) for n in ("jacobi", "jacobi-mr", "prompt-lookup")),
    "speculative", "deer", "tidar"])
def test_a_tpu_loop_writes_its_windows_unread_and_equals_ar(models, name):
  """Run as on a TPU, a loop's cache commits by windows and has `TPU_SPARE` spare slots, so
  each step writes its window whole, past what it keeps (`cache.commit`): the tokens are
  still greedy AR's."""
  target = models[0]
  decoder, draft = decoder_case(name, models)
  eos = int(pf.generate(target, PROMPTS, max_new_tokens=N_NEW).tokens[1, 5])
  ar = pf.generate(target, PROMPTS, max_new_tokens=N_NEW, eos_id=eos)
  out = pf.generate(_on_tpu(target), PROMPTS, decoder=decoder, max_new_tokens=N_NEW,
                    eos_id=eos, draft_model=None if draft is None else _on_tpu(draft))
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, ar.lengths)


@pytest.mark.parametrize("name", ["ar", "tidar"])  # TiDAR keeps its drafts' q in the state
def test_sampling_draws_the_same_tokens_at_any_steps_per_iter(models, name):
  decoder, draft = decoder_case(name, models)
  decoder = dataclasses.replace(decoder, sampler=pf.TopP(0.9, temperature=1.3))
  kw = dict(decoder=decoder, max_new_tokens=N_NEW, draft_model=draft, rng=jax.random.key(3))
  one, *more = (pf.generate(models[0], PROMPTS, steps_per_iter=n, **kw) for n in (1, 2, 4))
  for out in more:
    for f in FIELDS:
      np.testing.assert_array_equal(getattr(out, f), getattr(one, f), err_msg=f)


@pytest.mark.fast
def test_the_setting_per_backend_its_bounds_and_bad_values(monkeypatch):
  ar = pf.decoders.AR()
  assert core.resolve_steps_per_iter(None, ar, 64) == (1 if jax.default_backend() == "cpu" else 4)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert core.resolve_steps_per_iter(None, ar, 64) == core.STEPS_PER_ITER_ACCELERATOR > 1
  assert core.resolve_steps_per_iter(8, ar, 3) == 2  # never more than the loop's step budget
  for bad in (0, 2.0, True, "4"):
    with pytest.raises(ValueError, match="steps_per_iter must be an int >= 1 or None"):
      core.resolve_steps_per_iter(bad, ar, 64)
  with pytest.raises(ValueError, match="steps_per_iter must be an int >= 1 or None"):
    pf.generate(None, [[1]], steps_per_iter=0)  # before the model is even looked at


@pytest.mark.fast
def test_generate_fn_takes_the_setting(models):
  target = models[0]
  run = jax.jit(pf.generate_fn(target, max_new_tokens=N_NEW, eos_id=7, steps_per_iter=2))
  prompts = np.asarray([[5, 9, 2, 0], [7, 1, 30, 4]], np.int32)
  out = run(nnx.state(target), prompts, np.asarray([3, 4], np.int32), jax.random.key(0))
  ref = pf.generate(target, prompts, max_new_tokens=N_NEW, eos_id=7, prompt_lengths=[3, 4],
                    max_prompt_len=4)
  for f in FIELDS:
    np.testing.assert_array_equal(getattr(out, f), getattr(ref, f), err_msg=f)


def _equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs in its equations' parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns"):
          yield from _equations(sub)


def test_float32_weights_of_a_bf16_model_are_cast_once_before_the_loop(model):
  """A trained workdir's float32 parameters decoded in bf16: no step casts a weight, and the
  tokens are those of the same weights stored in bf16."""
  wide = pf.Transformer(dataclasses.replace(model.cfg, dtype="bfloat16"), rngs=nnx.Rngs(0))
  nnx.update(wide, nnx.state(model))
  fwd = st.Forward.of(wide)
  prompts, lens = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 3, jnp.int32)
  jaxpr = jax.make_jaxpr(lambda f, key: core.decode_loop(
      f, None, pf.decoders.Jacobi(4), prompts, lens, key, np.full((1,), -1, np.int32), 8))(
          fwd, jax.random.key(0))
  loop, = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while"]
  weights = {w.shape for w in jax.tree.leaves(fwd.params)}
  casts = [e for e in _equations(loop.params["body_jaxpr"].jaxpr)
           if e.primitive.name == "convert_element_type" and e.invars[0].aval.shape in weights
           and e.invars[0].aval.dtype == np.float32]
  assert casts == []
  narrow = nnx.eval_shape(lambda: pf.Transformer(
      dataclasses.replace(wide.cfg, param_dtype="bfloat16"), rngs=nnx.Rngs(0)))
  nnx.update(narrow, jax.tree.map(lambda w: w.astype(jnp.bfloat16), nnx.state(model)))
  kw = dict(decoder=pf.decoders.Jacobi(4), max_new_tokens=N_NEW)
  np.testing.assert_array_equal(pf.generate(wide, PROMPTS, **kw).tokens,
                                pf.generate(narrow, PROMPTS, **kw).tokens)
