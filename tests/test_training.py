"""Training: clear config errors, a causal AR objective, a run that learns, exact reload."""

import dataclasses
import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paraflax as pf
from paraflax.data import corpus
from paraflax.data.pipeline import prepare_stdlib, validation_batches
from paraflax.data.tokenizer import train_tokenizer
from paraflax.devices import peak_flops
from paraflax.model import masks
from paraflax.training import (
  OBJECTIVES,
  TrainConfig,
  apply_overrides,
  evaluate,
  get_objective,
  load_config,
  load_trained,
  read_metrics,
  register_objective,
  train,
)
from paraflax.training.config.recipes import RECIPES
from paraflax.training.config.train import OptimConfig, config_differences
from paraflax.training.run import optim
from paraflax.training.run.flops import train_flops
from paraflax.training.run.trainer import init_params


@pytest.fixture(scope="module")
def micro_cfg(tmp_path_factory) -> TrainConfig:
  cfg = load_config(RECIPES / "micro_ar.py")
  cache = str(tmp_path_factory.mktemp("data-cache"))
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=cache,
                                                           progress=False))


# ---------------------------------------------------------------- config and errors (fast)

@pytest.mark.fast
def test_sequence_longer_than_model_max_is_a_clear_error(micro_cfg):
  with pytest.raises(ValueError, match=r"seq_len=128 is above the model's max_seq_len=64"):
    dataclasses.replace(micro_cfg, data=dataclasses.replace(micro_cfg.data, seq_len=128))


@pytest.mark.fast
def test_vocab_mismatch_names_both_sizes(micro_cfg):
  with pytest.raises(ValueError, match=r"vocab mismatch between tokenizer and model.*512.*320"):
    dataclasses.replace(micro_cfg, data=dataclasses.replace(micro_cfg.data, vocab_size=512))
  # at data-prep time: a tokenizer with more ids than the embedding table
  tok = train_tokenizer(corpus.stdlib_documents("train", 0.05, 12), 400)
  assert tok.vocab_size > micro_cfg.model.vocab_size
  with pytest.raises(ValueError, match=rf"vocab mismatch between tokenizer and model.*"
                                       rf"{tok.vocab_size} ids.*vocab_size=320"):
    micro_cfg.check_tokenizer(tok)


@pytest.mark.fast
def test_load_trained_of_a_missing_workdir_names_it(tmp_path):
  missing = tmp_path / "no-such-run"
  with pytest.raises(FileNotFoundError, match="no-such-run"):
    load_trained(missing)
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_trained(tmp_path)  # exists, but is not a training workdir


@pytest.mark.fast
def test_config_validation_and_overrides(micro_cfg):
  with pytest.raises(ValueError, match="unknown objective 'nope'.*'ar'"):
    dataclasses.replace(micro_cfg, objective="nope")
  with pytest.raises(ValueError, match="steps must be >= 1"):
    dataclasses.replace(micro_cfg, steps=0)
  with pytest.raises(ValueError, match="peak_lr"):
    OptimConfig(peak_lr=0.0)
  cfg = apply_overrides(micro_cfg, {"optim.peak_lr": "1e-3", "data.max_files": "None",
                                    "steps": "7", "data.cache_dir": "/tmp/x"})
  assert (cfg.optim.peak_lr, cfg.data.max_files, cfg.steps, cfg.data.cache_dir) == (
      1e-3, None, 7, "/tmp/x")
  with pytest.raises(ValueError, match="unknown config field 'optim.lr'"):
    apply_overrides(micro_cfg, {"optim.lr": 1.0})


@pytest.mark.fast
def test_config_json_round_trip_and_resume_differences(micro_cfg):
  cfg = dataclasses.replace(micro_cfg, objective_args={})
  assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
  longer = dataclasses.replace(cfg, steps=80, eval_every=5)
  assert config_differences(cfg, longer) == ["optim.total_steps: 40 (saved) vs 80 (given)"]
  fixed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, total_steps=40))
  assert config_differences(fixed, dataclasses.replace(fixed, steps=80)) == []
  wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=64))
  assert config_differences(cfg, wider) == ["model.d_model: 32 (saved) vs 64 (given)"]


@pytest.mark.fast
def test_schedule_warms_up_then_decays_to_the_end_fraction():
  cfg = OptimConfig(peak_lr=1e-2, warmup_steps=10, end_lr_fraction=0.1)
  lr = optim.schedule(cfg, 100)
  values = np.array([float(lr(c)) for c in range(100)])
  assert values[0] > 0  # the first update moves
  assert np.all(np.diff(values[:10]) > 0) and values[9] == pytest.approx(1e-2)
  assert np.all(np.diff(values[9:]) <= 1e-12)
  assert values[99] == pytest.approx(1e-3)


