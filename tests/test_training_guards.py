"""No poisoned workdirs (DESIGN invariants 7 and 9): a config value of the wrong type or a mesh
that does not fit the devices is refused in one line before anything is written, so the next
correct run goes; overrides apply together whatever their order; an `init_from` whose
tokenizer differs from the run's is refused naming both (a `paraflax convert` output holds a
Hugging Face tokenizer); directories compare resolved, however they are spelled."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from paraflax import cli
from paraflax.data.pipeline import prepare_stdlib
from paraflax.data.tokenizer import train_tokenizer
from paraflax.hf import export_hf
from paraflax.training import apply_overrides, load_config, train, train_from_config_path
from paraflax.training.__main__ import main as training_main
from paraflax.training.config.train import config_differences, with_resolved_paths
from paraflax.training.run.trainer import init_params
from paraflax.training.stores import teacher as tch
from paraflax.training.workdirs.convert import convert_hf
from conftest import StubTokenizer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "micro_ar"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def micro(data_dir):
  cfg = load_config(CONFIG)
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(data_dir),
                                                           progress=False))


@pytest.mark.fast
def test_bad_values_and_meshes_write_nothing_and_the_next_run_goes(data_dir, tmp_path,
                                                                   monkeypatch, capsys):
  run, cache = tmp_path / "run", f"data.cache_dir={data_dir}"
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  too_many = jax.device_count() + 1
  for bad, says in [("steps=2.5", "config field 'steps' must be an int, got 2.5 (float)"),
                    ("steps=abc", "config field 'steps' must be an int, got 'abc' (str)"),
                    ("optim.total_steps=2.5", "'optim.total_steps' must be an int or None"),
                    (f"mesh={too_many},1,1", f"needs {too_many} devices")]:
    assert cli.main(["train", "--config", CONFIG, "--workdir", str(run), "--set", bad,
                     "--set", cache]) == 2, bad
    err = capsys.readouterr().err.strip()
    assert err.startswith("paraflax train: error:") and says in err and "\n" not in err, err
    assert not run.exists(), bad  # nothing written, not even the directory
  assert training_main(["--config", CONFIG, "--workdir", str(run), "--set", "steps=abc"]) == 2
  err = capsys.readouterr().err.strip()
  assert "'steps' must be an int" in err and "\n" not in err and not run.exists()
  summary = train_from_config_path(CONFIG, run, overrides={"data.cache_dir": str(data_dir),
                                   "data.progress": "False"}, progress=False, max_steps=0)
  assert summary["step"] == 0 and json.loads((run / "config.json").read_text())["steps"] == 40


@pytest.mark.fast
def test_overrides_apply_together_whatever_their_order_and_types_are_checked(micro):
  longer = {"data.seq_len": "128", "model.max_seq_len": "128"}
  a = apply_overrides(micro, longer)
  assert a == apply_overrides(micro, dict(reversed(longer.items())))
  assert (a.data.seq_len, a.model.max_seq_len) == (128, 128)
  with pytest.raises(ValueError, match=r"data.seq_len=128 is above the model's max_seq_len=64"):
    apply_overrides(micro, {"data.seq_len": "128"})  # the checks still run, once, on the whole
  b = apply_overrides(micro, {"optim.peak_lr": "1", "data.max_files": "None",
                              "data.cache_dir": "123", "eval_batches": "None"})
  assert (b.optim.peak_lr, b.data.max_files, b.data.cache_dir, b.eval_batches) == (
      1.0, None, "123", None)
  assert type(b.optim.peak_lr) is float
  for bad, says in [({"model.two_stream": "1"}, "'model.two_stream' must be True or False"),
                    ({"log_every": "True"}, "'log_every' must be an int, got True"),
                    ({"model.vocab_size": "320.0"}, "'model.vocab_size' must be an int"),
                    ({"data_source_args.path": "x"}, "data source 'stdlib' takes \\[\\]"),
                    ({"mesh": "(1, 1, 1)", "mesh.data": "1"}, "set both whole and by its")]:
    with pytest.raises(ValueError, match=says):
      apply_overrides(micro, bad)
  with pytest.raises(ValueError, match=r"'steps' must be an int, got 2.5"):
    dataclasses.replace(micro, steps=2.5)  # library users too, not only the command line
  with pytest.raises(ValueError, match=r"'data.seq_len' must be an int, got 32.0"):
    dataclasses.replace(micro, data=dataclasses.replace(micro.data, seq_len=32.0))


def _converted(model, tokenizer, path: Path) -> Path:
  """A `paraflax convert` output of `model` exported with `tokenizer` (an HF directory)."""
  export_hf(model, path.with_name(path.name + "-hf"), tokenizer=tokenizer)
  convert_hf(path.with_name(path.name + "-hf"), path)
  return path


@pytest.mark.fast
def test_init_from_across_two_tokenizers_is_refused_naming_both(micro, tmp_path):
  ours = prepare_stdlib(micro.data).tokenizer  # what this run's data is tokenized with
  other = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300)
  model = nnx.merge(*init_params(micro.model, 0))
  same, foreign = (_converted(model, tok, tmp_path / name)
                   for tok, name in ((ours, "same"), (other, "other")))
  with pytest.raises(ValueError, match=(
      rf"tokenizer mismatch: init_from's weights were trained with '{foreign}/tokenizer.json' "
      rf"\(vocab {other.vocab_size}, .*but this run's data is tokenized with the tokenizer "
      rf"trained on .*data.vocab_size=320.*\(vocab 320, ")):
    train(dataclasses.replace(micro, init_from=str(foreign)), tmp_path / "run", progress=False)
  assert not (tmp_path / "run" / "config.json").exists()
  summary = train(dataclasses.replace(micro, init_from=str(same)), tmp_path / "run",
                  progress=False, max_steps=0)
  assert summary["step"] == 0 and summary["n_params"] > 0


@pytest.mark.fast
def test_directories_compare_resolved_however_spelled(micro, model, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "src").mkdir()
  rel = dataclasses.replace(micro, init_from="src/", data_source="teacher",
                            data_source_args={"path": "./store/"})
  abs_ = dataclasses.replace(micro, init_from=str(tmp_path / "src"),
                             data_source="teacher",
                             data_source_args={"path": str(tmp_path / "store")})
  assert config_differences(rel, abs_) == []
  assert config_differences(rel, dataclasses.replace(abs_, init_from=str(tmp_path))) != []
  assert with_resolved_paths(rel) == abs_  # what `train` saves and compares
  # a store resumed with its source model spelled another way is the same store
  stream = np.random.default_rng(1).integers(4, 48, 500).astype(np.int32)
  cfg = tch.TeacherConfig(examples=10, answer_len=5, min_prompt_len=2, max_prompt_len=7,
                          batch_size=4)  # test_deer_training's: its compilation is reused
  whole = tch.load(tch.collect(model, StubTokenizer(), stream, "store", cfg, source="src/",
                               progress=False))
  assert whole.meta["source"] == str(tmp_path / "src")
  again = tch.load(tch.collect(model, StubTokenizer(), stream, tmp_path / "store/", cfg,
                               source=str(tmp_path / "src"), progress=False))
  np.testing.assert_array_equal(again.answers, whole.answers)
  with pytest.raises(ValueError, match=r"other settings \(source\)"):
    tch.collect(model, StubTokenizer(), stream, "store", cfg, source=str(tmp_path), progress=False)


@pytest.mark.fast
def test_a_workdir_config_of_another_shape_names_the_file_and_the_field(micro, tmp_path,
                                                                          capsys, monkeypatch):
  """A workdir's config.json that is valid JSON of the wrong shape ({}, a missing, unknown or
  mistyped field) is one line naming the file and the field: loading the model, resuming."""
  from paraflax.training.workdirs.workdir import check_workdir
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  work = shutil.copytree(ROOT / "checkpoints" / "ar_drafter", tmp_path / "W")
  saved = json.loads((work / "config.json").read_text())
  for config, says in [
      ({}, "missing field 'model'"),
      ([], "expected a JSON object, got list []"),
      ({**saved, "model": {}}, "missing field 'model.vocab_size'"),
      ({**saved, "model": {**saved["model"], "d_model": "64"}},
       "config field 'model.d_model' must be an int, got '64' (str)"),
      ({**saved, "optim": {**saved["optim"], "lr": 1}},
       "unknown field 'optim.lr' (OptimConfig has no such field)"),
      ({**saved, "data": 3}, "field 'data' must be an object of DataConfig fields, got int")]:
    (work / "config.json").write_text(json.dumps(config))
    assert cli.main(["generate", "--workdir", str(work), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paraflax generate: error: {work / 'config.json'}: {says}")
    with pytest.raises(ValueError, match=f"^{work / 'config.json'}: "):
      check_workdir(micro, work, None)


@pytest.mark.fast
def test_bool_fields_take_true_false_yes_no_in_any_case(micro):
  """`--set data_source_args.skip_bad_lines=true` (the README's spelling) and the like; a
  union field that takes a bool (`run.scan_layers`: a bool or "auto") parses them alike."""
  jsonl = {"data_source": "jsonl", "data_source_args.paths": "a.jsonl"}
  for spelling, want in [("true", True), ("True", True), ("YES", True), (" no", False),
                         ("False", False), ("FALSE", False)]:
    assert apply_overrides(micro, {"data.progress": spelling}).data.progress is want
    cfg = apply_overrides(micro, {**jsonl, "data_source_args.skip_bad_lines": spelling})
    assert dict(cfg.data_source_args)["skip_bad_lines"] is want
  with pytest.raises(ValueError, match="'data.progress' must be True or False, got 'maybe'"):
    apply_overrides(micro, {"data.progress": "maybe"})
  for spelling, want in [("True", True), ("no", False), ("auto", "auto")]:
    assert apply_overrides(micro, {"run.scan_layers": spelling}).run.scan_layers == want
  with pytest.raises(ValueError, match="scan_layers must be True, False or 'auto', got 'maybe'"):
    apply_overrides(micro, {"run.scan_layers": "maybe"})


@pytest.mark.fast
def test_a_model_directory_is_refused_as_the_workdir_and_left_untouched(tmp_path, capsys,
                                                                         monkeypatch):
  """`train --workdir` pointed at a Hugging Face directory or a convert output is one line
  saying to start from it with --hf; not even a lock file is written there."""
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  hf, converted = tmp_path / "hf", tmp_path / "converted"
  for path, files in ((hf, ("config.json", "model.safetensors")),
                      (converted, ("config.json", "hf_config.json", "tokenizer.json"))):
    path.mkdir()
    for name in files:
      (path / name).write_text("{}")
  for path, what in ((hf, "Hugging Face directory"), (converted, "paraflax convert output")):
    before = sorted(p.name for p in path.iterdir())
    assert cli.main(["train", "--config", CONFIG, "--workdir", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"is a {what}, not a training workdir: start from it with --hf {path}" in err
    assert "\n" not in err and sorted(p.name for p in path.iterdir()) == before


@pytest.mark.fast
def test_a_run_refused_by_its_data_leaves_no_workdir_and_no_lock(tmp_path, capsys, monkeypatch):
  """Data checks run under the workdir's lock: a refused run removes the lock file (and the
  directory) it made, as nothing else was written."""
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  (tmp_path / "one.jsonl").write_text('{"text": "a b c"}\n')
  (tmp_path / "empty").mkdir()
  for run in (tmp_path / "new", tmp_path / "empty"):
    assert cli.main(["train", "--config", CONFIG, "--workdir", str(run), "--set",
                     "data_source=jsonl", "--set", f"data_source_args.paths={tmp_path}/one.jsonl",
                     "--set", f"data.cache_dir={tmp_path / 'data'}"]) == 2
    assert "leave no validation documents" in capsys.readouterr().err
  assert not (tmp_path / "new").exists() and list((tmp_path / "empty").iterdir()) == []
