"""Bring your own model and data, end to end: from a tiny random Qwen2 Hugging Face directory
(its own byte-level BPE, a chat template) and a JSONL of prompt/response and chat records,
each `hf/` recipe's commands run a few steps; `generate` with the recipe's decoder
prints greedy AR's ids of the trained weights; the exportable ones reload in transformers
(logits within 1e-4, the same greedy ids, stopping at EOS); an AS-ARM's export is refused;
`bench` on the user's prompts and records is exact and reports their loss."""

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from flax import nnx

import paraflax as pf
from paraflax import cli
from paraflax.data.chat import chat_template
from paraflax.hf import auto_tokenizer, export_hf, load_hf_tokenizer
from paraflax.hf.export import write_auto_map
from paraflax.hf.random_model import make_random_hf_model
from paraflax.training import load_trained
from conftest import full_logits, reference_libs

torch, transformers = reference_libs()

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "print(5)"
NEW = 8
SMALL = ["--set", "data.batch_size=2", "--set", "eval_batches=1", "--set", "eval_every=100",
         "--set", "checkpoint_every=100", "--set", "log_every=1", "--set", "model.dtype=float32",
         "--set", "optim.warmup_steps=1", "--set", "optim.peak_lr=1e-3", "--steps", "2",
         "--no-progress"]


def _records() -> list[dict]:
  pairs = [{"prompt": f"def f{i}(x):\n", "response": f"    return x * {i} + {i * i % 97}\n"}
           for i in range(48)]
  chats = [{"messages": [{"role": "user", "content": f"print({i})"},
                         {"role": "assistant", "content": f"{i}\n"}]} for i in range(16)]
  return pairs + chats


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
  """A random Qwen2 with its own byte-level BPE, EOS <|endoftext|> (id 0) and a ChatML-like
  template; untied (a tied one with unit-gain rows repeats its last token), unit-gain weights
  (logits far from uniform, greedy far from ties). As a user's: no `auto_map`, so
  transformers' `AutoTokenizer` loads `Qwen2Tokenizer`, which encodes otherwise."""
  path = tmp_path_factory.mktemp("byo") / "qwen2"
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  texts = [r.get("prompt", "") + r.get("response", "") for r in _records()] + ["print(x)\n"]
  tok.train_from_iterator(texts * 4, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=0,
      bos_token_id=None, pad_token_id=None)
  model = transformers.Qwen2ForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" not in name:
        p.normal_(0.0, 1.0 if "embed" in name or p.ndim == 1 else p.shape[1] ** -0.5)
  model.save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0],
      "chat_template": CHAT}))
  return path


@pytest.fixture(scope="module")
def hf_dir(user_dir, tmp_path_factory) -> Path:
  """`user_dir` with the `auto_map` exports carry: the commands read it without a warning."""
  path = tmp_path_factory.mktemp("byo_auto_map") / "qwen2"
  shutil.copytree(user_dir, path)
  write_auto_map(path)
  return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("byo_data") / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
  return path


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")


def _last_json(capsys, argv) -> dict:
  assert cli.main(argv) == 0, argv
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _train(capsys, config: str, workdir: Path, *flags) -> None:
  """`paraflax train --config hf/CONFIG` (a recipe by name), shrunk: it runs its 2 steps to a
  finite loss."""
  summary = _last_json(capsys, ["train", "--config", f"hf/{config}", "--workdir",
                                str(workdir), "--set",
                                f"data.cache_dir={workdir.parent / 'cache'}", *SMALL, *flags])
  assert summary["step"] == 2 and np.isfinite(summary["train_loss"]), summary


def _ids(capsys, *flags, prompt=PROMPT) -> list[int]:
  """The new ids of `paraflax generate FLAGS --prompt PROMPT --json`."""
  out = _last_json(capsys, ["generate", "--prompt", prompt, "--max-new-tokens", str(NEW),
                            "--json", *flags])
  return out["completions"][0]["ids"]


