"""Objectives and data sources as registered protocols: a config names them by name + arguments
(schema 3; schema-1 configs with `trajectories` / `teacher` fields and schema-2 ones with run
control inside the model migrate, the shipped checkpoints among them), their arguments take
dotted overrides, a batch field an objective reads must come from its source, and the trainer
trains on a source it has never heard of."""

import dataclasses
import json
import shutil
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from paraflax.data.pipeline import DataConfig, train_iterator, validation_batches
from paraflax.data.source import SOURCES, TrainData, get_source, register_source
from paraflax.data.tokenizer import train_tokenizer
from paraflax.model.config import MOVED, ModelConfig
from paraflax.model.run import FIELDS, RunControl
from paraflax.model.run import FIELDS as RUN_FIELDS
from paraflax.training import (
  OBJECTIVES,
  TrainConfig,
  apply_overrides,
  load_config,
  load_trained,
  train,
)
from paraflax.training.config.train import SCHEMA, config_differences

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in (ROOT / "checkpoints").iterdir() if (p / "config.json").is_file())


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
  cfg = load_config("micro_ar")
  return dataclasses.replace(cfg, data=dataclasses.replace(
      cfg.data, cache_dir=str(tmp_path_factory.mktemp("data-cache")), progress=False))


@pytest.mark.fast
@pytest.mark.parametrize("workdir", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_checkpoint_loads_its_config_migrated(workdir):
  old = json.loads((workdir / "config.json").read_text())
  assert old.get("schema", 1) < SCHEMA  # shipped before run control left the model
  model, tokenizer, cfg = load_trained(workdir)
  if "schema" not in old:  # written before data sources were registered: migrated
    store = {k: v for k in ("trajectories", "teacher") if (v := old.get(k)) is not None}
    assert cfg.data_source == (next(iter(store)) if store else "stdlib")
    assert dict(cfg.data_source_args) == next(iter(store.values()), {})
  else:  # schema 2: its data source as written
    assert cfg.data_source == old["data_source"]
    assert dict(cfg.data_source_args) == old["data_source_args"]
  # the model's fields are its architecture; its run control (schema 2) is the run's
  arch = {k: v for k, v in old["model"].items() if k not in RUN_FIELDS}
  assert cfg.model == ModelConfig(**arch) and model.cfg == cfg.model
  assert cfg.run == RunControl(**{k: old["model"][k] for k in RUN_FIELDS if k in old["model"]})
  assert model.run == RunControl()  # computed as this device's "auto", not as the run trained
  assert tokenizer.vocab_size <= cfg.model.vocab_size
  new = json.loads(json.dumps(cfg.to_dict()))
  assert new["schema"] == SCHEMA and "teacher" not in new and "trajectories" not in new
  assert TrainConfig.from_dict(new) == cfg == TrainConfig.from_dict(old)


@pytest.mark.fast
def test_a_workdir_trained_with_a_gpu_kernel_loads_and_decodes_anywhere(tmp_path):
  """`load_trained` computes with `RunControl()` ("auto", for the device it runs on) unless
  given `run=`: a run that named cuDNN attention decodes on a CPU as the same weights do."""
  import jax

  from paraflax.decoding.generate import generate
  shipped = ROOT / "checkpoints" / "ar_drafter"
  workdir = shutil.copytree(shipped, tmp_path / "cudnn")
  trained = dataclasses.replace(TrainConfig.from_dict(json.loads(
      (shipped / "config.json").read_text())), run=RunControl(attention="cudnn"))
  (workdir / "config.json").write_text(json.dumps(trained.to_dict()))
  model, tok, cfg = load_trained(workdir)
  assert cfg == trained and model.run == RunControl()
  assert load_trained(workdir, run=cfg.run)[0].run == cfg.run  # as the run trained, when asked
  prompts = [tok.encode("def add(a, b):"), tok.encode("x = 1")]
  got = generate(model, prompts, max_new_tokens=8).tokens
  assert np.array_equal(got, generate(load_trained(shipped)[0], prompts, max_new_tokens=8).tokens)
  if jax.default_backend() == "cpu":  # the run's own kernel has no CPU version
    with pytest.raises(ValueError, match="attention='cudnn' needs a GPU or TPU"):
      generate(load_trained(workdir, run=cfg.run)[0], prompts, max_new_tokens=8)


@pytest.mark.fast
def test_configs_name_their_source_and_schema_1_dicts_migrate(micro):
  jf = load_config("jacobi_forcing_r2")
  assert (jf.objective, jf.data_source) == ("jacobi_forcing", "trajectories")
  assert dict(jf.data_source_args) == {"path": "~/.cache/paraflax/jf/r2_trajectories",
                                       "noise_window": 8, "noise_measure": "unconverged",
                                       "val_fraction": 0.05}  # defaults in
  old = {k: v for k, v in jf.to_dict().items() if k not in ("schema", "data_source",
                                                           "data_source_args")}
  assert TrainConfig.from_dict({**old, "trajectories": dict(jf.data_source_args),
                                "teacher": None}) == jf
  with pytest.raises(ValueError, match="one data source: trajectories or teacher, not both"):
    TrainConfig.from_dict({**old, "trajectories": {"path": "a"}, "teacher": {"path": "b"}})
  with pytest.raises(ValueError, match="config schema 4 is not one this paraflax reads"):
    TrainConfig.from_dict({**micro.to_dict(), "schema": 4})
  assert config_differences(micro, TrainConfig.from_dict(micro.to_dict())) == []


@pytest.mark.fast
def test_schema_2_run_control_moves_from_the_model_to_run_and_resumes(micro):
  """A schema-2 workdir's `model.remat` (...) is `run.remat` (...): it loads, resumes with any
  run control, and `--set model.remat` still sets it (with a DeprecationWarning)."""
  new = micro.to_dict()
  old = {**new, "schema": 2, "model": {**new["model"], "attention": "xla", "remat": "full",
                                       "scan_layers": True, "loss_chunk": 64}}
  del old["run"]
  cfg = TrainConfig.from_dict(old)
  assert cfg.run == RunControl(attention="xla", remat="full", scan_layers=True, loss_chunk=64)
  assert cfg.model == micro.model and dataclasses.replace(cfg, run=micro.run) == micro
  assert config_differences(cfg, micro) == []
  # a dict without `schema` (read as schema 1) keeps the `run` it gives
  given = {k: v for k, v in new.items() if k != "schema"}
  given["run"] = {**new["run"], "remat": "full"}
  assert TrainConfig.from_dict(given).run.remat == "full"
  # the keywords that moved are schema 2's list: every field but `platform` and
  # `remat_layers` (added later, never model fields)
  assert MOVED == tuple(f for f in FIELDS if f not in ("platform", "remat_layers"))
  with pytest.warns(DeprecationWarning, match="'model.remat' is now 'run.remat'"):
    assert apply_overrides(micro, {"model.remat": "full"}).run.remat == "full"
    with pytest.raises(ValueError, match="'run.remat' is set twice"):
      apply_overrides(micro, {"model.remat": "full", "run.remat": "none"})


@pytest.mark.fast
def test_objectives_declare_fields_and_the_source_must_give_them(micro):
  assert OBJECTIVES["asarm"].needs_step and not OBJECTIVES["ar"].needs_step
  assert {n: OBJECTIVES[n].source for n in ("ar", "tidar", "jacobi_forcing", "deer_stage1")} == {
      "ar": "stdlib", "tidar": "stdlib", "jacobi_forcing": "trajectories",
      "deer_stage1": "teacher"}
  assert {"stdlib", "trajectories", "teacher"} <= set(SOURCES)
  with pytest.raises(ValueError, match=r"objective 'deer_stage1' reads batch fields "
                                       r"\['lengths', 'prompt_lens'\] .* data source 'teacher'"):
    dataclasses.replace(micro, objective="deer_stage1")
  teacher = dataclasses.replace(micro, objective="deer_stage1", data_source="teacher",
                                data_source_args={"path": "s"})
  assert dataclasses.replace(teacher, objective="ar").data_source == "teacher"  # a subset
  with pytest.raises(ValueError, match="unknown data source 'nope'; registered: .*'stdlib'"):
    dataclasses.replace(micro, data_source="nope")
  with pytest.raises(ValueError, match="val_fraction must be in"):
    get_source("teacher", {"path": "s", "val_fraction": 1.5})
  with pytest.raises(ValueError, match="'data_source_args.path' must be a string, got 3"):
    dataclasses.replace(teacher, data_source_args={"path": 3})
  with pytest.raises(ValueError, match="already registered"):
    register_source("stdlib")(type(get_source("teacher", {"path": "s"})))


@pytest.mark.fast
def test_source_and_objective_arguments_take_dotted_overrides(micro):
  cfg = apply_overrides(micro, {"data_source_args.path": "store", "data_source": "teacher",
                                "data_source_args.val_fraction": "0.5"})  # any order
  assert cfg.data_source_args == (("path", "store"), ("val_fraction", 0.5))
  assert apply_overrides(cfg, {"data_source_args.path": "other"}).data_source_args == (
      ("path", "other"), ("val_fraction", 0.5))
  assert apply_overrides(cfg, {"data_source": "stdlib"}).data_source_args == ()  # not carried
  for bad, says in [({"data_source_args.val_fraction": "abc"}, "must be a number, got 'abc'"),
                    ({"data_source_args.noise_window": "2"},
                     r"data source 'teacher' takes \['path', 'val_fraction'\]"),
                    ({"data_source_args": "{}", "data_source_args.path": "x"}, "both whole")]:
    with pytest.raises(ValueError, match=says):
      apply_overrides(cfg, bad)
  tidar = apply_overrides(micro, {"objective": "tidar", "objective_args.alpha": "2"})
  assert dict(tidar.objective_args) == {"alpha": 2}
  with pytest.raises(ValueError, match=r"objective 'ar' does not take objective_args \{'scale'"):
    apply_overrides(micro, {"objective_args.scale": "2"})
  with pytest.warns(DeprecationWarning, match="'teacher.path' is now data_source_args.path"):
    assert apply_overrides(cfg, {"teacher.path": "old"}).data_source_args[0] == ("path", "old")
  with pytest.warns(DeprecationWarning), pytest.raises(
      ValueError, match="this config's data_source is 'stdlib', not 'trajectories'"):
    apply_overrides(micro, {"trajectories.path": "x"})


@dataclasses.dataclass(frozen=True)
class _Rows:
  """A source the trainer has never heard of: random rows of `length` tokens."""
  fields: ClassVar[tuple[str, ...]] = ("tokens",)
  length: int = 16

  def open(self, data, *, progress=True):
    tokens = np.random.default_rng(data.seed).integers(4, 260, 4000).astype(np.int32)
    rows = DataConfig(seq_len=self.length, batch_size=data.batch_size, seed=data.seed)
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 260)
    return TrainData(train_iterator(tokens, rows), validation_batches(tokens[:800], rows), tok,
                     max_position=self.length, tokenizer_source="test rows", rows="test")


