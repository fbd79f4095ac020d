"""`paraflax train --dry-run`: one training step compiled with abstract shapes on the config's
mesh, XLA's memory report printed last as JSON; no weights, no data, nothing written. A
store's rows must have the config's `data.seq_len` (the packed row length)."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from paraflax import cli
from paraflax.training import apply_overrides, load_config
from paraflax.training.config.recipes import RECIPES
from paraflax.training.objectives import jacobi_forcing as jf
from paraflax.training.run.dry_run import abstract_batch, dry_run
from paraflax.training.run.flops import train_flops
from paraflax.training.run.step import init_params
from paraflax.training.stores import teacher as tch
from paraflax.training.stores import trajectories as tr
from conftest import StubTokenizer

SHIPPED = ("tiny_ar", "jacobi_forcing_r1", "tidar_scratch", "deer_drafter_stage1",
           "deer_drafter", "asarm")
REPORTED = {"params", "devices", "argument_bytes", "output_bytes", "temp_bytes", "compile_s",
            "flops_per_step"}
# micro shapes, given with the --set flags a user gives for a real model's shapes
MICRO = ("model.vocab_size=64", "data.vocab_size=64", "model.d_model=16", "model.n_layers=1",
         "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32", "model.max_seq_len=32",
         "model.qkv_bias=True", "model.tie_embeddings=True", "data.seq_len=16",
         "data.batch_size=2")


def micro(config: str, tmp_path: Path, **extra):
  """A shipped config at micro shapes, its store and `init_from` pointing nowhere."""
  sets = dict(s.split("=", 1) for s in MICRO)
  cfg = load_config(RECIPES / f"{config}.py")
  if cfg.data_source != "stdlib":
    sets["data_source_args.path"] = str(tmp_path / "no-store")
  if cfg.init_from is not None:
    sets["init_from"] = str(tmp_path / "no-run")
  return apply_overrides(cfg, {**sets, **extra})


@pytest.mark.fast
def test_dry_run_prints_the_memory_report_last_and_writes_nothing(tmp_path, monkeypatch,
                                                                   capsys):
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  workdir = tmp_path / "run"
  argv = ["train", "--config", str(RECIPES / "tiny_ar.py"), "--workdir", str(workdir),
          "--dry-run", *[x for s in MICRO for x in ("--set", s)]]
  assert cli.main(argv) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert REPORTED <= set(report), report
  _, params = init_params(micro("tiny_ar", tmp_path).model, 0)  # what `train` initialises
  assert report["params"] == sum(x.size for x in jax.tree.leaves(params))
  assert report["devices"] == 1 and report["mesh"] is None and report["compile_s"] > 0
  assert report["argument_bytes"] >= 3 * 4 * report["params"]  # float32 params + 2 moments
  assert report["temp_bytes"] > 0 and report["output_bytes"] > 0
  assert (report["objective"], report["batch_size"], report["seq_len"]) == ("ar", 2, 16)
  assert report["batch"] == {"tokens": [[2, 16], "int32"]}
  assert report["flops_per_step"] == train_flops(micro("tiny_ar", tmp_path).model, "ar", 2, 16) > 0
  assert not workdir.exists() and not (tmp_path / "cache").exists()  # no lock, no config


@pytest.mark.fast
def test_every_shipped_objective_config_takes_the_shape_flags(tmp_path):
  for config in SHIPPED:
    cfg = micro(config, tmp_path)
    assert (cfg.model.d_model, cfg.model.qkv_bias, cfg.data.seq_len) == (16, True, 16), config
    batch = abstract_batch(cfg)
    assert batch["tokens"].shape == (2, 16), config
  assert abstract_batch(micro("asarm", tmp_path))["step"].shape == (2,)  # the trainer adds it


@pytest.mark.fast
@pytest.mark.parametrize("config", ["jacobi_forcing_r1", "deer_drafter"])
def test_store_fed_configs_dry_run_with_no_store_and_no_init_from(config, tmp_path):
  report = dry_run(micro(config, tmp_path))
  assert REPORTED <= set(report) and report["temp_bytes"] > 0
  assert not (tmp_path / "no-store").exists() and not (tmp_path / "no-run").exists()
  if config == "deer_drafter":
    assert report["batch"] == {"tokens": [[2, 16], "int32"], "prompt_lens": [[2], "int32"],
                               "lengths": [[2], "int32"]}
  else:  # the fields, shapes and dtypes of the rows the store's source packs
    row = jf.example(np.arange(4), np.ones((2, 3), np.int32), np.zeros((2, 3), np.int32), 16)
    assert report["batch"] == {k: [[2, 16], str(v.dtype)] for k, v in row.items()}



@pytest.mark.fast
def test_a_store_whose_rows_are_not_data_seq_len_long_is_refused(model, tmp_path, monkeypatch,
                                                                  capsys):
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  tokens = np.random.default_rng(1).integers(4, 48, 500).astype(np.int32)
  # test_jacobi_forcing's and test_deer_training's stores: their compilations are reused
  traj = tr.collect(model, StubTokenizer(), tokens, tmp_path / "traj", tr.CollectConfig(
      block_size=4, num_blocks=2, examples=10, min_prompt_len=3, max_prompt_len=8,
      batch_size=4), progress=False)
  teach = tch.collect(model, StubTokenizer(), tokens, tmp_path / "teach", tch.TeacherConfig(
      examples=10, answer_len=5, min_prompt_len=2, max_prompt_len=7, batch_size=4),
      progress=False)
  for config, store, says in [
      ("jacobi_forcing_r1", traj, "trajectory store .* has rows of 24 tokens \\(max_prompt_len "
       "\\+ 2 x num_blocks x block_size\\) but data.seq_len=224: set data.seq_len=24"),
      ("deer_drafter_stage1", teach, "teacher store .* has rows of 12 tokens \\(max_prompt_len "
       "\\+ answer_len\\) but data.seq_len=224: set data.seq_len=12")]:
    run = tmp_path / config
    assert cli.main(["train", "--config", str(RECIPES / f"{config}.py"), "--workdir", str(run),
                     "--set", f"data_source_args.path={store}",
                     "--set", f"init_from={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paraflax train: error: ") and "\n" not in err, err
    assert re.search(says, err), err
    assert not run.exists()  # refused before anything is written: no config, no lock