def _hf_model(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _same_tokenizer_everywhere(path: Path, tok) -> None:
  """transformers' AutoTokenizer of the HF dir `path` (with and without trust_remote_code)
  encodes the probe texts, chat turns and special tokens to `tok`'s ids and decodes every id
  to `tok`'s text; paraflax reads `path` as `tok`, without a warning."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", auto_tokenizer.TokenizerWarning)
    assert load_hf_tokenizer(path).fingerprint() == tok.fingerprint()
  texts = auto_tokenizer.probe_texts(tok, chat_template(path))
  assert len(texts) > len(auto_tokenizer.PROBES) + 2  # its special tokens and a chat turn
  for trust in (False, True):
    auto = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    assert auto_tokenizer.differences(auto, tok, texts) is None, (type(auto), trust)


def _check_export(capsys, run: Path, out: Path, base: Path) -> None:
  """`export` of `run` reloads in transformers with paraflax's logits (within 1e-4), which
  training moved away from the `base` HF dir's, and its tokenizer encodes as paraflax's."""
  assert cli.main(["export", "--workdir", str(run), "--to-hf", str(out)]) == 0
  capsys.readouterr()
  model, tok, _ = load_trained(run)
  _same_tokenizer_everywhere(out, tok)
  tokens = np.random.RandomState(0).randint(0, tok.vocab_size, (2, 20))
  with torch.no_grad():
    got = _hf_model(out)(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(got, full_logits(model, tokens), atol=1e-4, rtol=0)
  ref = _hf_model(base)
  with torch.no_grad():
    before = ref(torch.tensor(tokens)).logits.numpy()
  assert np.abs(got[..., :before.shape[-1]] - before).max() > 1e-2  # the trained weights


def _hf_greedy(out: Path, prompt: str) -> list[int]:
  """transformers' greedy new ids from the exported dir (its tokenizer, its generation config)."""
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = tok(prompt, return_tensors="pt").input_ids
  with torch.no_grad():
    got = _hf_model(out).generate(ids, max_new_tokens=NEW, do_sample=False)
  return got[0, ids.shape[1]:].tolist()


@pytest.mark.fast
def test_transformers_tokenizes_every_export_as_paraflax_does(capsys, user_dir, hf_dir,
                                                              tmp_path):
  """The user's Qwen2 dir with its own byte-level BPE: transformers 5 loads `Qwen2Tokenizer`
  (its pre-tokenizer, not tokenizer.json's) and splits "\\n    " otherwise; paraflax says so
  in one line naming what it uses. Its export, the same dir given the export's `auto_map`, an
  HF-derived model with method tokens added (<mask>, <sep>) and `make_random_hf_model`'s
  output encode and decode alike everywhere."""
  auto = transformers.AutoTokenizer.from_pretrained(user_dir)
  with pytest.warns(auto_tokenizer.TokenizerWarning, match="loads Qwen2Tokenizer"):
    source = load_hf_tokenizer(user_dir)
  text = "def f(xs):\n    return"
  assert auto(text)["input_ids"] != source.encode(text)  # the mismatch the export avoids
  assert cli.main(["export", "--hf", str(user_dir), "--to-hf", str(tmp_path / "out")]) == 0
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("paraflax export: warning: "), err
  assert "Qwen2Tokenizer" in err and "paraflax uses its tokenizer.json" in err
  _same_tokenizer_everywhere(tmp_path / "out", source)
  _same_tokenizer_everywhere(hf_dir, source)
  chat = transformers.AutoTokenizer.from_pretrained(tmp_path / "out").apply_chat_template(
      [{"role": "user", "content": "print(1)\n  x"}], add_generation_prompt=True)
  assert chat["input_ids"] == source.encode(
      "<|im_start|>user\nprint(1)\n  x<|im_end|>\n<|im_start|>assistant\n")
  from paraflax.training.run.trainer import init_params
  methods = source.with_special_tokens({"mask": "<mask>", "sep": "<sep>"})
  cfg = pf.ModelConfig(vocab_size=methods.vocab_size, d_model=16, n_layers=1, n_heads=2,
                       n_kv_heads=1, d_ff=32, max_seq_len=64, qkv_bias=True,
                       mask_token_id=methods.mask_id, sep_token_id=methods.sep_id)
  export_hf(nnx.merge(*init_params(cfg, 0)), tmp_path / "methods", methods)
  _same_tokenizer_everywhere(tmp_path / "methods", methods)
  made = make_random_hf_model(tmp_path / "random", vocab_size=300, max_files=3)
  _same_tokenizer_everywhere(made, load_hf_tokenizer(made))


@pytest.mark.slow
def test_sft_generates_exactly_exports_and_transformers_stops_at_eos(
    capsys, hf_dir, data_file, tmp_path):
  run = tmp_path / "sft"
  _train(capsys, "sft", run, "--hf", str(hf_dir), "--data", str(data_file),
         "--set", "data.seq_len=32", "--set", "data_source_args.val_fraction=0.2")
  ar = _ids(capsys, "--workdir", str(run), "--decoder", "ar")
  assert len(ar) == NEW and 0 not in ar  # EOS not reached: the step-k check below is ours
  for decoder in ("jacobi", "prompt-lookup"):
    assert _ids(capsys, "--workdir", str(run), "--decoder", decoder) == ar, decoder
  out = tmp_path / "out"
  _check_export(capsys, run, out, hf_dir)
  assert _hf_greedy(out, PROMPT) == ar
  assert transformers.AutoTokenizer.from_pretrained(out).chat_template == CHAT
  chat = ["--prompt", "print(3)", "--chat"]  # the template travels with the weights
  assert _ids(capsys, "--hf", str(out), *chat) == _ids(capsys, "--workdir", str(run), *chat)
  # EOS := the token greedy emits first at step k: transformers and paraflax (reading the
  # exported generation config) both stop there, EOS included
  k = next(i for i in range(2, NEW - 1) if ar[i] not in ar[:i])
  gen = json.loads((out / "generation_config.json").read_text())
  (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": ar[k]}))
  assert _hf_greedy(out, PROMPT) == ar[:k + 1]
  assert _ids(capsys, "--hf", str(out), "--decoder", "ar") == ar[:k + 1]


@pytest.mark.slow
def test_jacobi_forcing_from_its_own_trajectories_decodes_exactly(
    capsys, hf_dir, data_file, tmp_path):
  store, run = tmp_path / "traj", tmp_path / "jf"
  collected = _last_json(capsys, [
      "collect-trajectories", "--hf", str(hf_dir), "--data", str(data_file), "--out",
      str(store), "--block-size", "4", "--num-blocks", "2", "--max-prompt-len", "16",
      "--min-prompt-len", "3", "--examples", "8", "--batch-size", "4"])
  assert collected["examples"] == 8
  _train(capsys, "jacobi_forcing", run, "--hf", str(hf_dir), "--set",
         f"data_source_args.path={store}", "--set", "data.seq_len=32", "--set",
         "data_source_args.noise_window=4", "--set", "data_source_args.val_fraction=0.25")
  ar = _ids(capsys, "--workdir", str(run), "--decoder", "ar")
  assert _ids(capsys, "--workdir", str(run), "--decoder", "jacobi-mr", "--block-size", "4") == ar


@pytest.mark.slow
def test_tidar_decodes_exactly_exports_its_ar_mode_and_benches_on_the_users_data(
    capsys, hf_dir, data_file, tmp_path):
  run = tmp_path / "tidar"
  _train(capsys, "tidar", run, "--hf", str(hf_dir), "--data", str(data_file),
         "--set", "data.seq_len=32", "--set", "data_source_args.val_fraction=0.2")
  ar = _ids(capsys, "--workdir", str(run), "--decoder", "ar")
  assert _ids(capsys, "--workdir", str(run), "--decoder", "tidar") == ar
  # the base it was trained from drafts for it (the verifier has a <mask> of its own)
  assert _ids(capsys, "--workdir", str(run), "--decoder", "speculative", "--draft",
              str(hf_dir)) == ar
  _check_export(capsys, run, tmp_path / "out", hf_dir)
  # the bench on the user's prompts and records: every method of the HF model and of the
  # TiDAR beside it (its rows grown by <mask>) is exact, each weights' loss on the records
  out = tmp_path / "bench" / "bench.json"
  assert cli.main(["bench", "--hf", str(hf_dir), "--tidar-workdir", str(run), "--prompts-file",
                   str(data_file), "--eval-data", str(data_file), "--prompts", "2",
                   "--max-new-tokens", "8", "--batch-size", "2", "--json", str(out)]) == 0
  capsys.readouterr()
  rows = json.loads(out.read_text())
  assert {"ar", "jacobi", "prompt_lookup", "tidar_k4"} <= {r["method"] for r in rows}
  assert all(r["exact_match_vs_ar"] == 1.0 for r in rows), [
      (r["method"], r["exact_match_vs_ar"]) for r in rows]
  losses = {r["weights"]: r["eval_data_loss"] for r in rows}
  assert set(losses) == {"base", "tidar"} and all(np.isfinite(v) and v > 0 for v in losses.values())


@pytest.mark.slow
def test_deer_drafter_stage1_then_stage2_drafts_exactly_for_the_hf_model(
    capsys, hf_dir, data_file, tmp_path):
  store, d1, d2 = tmp_path / "teacher", tmp_path / "deer1", tmp_path / "deer2"
  collected = _last_json(capsys, [
      "teacher-data", "--hf", str(hf_dir), "--data", str(data_file), "--out", str(store),
      "--max-prompt-len", "16", "--answer-len", "16", "--min-prompt-len", "3",
      "--examples", "8", "--batch-size", "4"])
  assert collected["examples"] == 8
  common = ["--set", f"data_source_args.path={store}", "--set", "data.seq_len=32",
            "--set", "data_source_args.val_fraction=0.25"]
  for config, workdir, init in (("deer_stage1.py", d1, hf_dir), ("deer_stage2.py", d2, d1)):
    _train(capsys, config, workdir, "--hf", str(init), *common)
  ar = _ids(capsys, "--hf", str(hf_dir), "--decoder", "ar")
  # the drafter has <mask> and <sep> of its own, the verifier none
  assert _ids(capsys, "--hf", str(hf_dir), "--decoder", "deer", "--draft", str(d2)) == ar


@pytest.mark.slow
def test_asarm_trains_and_its_export_is_a_one_line_refusal(capsys, hf_dir, data_file, tmp_path):
  run = tmp_path / "asarm"
  _train(capsys, "asarm", run, "--hf", str(hf_dir), "--data", str(data_file),
         "--set", "data.seq_len=32", "--set", "data_source_args.val_fraction=0.2")
  assert cli.main(["export", "--workdir", str(run), "--to-hf", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "have no Hugging Face counterpart" in err, err
  assert not (tmp_path / "out" / "model.safetensors").exists()
