"""DEER training: the teacher store (greedy AR answers, resumable, refuses other settings), the
Stage I / Stage II rows checked by hand, the layout contract with the decoder (training block
logits = a decoding forward over the prefix's KV cache), the "ar" objective on teacher rows,
configs, demo stages, and short trainer / CLI runs."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import reference_greedy

import paraflax as pf
from paraflax.decoding import deer_layout
from paraflax.decoding.state import Forward, prefill
from paraflax.model import masks
from paraflax.training import get_objective, load_config
from paraflax.training.config.recipes import RECIPES
from paraflax.training.objectives import deer
from paraflax.training.objectives.means import finalize
from paraflax.training.stores import teacher as tch
from conftest import StubTokenizer, compiled_micro_model

MASK, SEP = 2, 3
C, K = masks.CLEAN, masks.MASKED


def _a(rows):
  return np.array([[c == "1" for c in r.replace(" ", "")] for r in rows])


@pytest.fixture(scope="module")
def drafter():
  return compiled_micro_model(seed=1, mask_token_id=MASK, sep_token_id=SEP)


def one_row():
  """Prompt [10, 11] + answer [20, 21, 22, 23], right-padded to W = 7."""
  return {"tokens": jnp.array([[10, 11, 20, 21, 22, 23, 0]], jnp.int32),
          "prompt_lens": jnp.array([2], jnp.int32), "lengths": jnp.array([6], jnp.int32)}


# ---- teacher store ----


TEACH = tch.TeacherConfig(examples=10, answer_len=5, min_prompt_len=2, max_prompt_len=7,
                          batch_size=4)


@pytest.fixture(scope="module")
def stream():
  return np.random.default_rng(1).integers(4, 48, 500).astype(np.int32)


@pytest.fixture(scope="module")
def teacher_store(model, stream, tmp_path_factory):
  return tch.collect(model, StubTokenizer(), stream, tmp_path_factory.mktemp("t") / "a", TEACH,
                     progress=False)


@pytest.fixture(scope="module")
def whole(teacher_store):
  return tch.load(teacher_store)


@pytest.mark.fast
def test_teacher_answers_are_the_greedy_ar_continuations(model, whole):
  assert whole.answers.shape == (10, 5) and whole.prompts.shape == (10, 7)
  assert np.all((whole.prompt_lens >= 2) & (whole.prompt_lens <= 7))
  for i in (0, 9):  # the last batch is padded with copies of its last row
    prompt = whole.prompts[i, :whole.prompt_lens[i]].tolist()
    assert whole.answers[i].tolist() == reference_greedy(model, prompt, 5)
  tokens, lengths = whole.rows()
  assert tokens.shape == (10, 12) and lengths.tolist() == (whole.prompt_lens + 5).tolist()
  for i in range(10):
    p = whole.prompt_lens[i]
    assert tokens[i, :p + 5].tolist() == whole.prompts[i, :p].tolist() + whole.answers[i].tolist()
    assert not tokens[i, p + 5:].any()


@pytest.mark.fast
def test_teacher_store_resumes_after_a_crash_and_refuses_other_settings(model, stream, whole,
                                                                       tmp_path, monkeypatch):
  real, calls = tch.greedy_answers, []

  def crash_on_second(*a, **k):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(*a, **k)

  monkeypatch.setattr(tch, "greedy_answers", crash_on_second)
  with pytest.raises(KeyboardInterrupt):
    tch.collect(model, StubTokenizer(), stream, tmp_path / "b", TEACH, progress=False)
  assert json.loads((tmp_path / "b" / "progress.json").read_text()) == {"batches": 1}
  with pytest.raises(ValueError, match=r"incomplete \(1/3 batches\).*teacher-data"):
    tch.load(tmp_path / "b")
  monkeypatch.setattr(tch, "greedy_answers", real)
  resumed = tch.load(tch.collect(model, StubTokenizer(), stream, tmp_path / "b", TEACH, progress=False))
  for k in tch.ARRAYS:
    np.testing.assert_array_equal(getattr(resumed, k), getattr(whole, k))
  with pytest.raises(ValueError, match=r"other settings \(answer_len\)"):
    tch.collect(model, StubTokenizer(), stream, tmp_path / "b", dataclasses.replace(TEACH, answer_len=4),
                progress=False)
  with pytest.raises(FileNotFoundError, match="paraflax teacher-data"):
    tch.load(tmp_path / "missing")
  with pytest.raises(ValueError, match="exceeds the teacher's max_seq_len"):
    tch.collect(model, StubTokenizer(), stream, tmp_path / "c",
                dataclasses.replace(TEACH, answer_len=model.cfg.max_seq_len), progress=False)


@pytest.mark.fast
def test_the_trainer_takes_stage1s_longest_prompt_from_the_teacher_store(teacher_store):
  """The store fixes Stage I's `prompt_len` (where its rows' answers start once aligned); Stage
  II and AR on the same rows take no such argument, and get none."""
  from paraflax.training.config.train import apply_overrides
  cfg = apply_overrides(load_config("deer_drafter_stage1"), {
      "data_source_args.path": str(teacher_store), "data.seq_len": 12})
  assert dict(cfg.with_row_args().objective_args)["prompt_len"] == TEACH.max_prompt_len
  with pytest.raises(ValueError, match="objective_args.prompt_len=9, but the 'teacher' rows"):
    apply_overrides(cfg, {"objective_args.prompt_len": 9}).with_row_args()
  stage2 = apply_overrides(cfg, {"objective": "deer_stage2"})
  assert stage2.with_row_args() == stage2


# ---- Stage I ----

@pytest.mark.fast
def test_stage1_row_by_hand(drafter):
  """Cut after answer token 1 (prefix c = 3: [10, 11, 20]), suffix y_1..y_3 = 21, 22, 23 with
  y_1 and y_3 masked at t = 0.5: <sep> at position 3, y_2 keeps its token, weights 1/(t m)."""
  batch = one_row()
  masked = jnp.array([[0, 0, 0, 0, 1, 0, 1, 0]], bool)
  rows = deer.stage1_rows(batch, jnp.array([3]), jnp.array([0.5]), masked, MASK, SEP)
  assert rows["tokens"][0].tolist() == [10, 11, 20, SEP, MASK, 22, MASK, 0]
  assert rows["positions"][0].tolist() == list(range(8))
  assert rows["kinds"][0].tolist() == [C, C, C, K, K, K, K, K]
  assert rows["blocks"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
  assert rows["valid"][0].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
  assert rows["targets"][0, 4:7].tolist() == [21, 22, 23]  # y_i -> x_{c+i-1}, unshifted
  np.testing.assert_allclose(rows["weights"][0], [0, 0, 0, 0, 1 / 1.5, 0, 1 / 1.5, 0])
  got = masks.tidar(rows["kinds"], rows["blocks"], rows["valid"])[0]
  np.testing.assert_array_equal(got, _a([
      "100 0000 0", "110 0000 0", "111 0000 0",  # prefix: causal
      "111 1111 0", "111 1111 0", "111 1111 0", "111 1111 0",  # block: prefix + itself
      "111 1111 1"]))  # padding (output ignored) also sees itself
  hidden = jax.jit(lambda r: deer.forward(drafter, r, hidden=True))(rows)
  loss, m = finalize(*deer.block_loss(drafter, hidden, rows, rows["weights"], masked))
  logits = drafter.head(hidden)
  nll = -jax.nn.log_softmax(logits[0], -1)
  np.testing.assert_allclose(loss, (nll[4, 21] + nll[6, 23]) / 1.5, rtol=1e-5)
  hits = [int(jnp.argmax(logits[0, 4]) == 21), int(jnp.argmax(logits[0, 6]) == 23)]
  np.testing.assert_allclose(m["accuracy"], np.mean(hits))
  np.testing.assert_allclose(m["first_accuracy"], hits[0])


def test_stage1_rows_aligned_at_the_longest_prompt_give_the_same_loss_and_gradients(drafter):
  """With `prompt_len` (the store's longest prompt) every row's answer starts at that slot,
  padding between its prompt and its answer: the same tokens at the same positions under the
  same mask, so the loss and its gradients are the unaligned rows' (float32, highest)."""
  rng = np.random.default_rng(4)
  batch = {"tokens": jnp.asarray(rng.integers(4, 48, (3, 12)), jnp.int32),  # answers <= 12 - 5
           "prompt_lens": jnp.array([2, 5, 3]), "lengths": jnp.array([9, 12, 7])}
  graphdef, params = nnx.split(drafter)
  key = jax.random.key(0)

  def loss(p, **args):
    return deer.deer_stage1_loss(nnx.merge(graphdef, p), batch, key, **args)[0]

  with jax.default_matmul_precision("highest"):
    want = jax.value_and_grad(loss)(params)
    got = jax.value_and_grad(functools.partial(loss, prompt_len=5))(params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  rows = deer.answers_aligned(deer.layout(batch["tokens"], batch["lengths"],
                                          batch["prompt_lens"], SEP), batch["prompt_lens"], 5)
  assert rows["tokens"][:, 5].tolist() == [SEP] * 3  # cut at the prompt: SEP, at slot 5
  # row 0: its prompt of 2, padding up to slot 5, then SEP and its 7 answer tokens
  assert rows["valid"][0].tolist() == [True] * 2 + [False] * 3 + [True] * 8
  assert rows["positions"][0, [0, 1, 5, 6]].tolist() == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="prompt_len=12 must be in"):
    loss(params, prompt_len=12)


@pytest.mark.fast
def test_stage1_draws_mask_only_the_suffix_at_rate_t():
  b, a = 256, 64
  prompt_lens = jnp.asarray(np.random.default_rng(0).integers(1, 9, b), jnp.int32)
  lengths = prompt_lens + a
  prefix, t, masked = jax.jit(deer.stage1_draws, static_argnums=(3, 4))(
      jax.random.key(0), prompt_lens, lengths, 8 + a, 1e-3)
  j = np.arange(8 + a + 1)[None, :]
  suffix = (j > np.asarray(prefix)[:, None]) & (j <= np.asarray(lengths)[:, None])
  assert np.all((prefix >= prompt_lens) & (prefix < lengths))  # >= 1 answer token to predict
  assert np.all(~np.asarray(masked) | suffix) and np.all(masked.sum(1) >= 1)
  assert np.all((t >= 1e-3) & (t <= 1)) and np.ptp(np.asarray(prefix - prompt_lens)) > a // 2
  expected = float(jnp.sum(t * (lengths - prefix)))  # E[masked] = t m, +1 forced when none
  assert expected <= float(masked.sum()) <= expected + b


# ---- Stage II ----

@pytest.mark.fast
def test_stage2_row_and_weights_by_hand():
  """Two blocks given unsorted: (c = 3, R = 2) and (c = 2, R = 1), max_masked = 2, alpha = 2.
  Sorted by cut they get block ids 1 and 2; clean token j gets #cuts <= j; block weights
  alpha^(R-i) normalised per block, then halved (two blocks)."""
  rows = deer.stage2_rows(one_row(), jnp.array([[3, 2]]), jnp.array([[2, 1]]), 2, MASK, SEP, 2.0)
  #            clean x_0..x_6               | block c=2, R=1  | block c=3, R=2
  assert rows["tokens"][0].tolist() == [10, 11, 20, 21, 22, 23, 0, SEP, MASK, MASK,
                                        SEP, MASK, MASK]
  assert rows["positions"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 2, 3, 4, 3, 4, 5]
  assert rows["kinds"][0].tolist() == [C] * 7 + [K] * 6
  assert rows["blocks"][0].tolist() == [0, 0, 1, 2, 2, 2, 2, 1, 1, 1, 2, 2, 2]
  assert rows["valid"][0].tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
  assert rows["targets"][0, [8, 11, 12]].tolist() == [20, 21, 22]  # y_i -> x_{c+i-1}
  np.testing.assert_allclose(rows["weights"][0], [0] * 8 + [1 / 2, 0, 0, 1 / 3, 1 / 6],
                             rtol=1e-6)
  got = masks.tidar(rows["kinds"], rows["blocks"], rows["valid"])[0]
  np.testing.assert_array_equal(got, _a([
      "1000000 000 000", "1100000 000 000", "1110000 000 000", "1111000 000 000",
      "1111100 000 000", "1111110 000 000", "1111111 000 000",  # clean: causal (pad: itself)
      "1100000 110 000", "1100000 110 000", "1100000 111 000",  # block 1: x_0, x_1, itself
      "1110000 000 111", "1110000 000 111", "1110000 000 111"]))  # block 2: x_0..x_2, itself
  w = deer.stage2_rows(one_row(), jnp.array([[2]]), jnp.array([[4]]), 4, MASK, SEP, 1.01)
  np.testing.assert_allclose(w["weights"][0, 8:], 1.01 ** np.arange(3, -1, -1)
                             / np.sum(1.01 ** np.arange(4)), rtol=1e-6)


@pytest.mark.fast
def test_stage2_draws_cover_every_block_size_inside_the_answer():
  b = 256
  prompt_lens = jnp.asarray(np.random.default_rng(0).integers(1, 9, b), jnp.int32)
  answer = jnp.where(jnp.arange(b) % 2 == 0, 20, 5)[:, None]  # R is capped by short answers
  prefix, r = jax.jit(deer.stage2_draws, static_argnums=(3, 4))(
      jax.random.key(1), prompt_lens, prompt_lens + answer[:, 0], 16, 3)
  assert prefix.shape == r.shape == (b, 3)
  assert np.all((r >= 1) & (r <= jnp.minimum(16, answer)))
  assert np.all((prefix >= prompt_lens[:, None]) & (prefix + r <= prompt_lens[:, None] + answer))
  assert set(np.asarray(r[::2]).ravel().tolist()) == set(range(1, 17))
  assert np.all(np.ptp(np.asarray(prefix), 1)[::2] >= 0) and np.any(prefix[:, 0] != prefix[:, 1])


@pytest.mark.fast
def test_stage2_blocks_see_nothing_from_their_cut_on(drafter):
  """Changing the row from a block's cut on (its own targets and what follows) moves none of its
  logits; changing a token before the cut does."""
  tokens = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], jnp.int32)
  batch = {"tokens": tokens, "prompt_lens": jnp.array([3]), "lengths": jnp.array([10])}
  fwd = jax.jit(lambda b: deer.forward(drafter, deer.stage2_rows(
      b, jnp.array([[4, 7]]), jnp.array([[3, 2]]), 3, MASK, SEP, 1.01)))
  ref = fwd(batch)[0, 10:18]  # block c=4 at 10..13, block c=7 at 14..17
  later = fwd({**batch, "tokens": tokens.at[0, 4:].set(40)})[0, 10:14]
  np.testing.assert_array_equal(ref[:4], later)
  earlier = fwd({**batch, "tokens": tokens.at[0, 3].set(40)})[0, 10:18]
  assert float(jnp.min(jnp.max(jnp.abs(ref - earlier)[1:4], -1))) > 1e-3


