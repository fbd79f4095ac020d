"""Speculative decoding with a small AR drafter and with a DEER block-diffusion drafter:
greedy = AR, the drafter's cache (rollback / re-feed), stochastic exactness, compile once,
clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO, micro_model
from flax import nnx
from test_generate import reference_greedy
from test_verify import assert_samples_the_joint, enumerated_ar_joint

import paraflax as pf
from paraflax.decoding.generate import TRACES
from paraflax.model import masks

PROMPTS = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3], [11], [3, 4, 3, 4, 3, 4, 3]]
N_NEW = 20


@pytest.fixture(scope="module")
def drafter():
  """A different, smaller model: it almost never agrees with the verifier (reject path)."""
  return micro_model(seed=7, d_model=16, n_layers=1)


def truncated(model):
  """The verifier's first layer with its embeddings and head: agrees often, not always."""
  small = pf.Transformer(pf.ModelConfig(**{**MICRO, "n_layers": 1}), rngs=nnx.Rngs(0))
  small.embed[...] = model.embed[...]
  nnx.update(small.layers[0], nnx.state(model.layers[0]))
  nnx.update(small.final_norm, nnx.state(model.final_norm))
  small.lm_head[...] = model.lm_head[...]
  return small


def _greedy_continuation(model, width):
  """k greedy tokens after `seq[:t]`, by full recomputation (no cache, one compile)."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def next_token(seq, t):
    logits, _ = nnx.merge(graphdef, params)(seq[None], jnp.arange(width)[None],
                                            masks.causal(t[None], width))
    return jnp.argmax(logits[0, t - 1]).astype(jnp.int32)

  def run(context, k):
    seq = np.zeros(width, np.int32)
    seq[:len(context)] = context
    out = []
    for i in range(k):
      seq[len(context) + i] = int(next_token(jnp.asarray(seq), jnp.int32(len(context) + i)))
      out.append(int(seq[len(context) + i]))
    return out

  return run


def _expected_accepted(draft_next, prompt, out, k, n_new):
  """Per-step emitted counts when the drafter drafts its own greedy continuation of the whole
  context (what an exact drafter cache gives) and the target keeps the matching prefix."""
  counts, length = [], 1
  while length < n_new:
    drafts = draft_next(prompt + out[:length], k)
    n = 0
    while n < k and length + n < len(out) and drafts[n] == out[length + n]:
      n += 1
    emitted = min(n + 1, n_new - length)
    counts.append(emitted)
    length += emitted
  return counts


@pytest.mark.parametrize("kind", ["small", "truncated"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_ar_and_drafts_are_the_drafters_greedy_continuation(model, drafter, k,
                                                                          kind):
  drafter = drafter if kind == "small" else truncated(model)
  out = pf.generate(model, PROMPTS, decoder=pf.decoders.Speculative(k), max_new_tokens=N_NEW,
                    draft_model=drafter)
  ar = pf.generate(model, PROMPTS, max_new_tokens=N_NEW)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  assert out.tokens[1].tolist() == reference_greedy(model, PROMPTS[1], N_NEW)
  acc = np.asarray(out.accepted)
  steps = (acc > 0).sum(1)
  np.testing.assert_array_equal(out.forwards, steps)
  np.testing.assert_array_equal(out.draft_forwards, k * out.forwards)
  # the acceptance pattern pins the drafter's cache: a rejected draft's keys left visible,
  # or an emitted token missing, changes the drafts and hence the counts
  draft_next = _greedy_continuation(drafter, 64)
  for b, prompt in enumerate(PROMPTS):
    toks = [int(t) for t in out.tokens[b]]
    want = _expected_accepted(draft_next, prompt, toks, k, N_NEW)
    assert acc[b, :len(want)].tolist() == want, (b, acc[b].tolist(), want)
  if kind == "truncated" and k > 1:
    assert acc.max() > 1 and np.any((acc > 0) & (acc < k + 1)), "accept and reject paths"


@pytest.mark.parametrize("k", [1, 2, 4])
def test_verifier_as_its_own_drafter_accepts_every_draft(model, k):
  out = pf.generate(model, PROMPTS, decoder=pf.decoders.Speculative(k), max_new_tokens=N_NEW,
                    draft_model=model)
  ar = pf.generate(model, PROMPTS, max_new_tokens=N_NEW)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  acc = np.asarray(out.accepted)
  for row in acc:  # k + 1 per step (the 2-token drafter catch-up path), the last one cut
    used = row[row > 0]
    assert np.all(used[:-1] == k + 1) and 1 <= used[-1] <= k + 1, row.tolist()
    assert used.sum() == N_NEW - 1
  np.testing.assert_array_equal(out.draft_forwards, k * out.forwards)
  np.testing.assert_array_equal(out.forwards, -(-(N_NEW - 1) // (k + 1)))


def test_eos_and_loop_twin(model, drafter):
  dec = pf.decoders.Speculative(3)
  ar = pf.generate(model, PROMPTS, max_new_tokens=16)
  eos = int(ar.tokens[3, 6])
  a = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=16, eos_id=eos,
                  draft_model=drafter)
  b = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=16, eos_id=eos,
                  draft_model=drafter, loop="python")
  ar_eos = pf.generate(model, PROMPTS, max_new_tokens=16, eos_id=eos)
  np.testing.assert_array_equal(a.tokens, ar_eos.tokens)
  np.testing.assert_array_equal(a.lengths, ar_eos.lengths)
  assert int(a.lengths[3]) == 7
  for f in ("tokens", "lengths", "forwards", "draft_forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_sampled_while_and_python_loops_agree(model, drafter):
  dec = pf.decoders.Speculative(2, pf.TopK(5, 1.3))
  kw = {"decoder": dec, "max_new_tokens": 12, "draft_model": drafter, "rng": jax.random.key(4)}
  a = pf.generate(model, PROMPTS, **kw)
  b = pf.generate(model, PROMPTS, loop="python", **kw)
  for f in ("tokens", "lengths", "forwards", "draft_forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_compiles_once(model, drafter):
  rng = np.random.default_rng(1)
  before = TRACES["Speculative"]
  for i in range(20):
    prompts = [list(rng.integers(0, 6, rng.integers(1, 17))) for _ in range(2)]
    dec = pf.decoders.Speculative(3, pf.Temperature(float(rng.uniform(0.5, 2))))
    pf.generate(model, prompts, decoder=dec, max_new_tokens=8, rng=jax.random.key(i),
                max_prompt_len=16, draft_model=drafter)
  assert TRACES["Speculative"] - before == 1


@pytest.mark.fast
def test_bad_parameters_are_clear_errors(model):
  with pytest.raises(ValueError, match="block_size >= 1"):
    pf.generate(model, [[1, 2]], decoder=pf.decoders.Speculative(0), draft_model=model)
  other = micro_model(seed=3, vocab_size=40, d_model=16, n_layers=1)  # rows may differ
  with pytest.raises(ValueError, match=r"vocab= must be an int in 1\.\.40"):
    pf.generate(model, [[1, 2]], decoder=pf.decoders.Speculative(2, vocab=48), draft_model=other)
  with pytest.raises(ValueError, match="needs draft_model="):
    pf.generate(model, [[1, 2]], decoder=pf.decoders.Speculative(2))
  with pytest.raises(ValueError, match="needs draft_model="):
    pf.decoders.Speculative(2).validate(model.cfg, None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ar", "diffusion"])
def test_stochastic_speculative_samples_the_ar_joint(monkeypatch, kind):
  """20k sampled continuations vs the verifier's exactly enumerated AR joint, for both
  drafters (DEER: q is the block marginal); the same test rejects a verifier that resamples
  from p instead of the residual."""
  model = micro_model(vocab_size=6, seed=2, logit_std=2.2)
  ids = {"mask_token_id": 4, "sep_token_id": 5} if kind == "diffusion" else {}
  drafter = micro_model(vocab_size=6, seed=5, logit_std=2.2, d_model=16, n_layers=1, **ids)
  sampler = pf.Temperature(1.0)
  prompt, n_new, rows, v = [1, 2, 1, 2, 1], 4, 20000, 6
  joint = enumerated_ar_joint(model, sampler, prompt, n_new)
  dec = (pf.decoders.DEER if kind == "diffusion" else pf.decoders.Speculative)(2, sampler)

  sample = lambda: drafted_samples(model, drafter, dec, prompt, n_new, rows, v)
  assert_samples_the_joint(sample, joint, monkeypatch, f"speculative decoding ({kind})")


def drafted_samples(model, drafter, decoder, prompt, n_new: int, rows: int, v: int):
  """Flat indices (over v ** n_new) of `rows` sampled continuations of `prompt`, drafted by
  `drafter` with `decoder` (k = 2)."""
  out = pf.generate(model, [prompt] * rows, decoder=decoder, max_new_tokens=n_new,
                    rng=jax.random.key(0), draft_model=drafter)
  acc = np.asarray(out.accepted)
  # step 1 emits 1 (first draft rejected), 2 (second rejected) or 3 (both accepted): step
  # 2's AR drafter gets the 2-token catch-up chunk, DEER's re-feeds 1, 2 or 3 tokens
  assert all(np.any(acc[:, 0] == c) for c in (1, 2, 3)), np.bincount(acc[:, 0])
  return np.ravel_multi_index(tuple(np.asarray(out.tokens).T), (v,) * n_new)


# --- DEER: a block-diffusion drafter (one forward drafts the whole block) ---

V_SMALL = 8  # small vocabulary: random drafts are accepted often enough to exercise every path
DEER_IDS = {"mask_token_id": 6, "sep_token_id": 7}


@pytest.fixture(scope="module")
def small_target():
  return micro_model(seed=11, vocab_size=V_SMALL, logit_std=2.5)


@pytest.fixture(scope="module")
def diffusion_drafter():
  return micro_model(seed=12, vocab_size=V_SMALL, d_model=16, n_layers=1, **DEER_IDS)


def _diffusion_block(drafter, width):
  """The k argmax drafts of the drafter's block after `context`, by one full forward of
  [context, <sep>, <mask> x k] (no cache; the prefix causal or, for a drafter_prefix
  "bidirectional" drafter, seen both ways): what an exact drafter cache must reproduce."""
  graphdef, params = nnx.split(drafter)
  cfg = drafter.cfg

  @jax.jit
  def block(seq, c, k):
    j = jnp.arange(width)
    kinds = jnp.where(j < c, masks.CLEAN, masks.MASKED)
    see = masks.tidar(kinds[None], (j >= c)[None].astype(jnp.int32), (j <= c + k)[None])
    if cfg.drafter_prefix == "bidirectional":
      see |= (j[:, None] < c) & (j[None, :] < c)
    logits, _ = nnx.merge(graphdef, params)(seq[None], j[None], see)
    return jnp.argmax(logits[0], -1).astype(jnp.int32)

  def run(context, k):
    seq = np.full(width, cfg.mask_token_id, np.int32)
    seq[:len(context)] = context
    seq[len(context)] = cfg.sep_token_id
    out = np.asarray(block(jnp.asarray(seq), jnp.int32(len(context)), jnp.int32(k)))
    return out[len(context) + 1:len(context) + 1 + k].tolist()

  return run


@pytest.mark.parametrize("k, prefix", [(1, "causal"), (2, "causal"), (4, "causal"), (8, "causal"),
                                       (4, "bidirectional")])
def test_deer_greedy_equals_ar_and_drafts_are_the_block_of_the_whole_context(
    small_target, diffusion_drafter, k, prefix):
  """Both drafter modes (`drafter_prefix`): a bidirectional one re-encodes the whole context."""
  prompts = [[p % V_SMALL for p in row] for row in PROMPTS]
  dec = pf.decoders.DEER(k)
  if prefix == "bidirectional":
    diffusion_drafter = micro_model(seed=12, vocab_size=V_SMALL, d_model=16, n_layers=1,
                                    drafter_prefix=prefix, **DEER_IDS)
  out = pf.generate(small_target, prompts, decoder=dec, max_new_tokens=N_NEW,
                    draft_model=diffusion_drafter)
  ar = pf.generate(small_target, prompts, max_new_tokens=N_NEW)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  acc = np.asarray(out.accepted)
  np.testing.assert_array_equal(out.forwards, (acc > 0).sum(1))
  np.testing.assert_array_equal(out.draft_forwards, out.forwards)  # one drafter call a step
  # the counts pin the drafter's cache: a missing or duplicated context token changes drafts
  block = _diffusion_block(diffusion_drafter, 64)
  for b, prompt in enumerate(prompts):
    toks = [int(t) for t in out.tokens[b]]
    want = _expected_accepted(block, prompt, toks, k, N_NEW)
    assert acc[b, :len(want)].tolist() == want, (b, acc[b].tolist(), want)
  assert acc.max() > 1, "some drafts are accepted"
  if k == 1:  # (larger blocks reach k + 1 unseen tokens in the stochastic test)
    assert acc.max() == 2, "a full acceptance (k + 1 unseen tokens next step) happens"


def test_deer_eos_loop_twin_and_compiles_once(small_target, diffusion_drafter):
  prompts = [[p % V_SMALL for p in row] for row in PROMPTS]
  dec = pf.decoders.DEER(3)
  ar = pf.generate(small_target, prompts, max_new_tokens=16)
  eos = int(ar.tokens[1, 5])
  kw = {"decoder": dec, "max_new_tokens": 16, "eos_id": eos, "draft_model": diffusion_drafter}
  a = pf.generate(small_target, prompts, **kw)
  b = pf.generate(small_target, prompts, loop="python", **kw)
  ar_eos = pf.generate(small_target, prompts, max_new_tokens=16, eos_id=eos)
  np.testing.assert_array_equal(a.tokens, ar_eos.tokens)
  np.testing.assert_array_equal(a.lengths, ar_eos.lengths)
  for f in ("tokens", "lengths", "forwards", "draft_forwards", "accepted"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  rng = np.random.default_rng(2)
  before = TRACES["DEER"]
  for i in range(12):
    rows = [list(rng.integers(0, 6, rng.integers(1, 17))) for _ in range(2)]
    dec = pf.decoders.DEER(4, pf.Temperature(float(rng.uniform(0.5, 2))))
    pf.generate(small_target, rows, decoder=dec, max_new_tokens=8, rng=jax.random.key(i),
                max_prompt_len=16, draft_model=diffusion_drafter)
  assert TRACES["DEER"] - before == 1


@pytest.mark.fast
def test_deer_bad_drafters_are_clear_errors(small_target):
  dec = pf.decoders.DEER(2)
  for missing in ("mask_token_id", "sep_token_id"):
    plain = micro_model(seed=3, vocab_size=V_SMALL, d_model=16, n_layers=1,
                        **{**DEER_IDS, missing: None})
    with pytest.raises(ValueError, match=f"diffusion drafting needs a DEER drafter.*{missing}"):
      pf.generate(small_target, [[1, 2]], decoder=dec, draft_model=plain)
  with pytest.raises(ValueError, match="vocab= must be an int"):
    pf.generate(small_target, [[1, 2]], decoder=pf.decoders.DEER(2, vocab=9),
                draft_model=micro_model(seed=3, d_model=16, n_layers=1, **DEER_IDS))
  with pytest.raises(ValueError, match="block_size >= 1"):
    pf.decoders.DEER(0).validate(small_target.cfg, small_target.cfg)
  with pytest.raises(ValueError, match="drafter_prefix='bidirectional' is a DEER drafter's"):
    pf.ModelConfig(**{**MICRO, "drafter_prefix": "bidirectional"})  # no <mask> / <sep>
  with pytest.raises(ValueError, match="drafter_prefix must be 'causal' or 'bidirectional'"):
    pf.ModelConfig(**{**MICRO, **DEER_IDS, "drafter_prefix": "both"})


@pytest.mark.fast
def test_old_spellings_still_work_with_a_deprecation_warning():
  d = pf.decoders
  with pytest.warns(DeprecationWarning, match=r"use pf.decoders.DEER"):
    assert d.Speculative(3, d.AR().sampler, drafter="diffusion") == d.DEER(3)
  with pytest.warns(DeprecationWarning, match=r"drafter="):
    assert d.Speculative(3, drafter="ar") == d.Speculative(3)
  with pytest.raises(ValueError, match="drafter must be one of"):
    d.Speculative(2, drafter="dlm")
  with pytest.warns(DeprecationWarning, match=r"use pf.decoders.JacobiMR"):
    old = d.Jacobi(16, num_blocks=2, pool_size=16, num_candidates=2)
  assert old == d.JacobiMR(block_size=16, num_blocks=2, pool_size=16, num_candidates=2)
  with pytest.warns(DeprecationWarning):
    assert d.Jacobi(4, 2) == d.JacobiMR(4, num_blocks=2)  # the old positional order
  assert type(d.Jacobi(4)) is d.Jacobi and type(d.Jacobi(4, pf.Greedy())) is d.Jacobi