def test_the_trainer_trains_on_a_source_registered_outside_paraflax(micro, tmp_path,
                                                                    monkeypatch):
  monkeypatch.setitem(SOURCES, "test-rows", _Rows)
  cfg = dataclasses.replace(micro, data_source="test-rows", steps=2, eval_batches=1,
                            model=dataclasses.replace(micro.model, n_layers=1),
                            checkpoint_every=2, eval_every=2)
  summary = train(cfg, tmp_path / "run", progress=False)
  assert summary["step"] == 2 and np.isfinite(summary["val_loss"])
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert (saved["schema"], saved["data_source"], saved["data_source_args"]) == (
      SCHEMA, "test-rows", {"length": 16})
  with pytest.raises(ValueError, match="test rows reach position 80, above the model's "
                                       "max_seq_len 64"):
    train(apply_overrides(cfg, {"data_source_args.length": "80"}), tmp_path / "too-long",
          progress=False)


@pytest.mark.fast
def test_a_jsonl_file_is_a_data_source_of_packed_text_rows(micro, tmp_path, monkeypatch):
  docs = [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"} for i in range(200)]
  docs += [{"prompt": f"# add {i}\n", "response": f"y = {i} + 1\n"} for i in range(50)]
  (tmp_path / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  monkeypatch.chdir(tmp_path)
  cfg = dataclasses.replace(micro, data_source="jsonl", data_source_args={"path": "data.jsonl",
                                                                          "val_fraction": 0.2},
                            data=dataclasses.replace(micro.data, seq_len=16, batch_size=2))
  data = cfg.source.open(cfg.data, progress=False)
  assert data.tokenizer.vocab_size <= 320 and data.max_position == 16
  first = next(data.train)
  assert first["tokens"].shape == (2, 16) and data.validation[0]["tokens"].shape == (2, 16)
  state = data.train.get_state()
  ahead = next(data.train)["tokens"]
  data.train.set_state(state)
  np.testing.assert_array_equal(next(data.train)["tokens"], ahead)  # resumes where it was
  assert "'data.jsonl'" in data.tokenizer_source
  from paraflax.training.config.train import with_resolved_paths
  assert dict(with_resolved_paths(cfg).data_source_args)["path"] == str(tmp_path / "data.jsonl")
  with pytest.raises(ValueError, match="leave no validation documents"):
    get_source("jsonl", {"path": "data.jsonl", "val_fraction": 1e-9}).open(cfg.data,
                                                                          progress=False)