@pytest.mark.fast
def test_training_block_logits_equal_a_decoding_forward_over_the_cache(drafter, k=3):
  """The layout contract: Stage II's training forward (the row's clean tokens, then two blocks
  [<sep>, <mask> x k] after different cuts) gives each block the logits the DEER decoder's
  drafting forward gets (`deer_layout.draft_inputs`, as `decoding/deer.py` calls it): the
  prefix but its last token in the drafter's KV cache, then that unseen token and
  [<sep>, <mask> x k] at positions c..c+k; rows with different prompts and cuts."""
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(4, 48, (2, 11)), jnp.int32)
  batch = {"tokens": tokens, "prompt_lens": jnp.array([3, 5]), "lengths": jnp.array([9, 11])}
  cuts = jnp.array([[5, 3], [7, 6]])  # row 0 given unsorted: its blocks are stored [3, 5]
  rows = deer.stage2_rows(batch, cuts, jnp.full((2, 2), k), k, MASK, SEP, 1.01)
  train = jax.jit(lambda r: deer.forward(drafter, r))(rows)[:, 11:].reshape(2, 2, k + 1, -1)
  fwd, draft = Forward.of(drafter), jax.jit(drafter)
  for blk, prefix in enumerate([jnp.array([3, 6]), jnp.array([5, 7])]):
    cached = prefix - 1
    cache, _ = jax.jit(prefill, static_argnums=3)(fwd, tokens[:, :8], cached, 16)
    last = jnp.take_along_axis(tokens, cached[:, None], 1)
    chunk, positions, mask = deer_layout.draft_inputs(
        last, cached[:, None], jnp.ones((2, 1), bool), prefix, k, MASK, SEP, cache.lengths,
        cache.slots)
    assert chunk[0, 1:].tolist() == [SEP] + [MASK] * k
    assert positions[1].tolist() == list(range(int(cached[1]), int(prefix[1]) + k + 1))
    np.testing.assert_array_equal(mask[1, 1:], np.concatenate(  # the block's rows
        [np.broadcast_to(np.arange(17) < cached[1], (k + 1, 17)), np.ones((k + 1, k + 2), bool)],
        1))
    decode, _ = draft(chunk, positions, mask, cache)
    np.testing.assert_allclose(decode[:, 2:], train[:, blk, 1:], atol=1e-5)