def _micro(seed=0):
  cfg = pf.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       max_seq_len=16)
  return init_params(cfg, seed)  # one compile, not one per parameter


@pytest.mark.fast
def test_init_params_draws_every_parameter_as_the_modules_do():
  """One compiled call with one layer's samplers in a loop: the tree, shapes and dtypes of the
  model's own, every layer a fresh draw at its initialiser's scale, seeds reproducible."""
  cfg = pf.ModelConfig(vocab_size=48, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                       d_ff=256, max_seq_len=16, qkv_bias=True, two_stream=True)
  graphdef, params = init_params(cfg, 0)
  want = nnx.state(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  assert jax.tree.structure(params) == jax.tree.structure(want)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
      lambda x: (x.shape, x.dtype), want)
  ups = [np.asarray(params["layers"][i]["mlp"]["w_up"][...]) for i in range(3)]
  assert not np.allclose(ups[0], ups[1]) and not np.allclose(ups[1], ups[2])
  for up in ups:  # lecun normal, fan-in 32: std 0.177 (8192 draws: within 5%)
    assert abs(up.std() / 32 ** -0.5 - 1) < 0.05
  assert np.all(np.asarray(params["layers"][2]["attn"]["bq"][...]) == 0)
  assert np.all(np.asarray(params["layers"][1]["mlp_norm"]["scale"][...]) == 1)
  again = init_params(cfg, 0)[1]
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))


@pytest.mark.fast
def test_objectives_registry():
  assert "ar" in OBJECTIVES
  with pytest.raises(ValueError, match="already registered"):
    register_objective("ar")(lambda model, batch, rng: (0.0, {}))

  @register_objective("test-scaled-ar", replace=True)
  def scaled(model, batch, rng, scale=1.0):
    loss, metrics = OBJECTIVES["ar"](model, batch, rng)
    return scale * loss, metrics

  graphdef, params = _micro()
  batch = {"tokens": jax.random.randint(jax.random.key(0), (2, 16), 0, 48)}
  loss = jax.jit(lambda p, fn: fn(nnx.merge(graphdef, p), batch, None)[0], static_argnums=1)
  bound = get_objective("test-scaled-ar", {"scale": 2.0})
  np.testing.assert_allclose(loss(params, bound), 2 * loss(params, get_objective("ar")),
                             rtol=1e-6)


@pytest.mark.fast
def test_ar_loss_is_the_nll_of_each_next_token_given_its_prefix_only():
  """Causal mask + positions 0..L-1: position t's prediction ignores every token after t."""
  graphdef, params = _micro(1)
  b, l = 2, 12
  tokens = jax.random.randint(jax.random.key(2), (b, l), 0, 48)
  loss, metrics = jax.jit(lambda p: OBJECTIVES["ar"](nnx.merge(graphdef, p), {"tokens": tokens},
                                                     jax.random.key(0)))(params)

  @jax.jit
  def next_token_logp(p, toks, t):  # log p(x_{t+1} | toks) read at position t
    pos = jnp.broadcast_to(jnp.arange(l), (b, l))
    logits, _ = nnx.merge(graphdef, p)(toks, pos, masks.causal(jnp.full((b,), l), l))
    return jax.nn.log_softmax(logits[:, t])

  nll = []
  for t in range(l - 1):  # scramble everything after t: the prediction must not move
    noise = jax.random.randint(jax.random.key(10 + t), (b, l), 0, 48)
    scrambled = jnp.where(jnp.arange(l) > t, noise, tokens)
    logp = next_token_logp(params, scrambled, t)
    np.testing.assert_allclose(logp, next_token_logp(params, tokens, t), atol=1e-5)
    nll.append(-jnp.take_along_axis(logp, tokens[:, t + 1:t + 2], -1)[:, 0])
  np.testing.assert_allclose(loss, jnp.mean(jnp.stack(nll)), rtol=1e-5)
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0


# ---------------------------------------------------------------- a real (micro) run

