"""TiDAR: the training mask and losses, greedy = AR (beta = 1) on a ragged batch, stochastic
exactness by enumeration (AR joint at beta = 1, the mixed joint at beta < 1), commits,
compile once, clear errors."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_generate import reference_greedy
from test_verify import assert_samples_the_joint

import paraflax as pf
from paraflax.decoding.generate import TRACES
from paraflax.model import masks
from paraflax.training import get_objective, load_config
from paraflax.training.config.recipes import RECIPES
from paraflax.training.objectives.protocol import cross_entropy
from paraflax.training.objectives.tidar import doubled, tidar_loss
from conftest import compiled_forward, micro_model

V = 48
MASK = V - 1  # arithmetic progressions mod V - 1 never contain it


def _a(rows):
  return np.array([[c == "1" for c in r.replace(" ", "")] for r in rows])


def progressions(rng, b, length):
  """Rows x_t = (a + s t) mod (V - 1), s in {1, 2, 3}: a rule a diffusion block can learn."""
  a, s = rng.integers(0, V - 1, (b, 1)), rng.integers(1, 4, (b, 1))
  return ((a + s * np.arange(length)) % (V - 1)).astype(np.int32)


@pytest.fixture(scope="module")
def raw():
  """An untrained micro model with a mask token: drafts are mostly rejected."""
  return micro_model(mask_token_id=MASK)


@pytest.fixture(scope="module")
def trained():
  """A micro model trained with the tidar objective (block sizes 2, 4, 8) on progressions, so
  that drafts are often accepted; returns (model, first metrics, last metrics)."""
  model = micro_model(mask_token_id=MASK)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(3e-3)
  loss_fn = get_objective("tidar", {"block_size": [2, 4, 8]})

  @jax.jit
  def step(params, opt, tokens, key):
    grad_fn = jax.value_and_grad(
        lambda p: loss_fn(nnx.merge(graphdef, p, rest), {"tokens": tokens}, key), has_aux=True)
    (_, metrics), grads = grad_fn(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, metrics

  rng, opt, history = np.random.default_rng(0), tx.init(params), []
  for i in range(250):
    params, opt, metrics = step(params, opt, progressions(rng, 16, 32), jax.random.key(i))
    history.append(metrics)
  return nnx.merge(graphdef, params, rest), history[0], history[-1]


# ---- training ----

@pytest.mark.fast
def test_training_mask_equals_a_hand_built_one():
  """L = 6, block size 2 (row 0) and 4 (row 1, last block short): clean causal; a block of
  mask slots sees itself and the clean tokens strictly before its first position."""
  got = masks.tidar_train(6, jnp.array([2, 4]))
  c = ["100000 000000", "110000 000000", "111000 000000", "111100 000000", "111110 000000",
       "111111 000000"]
  np.testing.assert_array_equal(got[0], _a(c + [
      "000000 110000", "000000 110000",
      "110000 001100", "110000 001100",
      "111100 000011", "111100 000011"]))
  np.testing.assert_array_equal(got[1], _a(c + [
      "000000 111100", "000000 111100", "000000 111100", "000000 111100",
      "111100 000011", "111100 000011"]))


@pytest.mark.fast
def test_loss_is_the_weighted_mean_of_shifted_ar_and_unshifted_diffusion_terms(raw):
  tokens = jnp.asarray(progressions(np.random.default_rng(1), 2, 12))
  loss, m = jax.jit(lambda t: tidar_loss(raw, {"tokens": t}, jax.random.key(0), block_size=4,
                                         alpha=3.0))(tokens)
  full, pos = doubled(tokens, MASK)
  assert full[:, 12:].tolist() == [[MASK] * 12] * 2 and pos[:, 12:].tolist() == pos[:, :12].tolist()
  logits, _ = jax.jit(raw)(full, pos, masks.tidar_train(12, jnp.array([4, 4])))
  ar, _ = cross_entropy(logits[:, :11], tokens[:, 1:])
  diff, _ = cross_entropy(logits[:, 12:], tokens)
  np.testing.assert_allclose([m["ar_loss"], m["diff_loss"], loss],
                             [ar, diff, (3 * ar + diff) / 4], rtol=1e-5)


@pytest.mark.fast
def test_diffusion_slots_see_only_the_clean_prefix_before_their_block(raw):
  """Block size 4, L = 12: changing x_8.. changes no slot (slot i, labelled x_i, never sees
  a token at or after its block's start); changing x_7 changes block [8, 12) only."""
  tokens = jnp.asarray(progressions(np.random.default_rng(2), 1, 12))
  mask = masks.tidar_train(12, jnp.array([4]))
  fwd = jax.jit(lambda t: raw(*doubled(t, MASK), mask)[0])
  a = fwd(tokens)
  b = fwd(tokens.at[:, 8:].set((tokens[:, 8:] + 5) % (V - 1)))
  np.testing.assert_array_equal(a[:, :8], b[:, :8])  # clean half: causal
  np.testing.assert_array_equal(a[:, 12:], b[:, 12:])
  c = fwd(tokens.at[:, 7].set((tokens[:, 7] + 5) % (V - 1)))
  np.testing.assert_array_equal(a[:, 12:20], c[:, 12:20])
  assert float(jnp.min(jnp.max(jnp.abs(a[:, 20:] - c[:, 20:]), -1))) > 1e-3


def test_objective_trains_both_modes(trained):
  _, first, last = trained
  assert float(last["ar_loss"]) < 0.5 * float(first["ar_loss"])
  assert float(last["diff_accuracy"]) > 0.5 > float(first["diff_accuracy"])


@pytest.mark.fast
def test_continual_and_scratch_configs():
  cont = load_config(RECIPES / "tidar_continual.py")
  base = load_config(RECIPES / "tiny_ar.py")
  assert (cont.objective, cont.model.mask_token_id, cont.init_from) == (
      "tidar", 2, "checkpoints/tiny_ar")
  assert dict(cont.objective_args)["alpha"] == 1.0
  assert dataclasses.replace(cont.model, mask_token_id=None) == base.model  # same shapes
  scratch = load_config(RECIPES / "tidar_scratch.py")
  assert (scratch.objective, scratch.init_from, scratch.model.mask_token_id) == ("tidar", None, 2)


# ---- greedy decoding ----

PROMPTS = [[3, 6, 9], [40, 41, 42, 43, 44, 45, 46, 0, 1, 2], [11], [5, 9, 30, 7, 5, 22]]


@pytest.mark.fast
@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_greedy_beta1_equals_greedy_ar_for_every_row(trained, block_size):
  model = trained[0]
  out = pf.generate(model, PROMPTS, decoder=pf.decoders.TiDAR(block_size), max_new_tokens=24)
  ar = pf.generate(model, PROMPTS, max_new_tokens=24)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, ar.lengths)
  acc = np.asarray(out.accepted)
  assert np.all(out.forwards == (acc > 0).sum(1))  # one forward per step per active row
  assert np.all(acc.sum(1) == 23)  # the first token is the prefill's
  if block_size > 1:  # long accepted runs, and rejections on the irregular row
    assert acc.max() == block_size and np.any(acc[3][acc[3] > 0] < block_size)
    assert np.all(out.forwards[:3] <= 2 * -(-23 // block_size))


def test_greedy_equals_the_no_cache_reference_and_untrained_weights(trained, raw):
  model = trained[0]
  out = pf.generate(model, [PROMPTS[3]], decoder=pf.decoders.TiDAR(4), max_new_tokens=16)
  assert out.tokens[0].tolist() == reference_greedy(model, PROMPTS[3], 16)
  # untrained: drafts mostly rejected, still exact
  out = pf.generate(raw, PROMPTS, decoder=pf.decoders.TiDAR(4), max_new_tokens=16)
  np.testing.assert_array_equal(out.tokens, pf.generate(raw, PROMPTS, max_new_tokens=16).tokens)


def test_eos_loop_twin_and_commits(trained):
  """EOS as AR; while loop = Python loop; after every step the cache holds exactly the
  emitted tokens but the last (accepted causal inputs only), and the state carries q-free
  drafts [B, k-1], never the step's logits."""
  model, k = trained[0], 4
  ar = pf.generate(model, PROMPTS, max_new_tokens=20)
  eos = int(ar.tokens[1, 9])
  kw = {"decoder": pf.decoders.TiDAR(k), "max_new_tokens": 20, "eos_id": eos}
  a = pf.generate(model, PROMPTS, **kw)
  b = pf.generate(model, PROMPTS, loop="python", **kw)
  ref = pf.generate(model, PROMPTS, max_new_tokens=20, eos_id=eos)
  np.testing.assert_array_equal(a.tokens, ref.tokens)
  np.testing.assert_array_equal(a.lengths, ref.lengths)
  assert np.any(np.asarray(a.lengths) < 20)
  for f in ("tokens", "lengths", "forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  for s in pf.generate_steps(model, PROMPTS, decoder=pf.decoders.TiDAR(k), max_new_tokens=20):
    committed = s.cache.lengths + s.pending.count
    live = ~np.asarray(s.done)
    np.testing.assert_array_equal(np.asarray(committed)[live],
                                  np.asarray(s.prompt_lens + s.lengths - 1)[live])
    assert s.drafts.shape == (4, k - 1) and s.q is None
    assert s.pending.kv.k.shape[2] == k  # mask slots' keys are dropped, never committed


# ---- stochastic exactness ----

def _enumerated_joint(model, sampler, prompt, n_new, v, beta, k):
  """Exact joint of n_new tokens under the mixed target beta * AR + (1 - beta) * (slot 1 of a
  k-slot mask block after the prefix), both conditioned on the same prefix: [v ** n_new]."""
  seqs = np.array(list(itertools.product(range(v), repeat=n_new)))
  joint = np.ones(len(seqs))
  forward = compiled_forward(model)
  for d in range(n_new):
    prefix = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs[:, :d]], 1)
    p = prefix.shape[1]
    tokens = np.concatenate([prefix, np.full((len(seqs), k), model.cfg.mask_token_id)], 1)
    pos = np.concatenate([np.arange(p), p + np.arange(k)])
    lens = jnp.full((len(seqs),), p)
    logits, _ = forward(jnp.asarray(tokens), jnp.broadcast_to(pos, tokens.shape),
                      masks.tidar_prefill(lens, p, k))
    target = beta * logits[:, p - 1] + (1 - beta) * logits[:, p]
    probs = np.asarray(sampler.probs(target), np.float64)
    joint *= probs[np.arange(len(seqs)), seqs[:, d]]
  return joint


@pytest.mark.slow
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_stochastic_tidar_samples_the_target_joint(monkeypatch, beta):
  """20k sampled continuations vs the exactly enumerated joint (at beta = 1: the AR joint);
  the same test rejects a verifier that resamples from p instead of the residual."""
  v, k, n_new, rows, prompt = 6, 3, 3, 20000, [1, 4, 1]
  model = micro_model(vocab_size=v, seed=3, logit_std=2.0, mask_token_id=5)
  sampler = pf.TopK(k=5, temperature=0.9)
  joint = _enumerated_joint(model, sampler, prompt, n_new, v, beta, k)
  assert abs(joint.sum() - 1) < 1e-4
  if beta == 1.0:  # the mixed target is then exactly the AR joint
    ar = _enumerated_joint(model, sampler, prompt, n_new, v, 1.0, 1)
    np.testing.assert_allclose(joint, ar, atol=1e-6)
  dec = pf.decoders.TiDAR(k, beta, sampler)
  jax.clear_caches()  # beta is traced: the other case's biased loop would be reused

  def sample():
    out = pf.generate(model, [prompt] * rows, decoder=dec, max_new_tokens=n_new,
                      rng=jax.random.key(0))
    acc = np.asarray(out.accepted)
    # step 1 has room for 2 tokens: 1 = d_2 rejected, 2 = d_2 accepted
    assert np.mean(acc[:, 0] == 1) > 0.1 and np.mean(acc[:, 0] == 2) > 0.1
    return np.ravel_multi_index(tuple(np.asarray(out.tokens).T), (v,) * n_new)

  assert_samples_the_joint(sample, joint, monkeypatch, "TiDAR")


# ---- compile once, errors ----

def test_compiles_once(trained):
  model, rng = trained[0], np.random.default_rng(4)
  before = TRACES["TiDAR"]
  for i in range(20):
    prompts = [list(rng.integers(0, V, rng.integers(1, 17))) for _ in range(3)]
    sampler = pf.TopK(k=int(rng.integers(1, 10)), temperature=float(rng.uniform(0.5, 1.5)))
    dec = pf.decoders.TiDAR(4, float(rng.uniform(0, 1)), sampler)
    pf.generate(model, prompts, decoder=dec, max_new_tokens=8, rng=jax.random.key(i),
                eos_id=int(rng.integers(0, V)), max_prompt_len=16)
  assert TRACES["TiDAR"] - before == 1


@pytest.mark.fast
@pytest.mark.parametrize("dec, match", [
    (pf.decoders.TiDAR(0), "block_size >= 1"),
    (pf.decoders.TiDAR(-2), "block_size >= 1"),
    (pf.decoders.TiDAR(65), "larger than the buffer"),
    (pf.decoders.TiDAR(4, beta=1.5), "0 <= beta <= 1"),
    (pf.decoders.TiDAR(4, sampler=pf.Temperature(0.0)), "temperature must be > 0"),
])
def test_bad_parameters_are_clear_errors(trained, dec, match):
  with pytest.raises(ValueError, match=match):
    pf.generate(trained[0], [[1, 2]], decoder=dec)


@pytest.mark.fast
def test_model_without_mask_token_is_refused(model):
  with pytest.raises(ValueError, match="mask_token_id is None"):
    pf.generate(model, [[1, 2]], decoder=pf.decoders.TiDAR(4))
  with pytest.raises(ValueError, match="needs ModelConfig.mask_token_id"):
    tidar_loss(model, {"tokens": jnp.ones((1, 8), jnp.int32)}, jax.random.key(0))