@pytest.mark.fast
def test_bidirectional_training_block_logits_equal_a_cache_free_decoding_forward(drafter, k=3):
  """The same contract for a drafter_prefix "bidirectional" drafter: Stage II's rows (one per
  block) give each block the logits of the decoder's cache-free drafting forward over the
  whole context (`deer_layout.draft_inputs` without a cache), and none of the causal layout's."""
  both = compiled_micro_model(seed=1, mask_token_id=MASK, sep_token_id=SEP,
                              drafter_prefix="bidirectional")
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(4, 48, (2, 11)), jnp.int32)
  batch = {"tokens": tokens, "prompt_lens": jnp.array([3, 5]), "lengths": jnp.array([9, 11])}
  cuts = jnp.array([[5, 3], [7, 6]])
  rows = deer.stage2_rows(batch, cuts, jnp.full((2, 2), k), k, MASK, SEP, 1.01, True)
  train = jax.jit(lambda r: deer.forward(both, r))(rows)[:, 11:].reshape(2, 2, k + 1, -1)
  for blk in range(2):
    prefix = cuts[:, blk]
    chunk, positions, mask = deer_layout.draft_inputs(
        tokens, jnp.broadcast_to(jnp.arange(11), (2, 11)), jnp.arange(11)[None] < prefix[:, None],
        prefix, k, MASK, SEP)
    decode = jax.jit(both)(chunk, positions, mask)[0]
    np.testing.assert_allclose(decode[:, 12:], train[:, blk, 1:], atol=1e-5)
  causal = jax.jit(lambda r: deer.forward(drafter, r))(rows)[:, 11:].reshape(2, 2, k + 1, -1)
  assert float(jnp.abs(causal - train)[:, :, 1:].max()) > 1e-3  # the same weights, read causally


