"""`paraflax train --hf DIR --data FILE.jsonl`: a Hugging Face model trains on the user's data
with its own tokenizer and weights (step-0 loss = transformers' loss on the same rows), gains
the method tokens it lacks (rows = the mean row), and exports back; a run whose data another
tokenizer encoded is refused, naming both."""

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from flax import nnx

import paraflax as pf
from paraflax import cli
from paraflax.data import source as data_source
from paraflax.data.text import JsonlData
from paraflax.data.tokenizer import load_tokenizer
from paraflax.hf import export_hf
from paraflax.hf.export import write_auto_map
from paraflax.json_io import read_json
from paraflax.training import load_trained
from paraflax.training.__main__ import add_arguments, config_from_args
from paraflax.training.config.from_hf import from_hf
from paraflax.training.config.recipes import RECIPES
from paraflax.training.config.train import TrainConfig, apply_overrides, load_config
from paraflax.training.run.trainer import open_data, train
from paraflax.training.workdirs.workdir import initial_params
from conftest import full_logits, reference_libs

torch, transformers = reference_libs()

EOT = "<|endoftext|>"
TINY = ["--set", "data.seq_len=32", "--set", "data.batch_size=4", "--set", "eval_batches=2",
        "--set", "eval_every=3", "--set", "checkpoint_every=3", "--set", "log_every=1",
        "--set", "data_source_args.val_fraction=0.3", "--set", "optim.warmup_steps=1",
        "--steps", "3", "--no-progress"]


def _docs(n: int = 160) -> list[str]:
  return [f"def f{i}(x):\n    return x * {i} + {i * i % 97}\n" for i in range(n)]