@pytest.fixture(scope="module")
def trained(micro_cfg, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  return workdir, train(micro_cfg, workdir, progress=False)


@pytest.mark.slow
def test_micro_run_learns_and_writes_its_artifacts(trained, micro_cfg):
  workdir, summary = trained
  assert summary["step"] == micro_cfg.steps and summary["start_step"] == 0
  entries = read_metrics(workdir)
  train_entries = [e for e in entries if "loss" in e]
  val = [e["val_loss"] for e in entries if "val_loss" in e]
  assert [e["step"] for e in train_entries] == list(range(1, micro_cfg.steps + 1))
  for key in ("loss", "lr", "tokens_per_s", "batch_fingerprint", "grad_norm", "accuracy",
              "tflops_per_device", "mfu"):
    assert all(key in e for e in train_entries), key
  # throughput: the step's FLOPs (`flops.py`) over its time; MFU null without a known peak (CPU)
  flops = train_flops(micro_cfg.model, "ar", micro_cfg.data.batch_size, micro_cfg.data.seq_len)
  for e in train_entries:
    assert np.isfinite(e["tokens_per_s"]) and e["tokens_per_s"] > 0
    tokens_per_step = micro_cfg.data.batch_size * micro_cfg.data.seq_len
    np.testing.assert_allclose(e["tflops_per_device"],
                               e["tokens_per_s"] / tokens_per_step * flops / 1e12, rtol=1e-9)
    assert e["mfu"] is None if peak_flops() is None else 0 < e["mfu"] < 1
  assert len(val) == micro_cfg.steps // micro_cfg.eval_every + 1  # step 0, then every eval
  assert val[-1] < val[0] - 1.0  # validation loss clearly decreases
  assert np.mean([e["loss"] for e in train_entries[-5:]]) < train_entries[0]["loss"] - 1.0
  assert summary["val_loss"] == val[-1] and summary["tokens_per_s"] > 0
  assert summary["flops_per_step"] == flops and summary["tflops_per_device"] > 0
  assert (workdir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (workdir / "tokenizer.json").is_file() and (workdir / "config.json").is_file()
  # the run control as resolved, naming the platform and device it was resolved for; on the
  # CPU (no memory figure) nothing is fitted (`fit.py`): "auto" keeps its static rules
  assert json.loads((workdir / "run_control.json").read_text()) == {
      **micro_cfg.run.resolved(micro_cfg.model, micro_cfg.data.seq_len), "platform": "cpu",
      "loss_chunk": None, "grad_accum": micro_cfg.grad_accum, "fit": [],
      "device": jax.devices()[0].device_kind}


@pytest.mark.slow
def test_load_trained_restores_the_trained_params(trained, micro_cfg):
  workdir, summary = trained
  model, tokenizer, cfg = load_trained(workdir)
  assert cfg == micro_cfg
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 3 \(saved: \[30, 40\]\)"):
    load_trained(workdir, step=3)
  data = prepare_stdlib(cfg.data, tokenizer=tokenizer)
  val = validation_batches(data.val_tokens, cfg.data)[:cfg.eval_batches]
  # the logged final validation loss was computed in the trainer from the trained params
  got = evaluate(model, val, get_objective(cfg.objective), jax.random.key(0))
  assert got == pytest.approx(summary["val_loss"], rel=1e-6)
  # and a model built from the config's seed alone (untrained) is far from it
  fresh = nnx.merge(*init_params(cfg.model, cfg.seed))
  assert evaluate(fresh, val, get_objective(cfg.objective), jax.random.key(0)) > got + 1.0


@pytest.mark.slow
def test_profile_steps_write_a_trace_of_those_steps(micro_cfg, tmp_path, capsys, monkeypatch):
  """`--profile-steps 1:3`: a jax.profiler trace of steps 1 and 2 (0-based) in
  WORKDIR/profile, for XProf (xplane.pb) and Perfetto (trace.json.gz)."""
  workdir = tmp_path / "run"
  summary = train(micro_cfg, workdir, progress=False, max_steps=4, profile_steps=(1, 3))
  assert summary["step"] == 4
  traces = list((workdir / "profile").rglob("*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  events = json.loads(gzip.decompress(next((workdir / "profile").rglob("*.trace.json.gz"))
                                      .read_bytes()))["traceEvents"]
  assert sorted(e["args"]["step_num"] for e in events if e.get("name") == "train") == ["1", "2"]
  from paraflax import cli
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  for bad in ("3:1", "2", "a:b"):
    assert cli.main(["train", "--config", "micro_ar", "--workdir",
                     str(tmp_path / "bad"), "--profile-steps", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paraflax train: error: --profile-steps expects A:B") and "\n" not in err
  assert not (tmp_path / "bad").exists()  # refused before anything is written


@pytest.mark.slow
def test_resuming_a_workdir_with_another_config_is_a_clear_error(trained, micro_cfg):
  workdir, _ = trained
  wider = dataclasses.replace(micro_cfg, model=dataclasses.replace(micro_cfg.model, d_model=64))
  with pytest.raises(ValueError, match=r"config mismatch(.|\n)*model.d_model: 32 \(saved\) vs 64"):
    train(wider, workdir, progress=False)
  # a finished run asked for no more steps is a no-op that reports where it stands
  assert train(micro_cfg, workdir, progress=False)["step"] == micro_cfg.steps