# ---- objectives ----

@pytest.mark.fast
def test_objectives_refuse_a_drafter_without_mask_or_sep_and_non_teacher_batches(model, drafter):
  batch = one_row()
  for name in ("deer_stage1", "deer_stage2"):
    with pytest.raises(ValueError, match="mask_token_id and sep_token_id"):
      get_objective(name)(model, batch, jax.random.key(0))
    no_sep = nnx.eval_shape(lambda: pf.Transformer(  # abstract: refused before any forward
        dataclasses.replace(drafter.cfg, sep_token_id=None), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="sep_token_id=None"):
      get_objective(name)(no_sep, batch, jax.random.key(0))
    with pytest.raises(ValueError, match=r"teacher rows.*'lengths', 'prompt_lens'"):
      get_objective(name)(drafter, {"tokens": batch["tokens"]}, jax.random.key(0))
  for bad in ({"max_masked": 0}, {"blocks": 0}):
    with pytest.raises(ValueError, match="max_masked >= 1 and blocks >= 1"):
      get_objective("deer_stage2", bad)(drafter, batch, jax.random.key(0))


@pytest.mark.fast
def test_target_counts_are_the_positions_each_objective_scores(model, drafter):
  """`supervised_targets` sums, per step, what each loss scores: its accuracy's weight sum."""
  rng = np.random.default_rng(7)
  batch = {"tokens": jnp.asarray(rng.integers(4, 48, (3, 12)), jnp.int32),
           "prompt_lens": jnp.array([2, 4, 3]), "lengths": jnp.array([12, 10, 12])}
  for name, args, m in [("deer_stage1", {}, drafter), ("ar", {}, model),
                        ("deer_stage2", {"max_masked": 4, "blocks": 3}, drafter)]:
    counted = jax.jit(lambda k: get_objective(name, args).parts(m, batch, k)[1]["accuracy"].count)
    for seed in range(2):
      key = jax.random.key(seed)
      assert int(deer.TARGETS[name](batch, key, **args)) == int(counted(key)), (name, seed)


@pytest.mark.fast
def test_ar_objective_on_teacher_rows_counts_answer_tokens_only(model):
  rng = np.random.default_rng(5)
  tokens = rng.integers(4, 48, (2, 9)).astype(np.int32)
  tokens[0, 7:] = 0  # row 0: prompt 3 + answer 4, padded
  batch = {"tokens": jnp.asarray(tokens), "prompt_lens": jnp.array([3, 5]),
           "lengths": jnp.array([7, 9])}
  ar = jax.jit(lambda b: get_objective("ar")(model, b, None)[0])
  loss = ar(batch)
  causal = jax.jit(lambda t: jax.nn.log_softmax(model(
      t, jnp.broadcast_to(jnp.arange(9), t.shape), masks.causal(jnp.full((2,), 9), 9))[0], -1))
  logp = causal(batch["tokens"])  # row 0's padding is after every target: invisible
  nll = [-logp[row, j - 1, tokens[row, j]] for row, p, n in [(0, 3, 7), (1, 5, 9)]
         for j in range(p, n)]  # the answer tokens only
  np.testing.assert_allclose(loss, np.mean(nll), rtol=1e-5)
  padded = {**batch, "tokens": batch["tokens"].at[0, 7:].set(30)}  # padding is invisible
  np.testing.assert_allclose(ar(padded), loss, rtol=1e-6)
  plain = ar({"tokens": batch["tokens"]})  # packed text rows: every next token counts
  want = -jnp.take_along_axis(logp[:, :-1], batch["tokens"][:, 1:, None], -1).mean()
  np.testing.assert_allclose(plain, want, rtol=1e-5)


# ---- configs and demo stages ----

def _module(path):
  import importlib.util
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _n_params(model_cfg):
  m = nnx.eval_shape(lambda: pf.Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))