def _bpe(ids: int) -> tokenizers.Tokenizer:
  """A byte-level BPE of `ids` ids with one special, Qwen's end of text, and no <mask>."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(_docs(), tokenizers.trainers.BpeTrainer(
      vocab_size=ids, special_tokens=[EOT],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _hf_dir(path: Path, ids: int, rows: int | None, tie: bool, seed: int) -> Path:
  """A random Qwen2 of `rows` embedding rows (None: exactly the tokenizer's `ids`), with the
  `auto_map` exports carry."""
  tok = _bpe(ids)
  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(
      vocab_size=rows or tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64, tie_word_embeddings=tie, eos_token_id=0,
      bos_token_id=None, pad_token_id=None)
  model = transformers.Qwen2ForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():  # unit-gain weights: logits far from uniform
      if "norm" not in name:
        p.normal_(0.0, 1.0 if "embed" in name or p.ndim == 1 else p.shape[1] ** -0.5)
  model.save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  write_auto_map(path)
  return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """padded: 320 rows for 300 ids (as Qwen2.5 pads), untied; exact: rows = its 290 ids,
  tied (another tokenizer)."""
  root = tmp_path_factory.mktemp("hf")
  return {"padded": _hf_dir(root / "padded", 300, 320, tie=False, seed=0),
          "exact": _hf_dir(root / "exact", 290, None, tie=True, seed=1)}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
  return path


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")


def _train(capsys, config: str, hf: Path, data: Path, workdir: Path, *flags) -> dict:
  assert cli.main(["train", "--config", str(RECIPES / config), "--workdir", str(workdir),
                   "--hf", str(hf), "--data", str(data), *TINY, "--set",
                   f"data.cache_dir={workdir.parent / 'cache'}", *flags]) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _hf_model(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _export_matches(run, out, seed: int) -> None:
  """`export` of `run` reloads in transformers with paraflax's logits (within 1e-4)."""
  assert cli.main(["export", "--workdir", str(run), "--to-hf", str(out)]) == 0
  model, tok, _ = load_trained(run)
  tokens = np.random.RandomState(seed).randint(0, tok.vocab_size, (2, 24))
  with torch.no_grad():
    got = _hf_model(out)(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(got, full_logits(model, tokens), atol=1e-4, rtol=0)


@pytest.mark.fast
def test_the_model_tokenizer_and_method_ids_come_from_the_hf_dir(dirs, data_file):
  padded, exact = dirs["padded"], dirs["exact"]
  ids = tokenizers.Tokenizer.from_file(str(exact / "tokenizer.json")).get_vocab_size()
  ar = from_hf(load_config(RECIPES / "micro_ar.py"), padded, [data_file])
  assert (ar.model.vocab_size, ar.model.d_model, ar.model.tie_embeddings) == (320, 32, False)
  assert ar.model.qkv_bias and ar.model.mask_token_id is None and ar.model.max_seq_len == 64
  assert ar.init_from == ar.data.tokenizer == str(padded.resolve())
  assert (ar.data_source, tuple(dict(ar.data_source_args)["paths"])) == (
      "jsonl", (str(data_file.resolve()),))
  tidar = from_hf(load_config(RECIPES / "tidar_scratch.py"), exact, [data_file])
  assert (tidar.data.mask_token, tidar.model.mask_token_id) == ("<mask>", ids)  # a new id
  assert tidar.model.vocab_size == ids + 1 and tidar.model.tie_embeddings  # one row grown
  fim = dataclasses.replace(tidar, data=dataclasses.replace(tidar.data, mask_token=EOT))
  reserved = from_hf(fim, exact, [data_file])  # a token the tokenizer has keeps its id
  assert (reserved.model.mask_token_id, reserved.model.vocab_size) == (0, ids)
  jf = load_config(RECIPES / "jacobi_forcing_r1.py")
  with pytest.raises(ValueError, match=r"trains on a trajectories store.*paraflax "
                     r"collect-trajectories --hf .* --data FILE --out STORE`, then train with "
                     r"`--set data_source_args.path=STORE`"):
    from_hf(jf, exact, [data_file])
  store = from_hf(jf, exact)  # no --data: the recipe's store, collected from the HF model
  assert (store.data_source, store.init_from, store.data.tokenizer) == (
      "trajectories", str(exact.resolve()), str(exact.resolve()))


@pytest.mark.fast
def test_added_tokens_start_at_the_mean_row_and_reserved_ones_keep_theirs(dirs, data_file):
  tidar = load_config(RECIPES / "tidar_scratch.py")
  fim = dataclasses.replace(tidar, data=dataclasses.replace(tidar.data, mask_token=EOT))
  for name, recipe in (("exact", tidar), ("padded", tidar), ("exact", fim)):
    cfg = from_hf(recipe, dirs[name], [data_file])
    ref = _hf_model(dirs[name])
    emb = ref.model.embed_tokens.weight.detach().numpy()  # [rows, D]
    known = load_tokenizer(dirs[name]).vocab_size
    _, params = initial_params(cfg, None)
    got = np.asarray(params["embed"].get_value())  # [V, D]
    np.testing.assert_allclose(got[:known], emb[:known], rtol=0, atol=0)
    mask = cfg.model.mask_token_id
    if recipe is fim:  # a reserved token: its trained row, no growth
      assert mask == 0 and got.shape == emb.shape
      continue
    assert mask == known and got.shape[0] == max(emb.shape[0], known + 1)
    np.testing.assert_allclose(got[mask], emb[:known].mean(0), rtol=0, atol=1e-6)
    if not cfg.model.tie_embeddings:  # the untied head's new column: the mean column
      head = np.asarray(params["lm_head"].get_value())  # [D, V]
      np.testing.assert_allclose(head[:, mask], ref.lm_head.weight.detach().numpy()[:known]
                                 .mean(0), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_ar_sft_from_hf_matches_transformers_then_generates_and_exports(
    capsys, dirs, data_file, tmp_path):
  hf = dirs["padded"]
  run = tmp_path / "ar"
  summary = _train(capsys, "micro_ar.py", hf, data_file, run)
  assert summary["step"] == 3
  cfg = TrainConfig.from_dict(read_json(run / "config.json"))
  val = open_data(cfg, progress=False).validation[:cfg.eval_batches]
  ref = _hf_model(hf)
  with torch.no_grad():
    losses = [float(ref(torch.tensor(b["tokens"]).long(),
                        labels=torch.tensor(b["tokens"]).long()).loss) for b in val]
  step0 = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][0]
  assert step0["step"] == 0 and step0["val_loss"] == pytest.approx(np.mean(losses), abs=1e-4)
  again = _train(capsys, "micro_ar.py", hf, data_file, run)  # the same command resumes
  assert (again["start_step"], again["step"]) == (3, 3)

  assert cli.main(["generate", "--workdir", str(run), "--decoder", "ar", "--prompt",
                   "def f3(x):", "--max-new-tokens", "6", "--json"]) == 0
  assert len(json.loads(capsys.readouterr().out)["completions"][0]["ids"]) <= 6
  _export_matches(run, tmp_path / "out", seed=0)
  capsys.readouterr()


@pytest.mark.slow
def test_tidar_from_hf_adds_mask_and_exports_it(capsys, dirs, data_file, tmp_path):
  hf = dirs["padded"]
  run = tmp_path / "tidar"
  _train(capsys, "tidar_scratch.py", hf, data_file, run)
  model, tok, _ = load_trained(run)
  assert model.cfg.mask_token_id == tok.mask_id == load_tokenizer(hf).vocab_size
  _export_matches(run, tmp_path / "out", seed=1)
  hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  assert hf_tok.convert_tokens_to_ids("<mask>") == model.cfg.mask_token_id


@pytest.mark.fast
def test_another_tokenizer_or_a_neither_kind_dir_is_refused(capsys, dirs, data_file, tmp_path):
  cfg = apply_overrides(from_hf(load_config(RECIPES / "micro_ar.py"), dirs["padded"], [data_file]),
                        {"data.seq_len": 32, "data.batch_size": 4, "data.tokenizer": str(
                            dirs["exact"]), "data.cache_dir": str(tmp_path / "c"),
                         "data_source_args.val_fraction": 0.3})
  with pytest.raises(ValueError, match=(
      rf"tokenizer mismatch: init_from's weights were trained with "
      rf"'{dirs['padded'].resolve()}/tokenizer.json' \(vocab .* but this run's data is "
      rf"tokenized with the tokenizer of '{dirs['exact'].resolve()}'")):
    train(cfg, tmp_path / "run", progress=False)
  (tmp_path / "neither").mkdir()
  (tmp_path / "neither" / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"init_from=.*neither.* is neither a training "
                     r"workdir .* nor a Hugging Face directory"):
    train(dataclasses.replace(cfg, init_from=str(tmp_path / "neither")), tmp_path / "run2",
          progress=False)
  assert cli.main(["train", "--config", str(RECIPES / "micro_ar.py"), "--workdir",
                   str(tmp_path / "r3"), "--hf", str(tmp_path / "neither")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "is not a model directory: expected a paraflax workdir" in err


@pytest.mark.fast
def test_a_deer_drafter_from_hf_exports_mask_and_sep_and_an_asarm_is_refused(dirs, tmp_path):
  """Step-0 weights of the DEER drafter recipe on the HF model: <mask> and <sep> added (rows
  grown past the padding), exported with both as specials and transformers' logits."""
  hf = dirs["exact"]
  cfg = from_hf(load_config(RECIPES / "deer_drafter_stage1.py"), hf)
  known = load_tokenizer(hf).vocab_size
  assert (cfg.model.mask_token_id, cfg.model.sep_token_id, cfg.model.vocab_size) == (
      known, known + 1, known + 2)
  model = nnx.merge(*initial_params(cfg, None))
  tok = load_tokenizer(hf, mask_token=cfg.data.mask_token, sep_token=cfg.data.sep_token)
  export_hf(model, tmp_path / "out", tokenizer=tok)
  hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  assert [hf_tok.convert_tokens_to_ids(t) for t in ("<mask>", "<sep>")] == [known, known + 1]
  tokens = np.random.RandomState(2).randint(0, cfg.model.vocab_size, (2, 16))
  with torch.no_grad():
    got = _hf_model(tmp_path / "out")(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(got, full_logits(model, tokens), atol=1e-4, rtol=0)
  bidirectional = from_hf(load_config("deer_drafter_bidirectional_stage1"), hf).model
  assert bidirectional.drafter_prefix == "bidirectional"  # the method's layout is the recipe's
  asarm = from_hf(load_config(RECIPES / "asarm.py"), hf)
  assert asarm.model.two_stream
  with pytest.raises(ValueError, match="two_stream"):
    export_hf(nnx.merge(*initial_params(asarm, None)), tmp_path / "no", tokenizer=tok)


@pytest.mark.fast
def test_set_picks_the_method_tokens_and_the_jsonl_arguments(dirs, data_file):
  """Each --set applies once: before --hf resolves (data.mask_token picks a reserved token; run
  control) or after it for what it derives (model.* win over the HF architecture;
  data_source_args.* are the jsonl source's); --data alone keeps a BPE."""
  parser = argparse.ArgumentParser()
  add_arguments(parser)

  def config(*argv):
    return config_from_args(parser.parse_args(["--config", str(RECIPES / "tidar_scratch.py"),
                                               "--workdir", "w", *argv]))

  cfg = config("--hf", str(dirs["exact"]), "--data", str(data_file), "--data", str(data_file),
               "--set", f"data.mask_token={EOT}", "--set", "data_source_args.val_fraction=0.3",
               "--set", "run.remat=full", "--set", "model.rope_theta=5e5", "--steps", "7")
  assert (cfg.model.mask_token_id, cfg.run.remat, cfg.steps) == (0, "full", 7)
  assert cfg.model.rope_theta == 5e5 != from_hf(load_config("tidar_scratch"),
                                                dirs["exact"]).model.rope_theta
  assert dict(cfg.data_source_args)["val_fraction"] == 0.3
  assert tuple(dict(cfg.data_source_args)["paths"]) == (str(data_file.resolve()),) * 2
  plain = config("--data", str(data_file))
  assert (plain.data_source, plain.data.tokenizer, plain.init_from) == ("jsonl", None, None)
  assert plain.model == load_config(RECIPES / "tidar_scratch.py").model


@dataclasses.dataclass(frozen=True)
class _Unmarked(JsonlData):
  """Rows encoded with data.tokenizer without the method tokens, as a store collected from
  the base model is (the objective fills in <mask>/<sep> ids itself)."""

  def open(self, data, *, progress: bool = True):
    return super().open(dataclasses.replace(data, mask_token=None, sep_token=None))


@pytest.mark.fast
def test_data_without_the_method_tokens_trains_and_the_workdir_gains_them(
    dirs, data_file, tmp_path, monkeypatch):
  monkeypatch.setitem(data_source.SOURCES, "unmarked", _Unmarked)
  hf = dirs["exact"]
  cfg = apply_overrides(from_hf(load_config(RECIPES / "tidar_scratch.py"), hf), {
      "data.seq_len": 32, "data.batch_size": 4, "data.cache_dir": str(tmp_path / "c"),
      "data_source": "unmarked", "data_source_args.paths": [str(data_file)],
      "data_source_args.val_fraction": 0.3})
  train(cfg, tmp_path / "run", progress=False, max_steps=0)  # checks, then saves the tokenizer
  saved = pf.data.tokenizer.Tokenizer.load(tmp_path / "run" / "tokenizer.json")
  assert saved.mask_id == cfg.model.mask_token_id == load_tokenizer(hf).vocab_size


@pytest.mark.fast
def test_dry_run_with_hf_compiles_the_hf_architecture(capsys, dirs, data_file):
  hf = dirs["padded"]
  assert cli.main(["train", "--config", str(RECIPES / "micro_ar.py"), "--workdir", "unused",
                   "--hf", str(hf), "--data", str(data_file), "--set", "data.seq_len=32",
                   "--set", "data.batch_size=4", "--dry-run"]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["params"] == sum(p.numel() for p in _hf_model(hf).parameters())
