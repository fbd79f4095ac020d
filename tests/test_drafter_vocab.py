"""Drafters that share the verifier's tokenizer but not its row count (a 0.5B drafter for a
7B verifier, a drafter with method tokens): greedy = AR, the stochastic decoders sample the
target joint, drafts never come from rows past the shared vocabulary, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_model
from flax import nnx
from test_speculative import PROMPTS, drafted_samples
from test_verify import assert_samples_the_joint, chi_square_pvalue, enumerated_ar_joint

import paraflax as pf
from paraflax import loading
from paraflax.decoding import speculative

N_NEW = 16


def with_extra_rows(model, n: int, factor: float = 3.0, **cfg_overrides):
  """`model` with `n` more vocabulary rows: extra id v + i scores `factor` x the logit of id
  i % v, so unmasked it outranks every real id whose logit is positive (most of the mass)."""
  v = model.cfg.vocab_size
  cfg = dataclasses.replace(model.cfg, vocab_size=v + n, **cfg_overrides)
  big = pf.Transformer(cfg, rngs=nnx.Rngs(0))
  for mine, theirs in zip(big.layers, model.layers):
    nnx.update(mine, nnx.state(theirs))
  nnx.update(big.final_norm, nnx.state(model.final_norm))
  src = jnp.arange(n) % v
  big.embed[...] = jnp.concatenate([model.embed[...], model.embed[...][src]], 0)
  big.lm_head[...] = jnp.concatenate([model.lm_head[...], factor * model.lm_head[...][:, src]],
                                     1)
  return big


def _unmask(monkeypatch, module):
  """Negative control: the drafter's logits reach the sampler unmasked (and the jit caches
  are dropped so the patched step is traced)."""
  monkeypatch.setattr(module, "proposal_logits", lambda logits_xVd, shared, rows: logits_xVd)
  jax.clear_caches()


@pytest.fixture(scope="module")
def ar_tokens(model):
  return np.asarray(pf.generate(model, PROMPTS, max_new_tokens=N_NEW).tokens)


@pytest.fixture
def fresh_caches():
  yield
  jax.clear_caches()  # no test after this one may reuse a step traced with a patch


def test_greedy_drafter_with_more_rows_equals_ar_and_never_drafts_an_extra_id(
    model, ar_tokens, monkeypatch, fresh_caches):
  drafter = with_extra_rows(model, model.cfg.vocab_size)  # 96 rows for a 48-row verifier
  k = 3
  dec = pf.decoders.Speculative(k)
  out = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=N_NEW, draft_model=drafter)
  np.testing.assert_array_equal(out.tokens, ar_tokens)
  # masked, the drafter is the verifier: every draft accepted, k + 1 tokens a step
  used = [row[row > 0] for row in np.asarray(out.accepted)]
  assert all(np.all(u[:-1] == k + 1) for u in used), [u.tolist() for u in used]
  _unmask(monkeypatch, speculative)  # unmasked, every draft is an extra id: all rejected
  bad = pf.generate(model, PROMPTS, decoder=dec, max_new_tokens=N_NEW, draft_model=drafter)
  np.testing.assert_array_equal(bad.tokens, ar_tokens)  # (greedy verification still exact)
  acc = np.asarray(bad.accepted)
  assert np.all(acc[acc > 0] == 1), acc.tolist()


def test_greedy_drafter_with_fewer_rows_equals_ar(model, ar_tokens):
  """The verifier emits ids the drafter has no row for (fed to it as 0); drafts < vocab=."""
  drafter = micro_model(seed=7, vocab_size=40, d_model=16, n_layers=1)
  assert np.any(ar_tokens >= 40), "the drafter-less ids are exercised"
  out = pf.generate(model, PROMPTS, decoder=pf.decoders.Speculative(2, vocab=32),
                    max_new_tokens=N_NEW, draft_model=drafter)
  np.testing.assert_array_equal(out.tokens, ar_tokens)


def test_deer_drafter_with_method_tokens_past_the_verifier_equals_ar():
  target = micro_model(seed=11, vocab_size=8, logit_std=2.5)
  base = micro_model(seed=12, vocab_size=8, d_model=16, n_layers=1)
  drafter = with_extra_rows(base, 2, mask_token_id=8, sep_token_id=9)
  prompts = [[p % 8 for p in row] for row in PROMPTS]
  ar = pf.generate(target, prompts, max_new_tokens=N_NEW)
  out = pf.generate(target, prompts, decoder=pf.decoders.DEER(4), max_new_tokens=N_NEW,
                    draft_model=drafter)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  assert np.asarray(out.accepted).max() > 1, "some drafts are accepted"


@pytest.mark.fast
def test_bad_shared_vocabulary_is_a_clear_error(model):
  drafter = micro_model(seed=7, vocab_size=40, d_model=16, n_layers=1)
  for vocab in (0, 41, 2.0, True):
    with pytest.raises(ValueError, match=r"vocab= must be an int in 1\.\.40 .*48 rows.*40"):
      pf.generate(model, [[1, 2]], decoder=pf.decoders.Speculative(2, vocab=vocab),
                  draft_model=drafter)
  with pytest.raises(ValueError, match=r"DEER vocab= must be an int in 1\.\.40"):
    pf.decoders.DEER(2, vocab=48).validate(model.cfg, drafter.cfg)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ar", "diffusion"])
def test_stochastic_drafter_with_extra_rows_samples_the_ar_joint(monkeypatch, fresh_caches,
                                                                 kind):
  """Verifier vocabulary 6, drafter rows 12 whose ids 6..11 carry most of its unmasked mass
  (DEER's <mask>, <sep> are 6, 7). Masked before sampling, the decoders pass the chi-square test
  against the verifier's enumerated AR joint (and rejects a biased residual)."""
  model = micro_model(vocab_size=6, seed=2, logit_std=2.2)
  ids = {"mask_token_id": 6, "sep_token_id": 7} if kind == "diffusion" else {}
  drafter = with_extra_rows(micro_model(vocab_size=6, seed=5, logit_std=2.2, d_model=16,
                                        n_layers=1), 6, **ids)
  sampler = pf.Temperature(1.0)
  prompt, n_new, rows, v = [1, 2, 1, 2, 1], 4, 20000, 6
  t = len(prompt)
  logits, _ = drafter(jnp.asarray([prompt]), jnp.arange(t)[None], pf.masks.causal(
      jnp.asarray([t]), t))
  extra = float(jax.nn.softmax(logits[0, -1])[v:].sum())
  assert extra > 0.5, f"unmasked, the drafter would draw ids >= 6 (mass {extra:.2f})"
  joint = enumerated_ar_joint(model, sampler, prompt, n_new)
  dec = (pf.decoders.DEER if kind == "diffusion" else pf.decoders.Speculative)(2, sampler)

  sample = lambda: drafted_samples(model, drafter, dec, prompt, n_new, rows, v)

  if kind == "ar":  # the control (a biased residual is rejected) once; it costs a 2nd run
    assert_samples_the_joint(sample, joint, monkeypatch, "AR drafter with extra rows")
  else:
    pvalue = chi_square_pvalue(sample(), joint)
    assert pvalue > 1e-3, f"DEER with extra rows deviates from the target (p={pvalue:.2e})"


class _Tok:
  """Just what `load_drafter` compares of a tokenizer (no method tokens of its own)."""

  def __init__(self, fingerprint: str, vocab_size: int):
    self._fingerprint, self.vocab_size = fingerprint, vocab_size

  def fingerprint(self):
    return self._fingerprint

  def without_method_tokens(self):
    return self


@pytest.mark.fast
def test_load_drafter_compares_tokenizers_not_rows(model, monkeypatch):
  drafter = micro_model(seed=7, vocab_size=56, d_model=16, n_layers=1)
  theirs = _Tok("a" * 16, 44)
  monkeypatch.setattr(loading, "load_model", lambda workdir, hf: (drafter, theirs, None))
  got, vocab = loading.load_drafter("d", None, _Tok("a" * 16, 44), model)  # 56 rows vs 48
  assert got is drafter and vocab == 44  # the tokenizer's real ids
  with pytest.raises(ValueError, match=r"^the drafter 'd' has another tokenizer than the model: "
                     r"fingerprint aaaaaaaaaaaa \(44 ids\) != bbbbbbbbbbbb \(44 ids\), and not "
                     r"only in their own method tokens \(<mask>, <sep>\)$"):
    loading.load_drafter("d", None, _Tok("b" * 16, 44), model)


@pytest.mark.fast
def test_drafter_and_verifier_may_each_add_their_own_method_tokens(model, monkeypatch):
  """One rule both ways: tokenizers equal once each one's own method tokens (<mask>, <sep>
  added after its ids) are removed. A base drafter for a TiDAR verifier (base + <mask>), a
  DEER drafter (base + <mask>, <sep>) for a base or a TiDAR verifier: paired, drafting only
  the base's ids; another token added, or <mask> added to a base that differs, is refused."""
  import tokenizers
  from paraflax.data.tokenizer import Tokenizer
  base = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, "a"))
  tok = Tokenizer(base, special_tokens={"pad": "<eos>", "eos": "<eos>"})
  tidar = tok.with_special_tokens({"mask": "<mask>"})
  deer = tok.with_special_tokens({"mask": "<mask>", "sep": "<sep>"})
  other = Tokenizer(tokenizers.Tokenizer.from_str(base.to_str()))
  other.backend.add_tokens(["c"])
  drafter = micro_model(seed=7, d_model=16, n_layers=1)
  for verifier, draft_tok, ok in ((tok, tok, True), (tok, deer, True), (tidar, tok, True),
                                  (tidar, deer, True), (deer, tidar, True), (tok, other, False),
                                  (other, tok, False), (tidar, other.with_special_tokens(
                                      {"mask": "<mask>"}), False)):
    monkeypatch.setattr(loading, "load_model", lambda workdir, hf, t=draft_tok: (drafter, t, None))
    if ok:
      assert loading.load_drafter("d", None, verifier, model) == (drafter, tok.vocab_size)
    else:
      with pytest.raises(ValueError, match="has another tokenizer than the model"):
        loading.load_drafter("d", None, verifier, model)
  assert deer.vocab_size == tok.vocab_size + 2  # so the shared ids keep them out of drafts
  from paraflax import training  # bench's other weights (--tidar-workdir): the same tokenizer
  for draft_tok, rows, ok in ((deer, 48, True), (other, 48, False), (deer, 47, False)):
    monkeypatch.setattr(training, "load_trained", lambda w, t=draft_tok: (drafter, t, None))
    if ok:  # the base's rows, grown only to hold its method tokens
      assert loading.load_related("w", tok, rows, "--tidar-workdir") is drafter
    else:
      with pytest.raises(ValueError, match="--tidar-workdir 'w' was not trained with the base"):
        loading.load_related("w", tok, rows, "--tidar-workdir")