@pytest.mark.fast
def test_drafter_configs():
  s1, s2, ar = (load_config(RECIPES / f"{n}.py") for n in
                ("deer_drafter_stage1", "deer_drafter", "ar_drafter"))
  base = load_config(RECIPES / "tiny_ar.py").model
  assert (s1.objective, s2.objective, ar.objective) == ("deer_stage1", "deer_stage2", "ar")
  assert (s1.model.mask_token_id, s1.model.sep_token_id) == (2, 3) and s2.model == s1.model
  assert s2.init_from == "runs/deer_stage1" and dict(s2.objective_args)["max_masked"] == 16
  assert ar.model == dataclasses.replace(s1.model, mask_token_id=None, sep_token_id=None)
  assert ar.data_source == s1.data_source == s2.data_source == "teacher"
  assert ar.data_source_args == s1.data_source_args == s2.data_source_args and ar.data == s1.data
  # equal supervision: the AR drafter's answer tokens are DEER's Stage I + II targets, to a step
  ar_module = _module(RECIPES / "ar_drafter.py")
  per_step = ar.data.batch_size * ar_module.ANSWER_LEN
  assert abs(ar.steps * per_step - ar_module.DEER_TARGETS) <= per_step / 2
  b1, b2 = (load_config(RECIPES / f"deer_drafter_bidirectional{n}.py") for n in ("_stage1", ""))
  assert b1 == dataclasses.replace(s1, model=dataclasses.replace(
      s1.model, drafter_prefix="bidirectional"))
  assert b2 == dataclasses.replace(s2, model=b1.model, init_from="runs/deer_bidirectional_stage1",
                                  objective_args={**dict(s2.objective_args), "blocks": 1},
                                  steps=8 * s2.steps)  # one block per row: 8x the steps
  assert s1.model.vocab_size == base.vocab_size
  assert 0.2 < _n_params(s1.model) / _n_params(base) < 0.35


