"""Jacobi Forcing data: schedule (Eq. 7), noisy-point choice, packing, noise-aware mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from paraflax.model import masks
from paraflax.model import mask_structure as ms
from paraflax.training.objectives import jacobi_forcing as jf
from conftest import StubTokenizer


@pytest.mark.fast
def test_progressive_schedule_is_cyclic_and_linear():
  np.testing.assert_allclose(jf.noise_schedule(6, 4), [0, .25, .5, .75, 0, .25])
  with pytest.raises(ValueError, match="window must be >= 1"):
    jf.noise_schedule(3, 0)


@pytest.mark.fast
def test_pick_noisy_takes_the_state_nearest_the_target_fraction():
  fixed = np.array([1, 2, 3, 4])
  traj = np.array([[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 3], [1, 2, 3, 4]])  # 1, .75, .5, 0
  assert jf.pick_noisy(traj, fixed, 0.5).tolist() == [1, 2, 9, 3]
  assert jf.pick_noisy(traj, fixed, 0.7).tolist() == [1, 9, 9, 9]
  assert jf.pick_noisy(traj, fixed, 0.9).tolist() == [9, 9, 9, 9]
  assert jf.pick_noisy(traj, fixed, 0.0).tolist() == [1, 2, 3, 4]


@pytest.mark.fast
def test_suffix_noise_counts_every_token_after_the_first_divergence():
  fixed = np.array([1, 2, 3, 4])
  traj = np.array([[9, 9, 9, 9], [1, 9, 3, 4], [1, 2, 3, 4]])  # unconverged 1, .25, 0
  assert jf.pick_noisy(traj, fixed, 0.25).tolist() == [1, 9, 3, 4]
  assert jf.pick_noisy(traj, fixed, 0.25, "suffix").tolist() == [1, 2, 3, 4]  # .75 is far
  assert jf.pick_noisy(traj, fixed, 0.75, "suffix").tolist() == [1, 9, 3, 4]
  # the suffix grid holds fully noisy blocks and no fixed point; the paper's the reverse
  np.testing.assert_allclose(jf.noise_levels(6, 4, 1), [.25, .5, .75, 0, .25, .5])
  np.testing.assert_allclose(jf.noise_levels(6, 4, 1, "suffix"), [.5, .75, 1, .25, .5, .75])
  with pytest.raises(ValueError, match="noise_measure must be one of"):
    jf.TrajectoryData("s", noise_measure="first")


@pytest.mark.fast
def test_packing_puts_the_streams_apart_and_pairs_share_positions():
  p = jf.pack(np.array([7, 8]), np.array([[1, 9], [3, 9]]), np.array([[1, 2], [3, 4]]))
  assert p.tokens.tolist() == [7, 8, 1, 9, 3, 9, 1, 2, 3, 4]
  assert p.positions.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
  assert p.kinds.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
  assert p.blocks.tolist() == [-1, -1, 0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.fast
def test_noise_aware_mask_equals_the_hand_built_one():
  p = jf.pack(np.array([7, 8]), np.zeros((2, 2), int), np.zeros((2, 2), int))
  got = np.asarray(masks.noise_aware(jnp.asarray(p.kinds)[None], jnp.ones((1, 10), bool))[0])
  want = np.array([[c == "1" for c in row] for row in [
      "1000000000",  # p
      "1100000000",  # p
      "1110000000",  # n1: prompt, itself causally
      "1111000000",
      "1111100000",  # n2: prompt, n1, itself
      "1111110000",
      "1100001000",  # c1: prompt, itself (not the noisy stream)
      "1100001100",
      "1100001110",  # c2: prompt, c1, itself
      "1100001111"]])
  np.testing.assert_array_equal(got, want)
  padded = masks.noise_aware(jnp.array([[0, 1, 2, 0]]), jnp.array([[True, True, True, False]]))
  np.testing.assert_array_equal(padded[0, :, 3], [False, False, False, True])


def _ragged(rng, b, p, vocab):
  lens = rng.integers(2, p + 1, b).astype(np.int32)
  prompts = np.zeros((b, p), np.int32)
  for i, n in enumerate(lens):
    prompts[i, :n] = rng.integers(4, vocab, n)
  return prompts, lens


@pytest.mark.parametrize("n", [1, 4])
def test_trajectories_end_at_greedy_ar_and_keep_the_jacobi_property(model, n):
  import jax

  import paraflax as pf
  from paraflax.decoding.state import Forward
  from paraflax.training.stores.trajectories import jacobi_trajectories
  prompts, lens = _ragged(np.random.default_rng(0), 3, 9, 48)
  traj, iters = jax.device_get(jacobi_trajectories(
      Forward.of(model), jnp.asarray(prompts), jnp.asarray(lens), jax.random.key(0),
      block_size=n, num_blocks=3))
  assert traj.shape == (3, 3, n + 1, n) and iters.shape == (3, 3)
  ar = pf.generate(model, [p[:k].tolist() for p, k in zip(prompts, lens)], max_new_tokens=3 * n)
  np.testing.assert_array_equal(traj[:, :, -1].reshape(3, -1), ar.tokens)
  fixed = traj[:, :, -1:]
  for k in range(n + 1):  # after k iterations the first k tokens are final
    np.testing.assert_array_equal(traj[:, :, k, :k], fixed[:, :, 0, :k])
  assert np.all(iters <= n) and np.all(iters >= 0)
  for row in range(3):  # initial guesses come from the row's own prompt
    assert set(traj[row, :, 0].ravel()) <= set(prompts[row, :lens[row]])
  converged = np.all(traj == fixed, -1)  # [B, nb, n+1]
  np.testing.assert_array_equal(np.argmax(converged, -1), iters)
  assert np.all(converged[np.arange(n + 1) >= iters[..., None]])


@pytest.mark.fast
def test_collection_resumes_after_a_crash_and_equals_an_uninterrupted_run(model, tmp_path,
                                                                         monkeypatch):
  from paraflax.training.stores import trajectories as tr
  tokens = np.random.default_rng(1).integers(4, 48, 500).astype(np.int32)
  cfg = tr.CollectConfig(block_size=4, num_blocks=2, examples=10, min_prompt_len=3,
                         max_prompt_len=8, batch_size=4)
  whole = tr.load(tr.collect(model, StubTokenizer(), tokens, tmp_path / "a", cfg, progress=False))
  real, calls = tr.jacobi_trajectories, []

  def crash_on_second(*a, **k):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(*a, **k)

  monkeypatch.setattr(tr, "jacobi_trajectories", crash_on_second)
  with pytest.raises(KeyboardInterrupt):
    tr.collect(model, StubTokenizer(), tokens, tmp_path / "b", cfg, progress=False)
  with pytest.raises(ValueError, match="incomplete"):
    tr.load(tmp_path / "b")
  monkeypatch.setattr(tr, "jacobi_trajectories", real)
  resumed = tr.load(tr.collect(model, StubTokenizer(), tokens, tmp_path / "b", cfg, progress=False))
  for k in tr.ARRAYS:
    np.testing.assert_array_equal(getattr(resumed, k), getattr(whole, k))
  assert whole.trajectories.shape == (10, 2, 5, 4)
  other = tr.CollectConfig(block_size=2, num_blocks=2, examples=10, min_prompt_len=3,
                           max_prompt_len=8, batch_size=4)
  with pytest.raises(ValueError, match="other settings"):
    tr.collect(model, StubTokenizer(), tokens, tmp_path / "b", other, progress=False)


@pytest.mark.fast
def test_example_targets_partners_and_consistency_weights():
  prompt = np.array([7, 8])
  noisy = np.array([[1, 9], [9, 9]])  # block 0 departs at slot 1, block 1 at slot 0
  clean = np.array([[1, 2], [3, 4]])
  ex = jf.example(prompt, noisy, clean, 12)
  # the prompt region is 12 - 2 x 4 slots, padded after the noisy stream: the clean stream
  # starts at 4 + 4 whatever the prompt's length
  #                                 p  p n1 n1 n2 n2 pad pad c1 c1 c2 c2
  assert ex["tokens"].tolist() == [7, 8, 1, 9, 9, 9, 0, 0, 1, 2, 3, 4]
  assert ex["positions"].tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 2, 3, 4, 5]
  assert ex["valid"].tolist() == [1] * 6 + [0, 0] + [1] * 4
  assert ex["ar_targets"].tolist() == [8, 1, 0, 0, 0, 0, 0, 0, 2, 3, 4, 0]
  assert ex["ar_weights"].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
  assert ex["partner"].tolist() == [0, 1, 8, 9, 10, 11, 6, 7, 8, 9, 10, 11]
  assert ex["kl_weights"].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]
  with pytest.raises(ValueError, match="more than the row length"):
    jf.example(prompt, noisy, clean, 9)


def test_packed_forward_equals_separate_causal_forwards_of_both_streams(model):
  """One forward over the packed row gives the clean stream's and the noisy stream's own causal
  logits: the noise-aware mask and the shared positions are what make that true."""
  import paraflax as pf
  prompt, noisy, clean = np.array([5, 6, 7]), np.array([[1, 9, 9], [8, 2, 3]]), \
      np.array([[1, 2, 3], [4, 5, 6]])
  ex = {k: jnp.asarray(v)[None] for k, v in jf.example(prompt, noisy, clean, 16).items()}
  packed, _ = model(ex["tokens"], ex["positions"], masks.noise_aware(ex["kinds"], ex["valid"]))
  # the prompt region is 16 - 2 x 6 = 4 slots: the prompt, then one padding slot after the
  # noisy stream
  windowed, _ = model(ex["tokens"], ex["positions"],
                      ms.noise_aware(ex["kinds"], ex["valid"], prompt_len=4))
  np.testing.assert_allclose(windowed, packed, atol=1e-6)

  def causal(seq):
    t = len(seq)
    return model(jnp.asarray(seq)[None], jnp.arange(t)[None], pf.masks.causal(jnp.array([t]), t))[0][0]

  clean_logits = causal(np.concatenate([prompt, clean.ravel()]))
  noisy_logits = causal(np.concatenate([prompt, noisy.ravel()]))
  idx = np.concatenate([np.arange(3), np.arange(10, 16)])
  np.testing.assert_allclose(packed[0, idx], clean_logits, atol=1e-5)
  noisy_idx = np.arange(9)
  np.testing.assert_allclose(packed[0, noisy_idx], noisy_logits, atol=1e-5)


def test_jacobi_forcing_loss_gradients_follow_the_recipe(model):
  """The clean twin is a stop-gradient teacher; AR and consistency terms add with weight w."""
  import jax
  from flax import nnx
  ex = jf.example(np.array([5, 6, 7]), np.array([[1, 9, 9], [8, 2, 3]]),
                  np.array([[1, 2, 3], [4, 5, 6]]), 16)
  batch = {k: jnp.asarray(np.stack([v, v])) for k, v in ex.items()}
  loss, m = jf.jacobi_forcing_loss(model, batch, None, ar_weight=10.0, prompt_len=4)
  np.testing.assert_allclose(loss, m["consistency"] + 10 * m["ar_loss"], rtol=1e-6)
  assert 0 <= m["noisy_accuracy"] <= 1 and m["consistency"] > 0
  # with no consistency slots the loss is exactly w * AR
  zero = {**batch, "kl_weights": jnp.zeros_like(batch["kl_weights"])}
  loss0, m0 = jf.jacobi_forcing_loss(model, zero, None, ar_weight=3.0, prompt_len=4)
  np.testing.assert_allclose(loss0, 3 * m0["ar_loss"], rtol=1e-6)
  # the teacher is detached: when noisy rows equal clean rows the student's logits equal the
  # teacher's and the soft CE's gradient softmax(z) - p vanishes; a live teacher would add the
  # entropy gradient, which does not
  same = jf.example(np.array([5, 6, 7]), np.array([[1, 2, 3], [4, 5, 6]]),
                    np.array([[1, 2, 3], [4, 5, 6]]), 16)
  same = {k: jnp.asarray(v[None]) for k, v in same.items()}
  same["kl_weights"] = jnp.where(same["kinds"] == masks.NOISY, 1.0, 0.0)
  graphdef, params = nnx.split(model)
  grad = jax.grad(lambda p: jf.jacobi_forcing_loss(nnx.merge(graphdef, p), same, None,
                                                   ar_weight=0.0, prompt_len=4)[0])(params)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad)) < 1e-5
  ar_grad = jax.grad(lambda p: jf.jacobi_forcing_loss(nnx.merge(graphdef, p), same, None,
                                                      ar_weight=1.0, prompt_len=4)[0])(params)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ar_grad)) > 1e-3


@pytest.mark.fast
def test_hard_consistency_is_cross_entropy_against_the_fixed_point(model):
  ex = jf.example(np.array([5, 6, 7]), np.array([[1, 9, 9], [8, 2, 3]]),
                  np.array([[1, 2, 3], [4, 5, 6]]), 16)
  batch = {k: jnp.asarray(v[None]) for k, v in ex.items()}
  loss, m = jf.jacobi_forcing_loss(model, batch, None, ar_weight=2.0, consistency="hard",
                                  prompt_len=4)
  logits, _ = model(batch["tokens"], batch["positions"],
                    masks.noise_aware(batch["kinds"], batch["valid"]))
  logp = np.asarray(jax_log_softmax(logits[0]))
  # noisy slots (3..8) from the first divergence: block 0 slots 1, 2 (idx 4, 5) -> fixed point
  # 3, 4; block 1 slots 0..2 (idx 6..8) -> fixed point 5, 6 and nothing after the last block
  want = -np.mean([logp[4, 3], logp[5, 4], logp[6, 5], logp[7, 6]])
  np.testing.assert_allclose(m["consistency"], want, rtol=1e-5)
  np.testing.assert_allclose(loss, want + 2 * m["ar_loss"], rtol=1e-5)
  with pytest.raises(ValueError, match="consistency must be"):
    jf.jacobi_forcing_loss(model, batch, None, consistency="kl", prompt_len=4)
  with pytest.raises(ValueError, match="jacobi_forcing needs objective_args.prompt_len"):
    jf.jacobi_forcing_loss(model, batch, None)
  with pytest.raises(ValueError, match="rows of 16 slots cannot be a prompt region of 5"):
    jf.jacobi_forcing_loss(model, batch, None, prompt_len=5)


@pytest.mark.parametrize("consistency, temperature", [("soft", 1.0), ("soft", 2.0),
                                                      ("hard", 1.0)])
def test_loss_metrics_and_gradients_equal_the_per_slot_definition(model, consistency,
                                                                  temperature):
  """The paired head (each slot projected once, a noisy slot's teacher its clean twin's
  logits) gives what the recipe defines slot by slot on the full logits, each noisy slot
  against its `partner`'s detached logits, in float32: rows with unequal prompts (the noisy
  stream at other slots), whole row and in chunks."""
  import jax
  import optax
  from flax import nnx
  import paraflax as pf
  from paraflax.training.objectives.means import Mean
  from test_head_loss import assert_step_close
  g = np.random.default_rng(0)
  rows = []
  for p in (2, 4):  # prompt region 4: the second row's prompt fills it
    clean = g.integers(4, 40, (2, 3))
    noisy = np.where(g.random((2, 3)) < 0.5, clean, g.integers(4, 40, (2, 3)))
    rows.append(jf.example(g.integers(4, 40, p), noisy, clean, 16))
  batch = {k: jnp.asarray(np.stack([a[k], b[k]])) for k, (a, b) in
           ((k, (rows[0], rows[1])) for k in rows[0])}
  tau = temperature

  def reference(m):
    z, _ = m(batch["tokens"], batch["positions"],
             masks.noise_aware(batch["kinds"], batch["valid"]))
    nll = lambda y: optax.softmax_cross_entropy_with_integer_labels(z, y)
    hit = lambda y: (jnp.argmax(z, -1) == y).astype(jnp.float32)
    partner, w = batch["partner"], batch["kl_weights"]
    y_n = jnp.take_along_axis(batch["ar_targets"], partner, 1)
    has = w * jnp.take_along_axis(batch["ar_weights"], partner, 1)
    u = jax.lax.stop_gradient(jnp.take_along_axis(z, partner[..., None], 1))
    soft = -jnp.sum(jax.nn.softmax(u / tau) * jax.nn.log_softmax(z / tau), -1) * tau ** 2
    ar = Mean.of(nll(batch["ar_targets"]), batch["ar_weights"]).value
    c = (Mean.of(nll(y_n), has) if consistency == "hard" else Mean.of(soft, w)).value
    return c + 10.0 * ar, {"ar_loss": ar, "consistency": c,
                           "accuracy": Mean.of(hit(batch["ar_targets"]), batch["ar_weights"]).value,
                           "noisy_accuracy": Mean.of(hit(y_n), has).value}

  def paired(chunk):
    def run(m):
      m.run = pf.RunControl(loss_chunk=chunk)
      return jf.jacobi_forcing_loss(m, batch, None, temperature=tau, consistency=consistency,
                                    prompt_len=4)
    return run

  graphdef, params = nnx.split(model)
  with jax.default_matmul_precision("highest"):
    def grads(fn):
      step = jax.value_and_grad(lambda p: fn(nnx.merge(graphdef, p)), has_aux=True)
      return jax.jit(step)(params)
    want = grads(reference)
    for chunk in (None, 3):
      assert_step_close(grads(paired(chunk)), want)


def jax_log_softmax(x):
  import jax
  return jax.nn.log_softmax(x, -1)


@pytest.mark.fast
def test_the_trainer_and_the_dry_run_take_the_prompt_region_from_the_store(model, tmp_path):
  """A run's rows fix Jacobi Forcing's `prompt_len` (its windows' bounds): filled in from the
  store's meta, a different configured value refused, nothing filled for an objective that
  does not take it; a dry run before the store exists takes the source's stand-in (a prompt
  region of 0: streams of half the row)."""
  from paraflax.training.config.train import apply_overrides, load_config
  from paraflax.training.stores import trajectories as tr
  tokens = np.random.default_rng(1).integers(4, 48, 500).astype(np.int32)
  store = tr.collect(model, StubTokenizer(), tokens, tmp_path / "s", tr.CollectConfig(
      block_size=4, num_blocks=2, examples=4, min_prompt_len=3, max_prompt_len=8, batch_size=4),
      progress=False)
  cfg = apply_overrides(load_config("micro_jacobi_forcing"),
                        {"data_source_args.path": str(store), "data.seq_len": 24})
  assert dict(cfg.objective_args).get("prompt_len") is None
  assert dict(cfg.with_row_args().objective_args)["prompt_len"] == 8
  same = apply_overrides(cfg, {"objective_args.prompt_len": 8})
  assert same.with_row_args() == same
  with pytest.raises(ValueError, match=r"objective_args.prompt_len=4, but the 'trajectories' "
                                       r"rows have prompt_len=8: leave it unset"):
    apply_overrides(cfg, {"objective_args.prompt_len": 4}).with_row_args()
  ar = apply_overrides(cfg, {"objective": "ar"})
  assert ar.with_row_args() == ar
  missing = apply_overrides(cfg, {"data_source_args.path": str(tmp_path / "none")})
  assert dict(missing.with_row_args(missing_ok=True).objective_args)["prompt_len"] == 0
  odd = apply_overrides(missing, {"data.seq_len": 25})
  assert dict(odd.with_row_args(missing_ok=True).objective_args)["prompt_len"] == 1
  with pytest.raises(FileNotFoundError, match="no trajectory store"):
    missing.with_row_args()
  # `train --dry-run` compiles the run's program: the store's prompt region, in its FLOPs too
  from paraflax.training.run import flops
  from paraflax.training.run.dry_run import dry_run
  report = dry_run(cfg)
  args = dict(cfg.objective_args)
  assert report["flops_per_step"] == flops.train_flops(
      cfg.model, cfg.objective, cfg.data.batch_size, 24, {**args, "prompt_len": 8})
  assert report["flops_per_step"] != flops.train_flops(
      cfg.model, cfg.objective, cfg.data.batch_size, 24, args)