@pytest.mark.fast
def test_demo_stages_share_one_teacher_store(tmp_path, monkeypatch):
  """ensure("deer_drafter") generates tiny_ar's teacher store once, trains Stage I then Stage II
  from it; ensure("ar_drafter") reuses the store."""
  from paraflax.training import family
  calls = []

  def fake_train(config, workdir, steps=None, overrides=None):
    calls.append(("train", Path(config).stem, dict(overrides or {})))
    (Path(workdir) / "checkpoints" / "1").mkdir(parents=True)

  monkeypatch.setattr(family, "train_from_config_path", fake_train)
  monkeypatch.setattr(family, "teacher_data", lambda src, out, cfg: calls.append(
      ("teacher", Path(src).name, Path(out).name, cfg)))
  b = family.Build(cache=tmp_path, configs=RECIPES, shipped=tmp_path / "none")
  family.ensure("deer_drafter", b)
  family.ensure("ar_drafter", b)
  store = str(tmp_path / "tiny_ar_teacher")
  assert calls == [
      ("train", "tiny_ar", {}),
      ("teacher", "tiny_ar", "tiny_ar_teacher", family.TEACHER),
      ("train", "deer_drafter_stage1", {"data_source_args.path": store}),
      ("train", "deer_drafter", {"init_from": str(tmp_path / "deer_drafter_stage1"),
                                 "data_source_args.path": store}),
      ("train", "ar_drafter", {"data_source_args.path": store})]


@pytest.mark.fast
def test_demo_recopies_a_shipped_model_only_when_it_was_reshipped(tmp_path):
  """A copy of a shipped model (params only) is replaced once checkpoints/ holds a newer save
  (a git pull); an unchanged one, and a model trained in the cache (with opt_state), are kept."""
  from paraflax.training import family
  shipped, cache = tmp_path / "shipped", tmp_path / "cache"
  save = lambda name, meta: (shipped / name / "checkpoints" / "7").mkdir(parents=True) or (
      shipped / name / "checkpoints" / "7" / "_CHECKPOINT_METADATA").write_text(meta)
  save("tiny_ar", "save 1")
  (cache / "asarm" / "checkpoints" / "3" / "opt_state").mkdir(parents=True)  # trained here
  save("asarm", "shipped asarm")
  build = lambda: family.Build(cache=cache, configs=RECIPES, shipped=shipped)
  local = lambda name: cache / name / "local.txt"
  family.ensure("tiny_ar", build())
  local("tiny_ar").write_text("kept while unchanged")
  local("asarm").write_text("trained here")
  family.ensure("tiny_ar", build()), family.ensure("asarm", build())
  assert local("tiny_ar").is_file() and local("asarm").is_file()
  (shipped / "tiny_ar" / "checkpoints" / "7" / "_CHECKPOINT_METADATA").write_text("save 2")
  family.ensure("tiny_ar", build()), family.ensure("asarm", build())
  assert not local("tiny_ar").exists() and local("asarm").is_file()
  assert (cache / "tiny_ar" / "checkpoints" / "7" / "_CHECKPOINT_METADATA").read_text() == "save 2"


# ---- trainer and CLI ----

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A teacher store of a vocab-320 micro AR model, then Stage I, Stage II (from Stage I) and
  the AR drafter trained on it for a few steps each."""
  from paraflax.data.pipeline import DataConfig
  from paraflax.data.tokenizer import train_tokenizer
  from paraflax.training import TrainConfig, train
  from paraflax.training.config.train import OptimConfig
  root = tmp_path_factory.mktemp("deer_runs")
  tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 260)
  teacher_model = compiled_micro_model(vocab_size=320, seed=2)
  stream = np.random.default_rng(6).integers(4, 260, 2000).astype(np.int32)
  cfg = tch.TeacherConfig(examples=24, answer_len=12, min_prompt_len=4, max_prompt_len=10,
                          batch_size=8)
  store = tch.collect(teacher_model, tok, stream, root / "store", cfg, progress=False)
  model_cfg = pf.ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                             d_ff=64, max_seq_len=64, mask_token_id=MASK, sep_token_id=SEP)
  base = TrainConfig(
      model=model_cfg, data_source="teacher",
      data_source_args={"path": str(store), "val_fraction": 0.25},
      data=DataConfig(seq_len=22, batch_size=4, vocab_size=320, max_files=2,  # 10 + 12
                      cache_dir=str(root / "data"), progress=False),
      optim=OptimConfig(peak_lr=1e-2, warmup_steps=2, weight_decay=0.0),
      steps=4, eval_every=4, eval_batches=1, checkpoint_every=4, log_every=1)
  out = {}
  for name, cfg in [
      ("stage1", dataclasses.replace(base, objective="deer_stage1")),
      ("stage2", dataclasses.replace(base, objective="deer_stage2", init_from=str(root / "stage1"),
                                     objective_args={"max_masked": 4, "blocks": 3})),
      ("ar", dataclasses.replace(base, objective="ar", model=dataclasses.replace(
          model_cfg, mask_token_id=None, sep_token_id=None)))]:
    out[name] = train(cfg, root / name, progress=False)
  return root, out


@pytest.mark.slow
def test_trainer_runs_each_objective_on_a_teacher_store(runs):
  from paraflax.training import read_metrics
  root, out = runs
  for name, summary in out.items():
    assert summary["step"] == 4 and np.isfinite(summary["train_loss"])
    vals = [m["val_loss"] for m in read_metrics(root / name) if "val_loss" in m]
    assert len(vals) == 2 and np.all(np.isfinite(vals)), (name, vals)
  logged = read_metrics(root / "stage2")[-2]
  assert {"accuracy", "first_accuracy", "loss"} <= set(logged)
  cfg = lambda name: pf.training.TrainConfig.from_dict(json.loads((root / name / "config.json")
                                                                   .read_text()))
  assert deer.supervised_targets(cfg("ar")) == 4 * 4 * 12  # steps x rows x answer tokens
  assert 4 * 4 <= deer.supervised_targets(cfg("stage1")) < 4 * 4 * 12


@pytest.mark.slow
def test_cli_teacher_data_prints_a_summary(runs, tmp_path, monkeypatch, capsys):
  from paraflax import cli
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  root, _ = runs
  out = tmp_path / "store"
  assert cli.main(["teacher-data", "--workdir", str(root / "ar"), "--out", str(out),
                   "--examples", "6", "--answer-len", "4", "--min-prompt-len", "3",
                   "--max-prompt-len", "8", "--batch-size", "4"]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["examples"] == 6 and summary["answer_tokens"] == 24
  assert tch.load(out).meta["source"] == str(root / "ar")
