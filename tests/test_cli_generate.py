"""`paraflax generate`: every decoder name on the shipped checkpoints and a Hugging Face
directory gives greedy AR's ids, the API's forward counts, prompts files, chat templates, and
one-line errors."""

import json
import shutil
from pathlib import Path

import jax
import pytest
from conftest import reference_libs

import paraflax as pf
from paraflax import cli
from paraflax.hf import load_hf
from paraflax.hf.export import write_auto_map
from paraflax.loading import load_model

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints"
BASE, TIDAR = str(SHIPPED / "tiny_ar"), str(SHIPPED / "tidar_continual")
PROMPTS = ["def add(a, b):", "import os"]
NEW = 12
CHAT = ("{% for m in messages %}<sep>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<sep>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random-weight Qwen2 directory saved by transformers, with the shipped model's BPE
  tokenizer (so it can draft for it), a chat template and the `auto_map` exports carry."""
  torch, transformers = reference_libs()
  path = tmp_path_factory.mktemp("hf") / "qwen2"
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(vocab_size=2048, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
  shutil.copyfile(SHIPPED / "tiny_ar" / "tokenizer.json", path / "tokenizer.json")
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
      "chat_template": CHAT}))
  write_auto_map(path)
  return path


def _generate(capsys, *flags) -> dict:
  """`paraflax generate FLAGS --json`, run in-process: the printed object."""
  assert cli.main(["generate", "--max-new-tokens", str(NEW), "--json", *flags]) == 0
  return json.loads(capsys.readouterr().out)


def _ids(result) -> list:
  return [c["ids"] for c in result["completions"]]


@pytest.mark.slow
def test_every_decoder_prints_greedy_ar_ids_and_the_api_counts(capsys, tmp_path, hf_dir):
  prompts_file = tmp_path / "prompts.jsonl"
  prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[1:]))
  source = ["--workdir", BASE, "--prompt", PROMPTS[0], "--prompts-file", str(prompts_file)]
  ar = _generate(capsys, *source, "--decoder", "ar")
  assert [c["prompt"] for c in ar["completions"]] == PROMPTS
  for flags in (["--decoder", "jacobi"], ["--decoder", "jacobi-mr", "--block-size", "4"],
                ["--decoder", "prompt-lookup", "--ngram", "2"],
                ["--decoder", "speculative", "--draft", str(SHIPPED / "ar_drafter")],
                ["--decoder", "speculative", "--draft", str(hf_dir)],  # an HF dir drafts too
                ["--decoder", "deer", "--draft", str(SHIPPED / "deer_drafter")]):
    assert _ids(_generate(capsys, *source, *flags)) == _ids(ar), flags
  tidar = ["--workdir", TIDAR, "--prompt", PROMPTS[0]]
  assert _ids(_generate(capsys, *tidar, "--decoder", "tidar")) == _ids(
      _generate(capsys, *tidar, "--decoder", "ar"))

  model, tok, encode = load_model(BASE)  # the counts are the API's: prefill not counted
  out = pf.generate(model, [encode(p) for p in PROMPTS], decoder=pf.decoders.AR(),
                    max_new_tokens=NEW, rng=jax.random.key(0), eos_id=tok.eos_id)
  assert [c["forwards"] for c in ar["completions"]] == out.forwards.tolist() == [NEW - 1] * 2
  assert [c["tokens_per_forward"] for c in ar["completions"]] == [1.0, 1.0]  # as the bench
  assert cli.main(["generate", "--max-new-tokens", str(NEW), *source]) == 0
  printed, err = capsys.readouterr()
  assert printed.startswith(PROMPTS[0]) and f"\n{PROMPTS[1]}" in printed
  assert err.count(f"{NEW} tokens: {NEW - 1} forwards after the prefill + 1 prefill") == 2


@pytest.mark.slow
def test_hf_dir_every_way_and_its_chat_template(capsys, hf_dir, tmp_path):
  """`--hf DIR` (or the dir as --workdir) with jacobi equals AR; `--chat` and chat records
  render the template as transformers does."""
  import transformers
  jacobi = _generate(capsys, "--hf", str(hf_dir), "--decoder", "jacobi", "--prompt", "x = 1")
  assert _ids(jacobi) == _ids(_generate(capsys, "--workdir", str(hf_dir), "--prompt", "x = 1"))

  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
  ids = transformers.AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  ref = pf.generate(load_hf(hf_dir), [ids], decoder=pf.decoders.AR(), max_new_tokens=NEW,
                    eos_id=1)
  file = tmp_path / "chat.jsonl"
  file.write_text(json.dumps({"messages": messages}) + "\n")
  chat = _generate(capsys, "--hf", str(hf_dir), "--prompts-file", str(file))
  assert _ids(chat) == [ref.tokens[0, :int(ref.lengths[0])].tolist()]
  text = transformers.AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
      messages, add_generation_prompt=True, tokenize=False)
  assert [c["prompt"] for c in chat["completions"]] == [text]  # what was completed, not ""
  user = _generate(capsys, "--hf", str(hf_dir), "--chat", "--prompt", "hi")
  assert _ids(user) == _ids(_generate(capsys, "--hf", str(hf_dir), "--prompts-file", str(
      _jsonl(tmp_path, {"messages": [{"role": "user", "content": "hi"}]}))))


def _jsonl(tmp_path, record) -> Path:
  path = tmp_path / "one.jsonl"
  path.write_text(json.dumps(record) + "\n")
  return path


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors(capsys, tmp_path, hf_dir):
  other = tmp_path / "other_tokenizer"  # the HF dir with one more token: another fingerprint
  shutil.copytree(hf_dir, other)
  tok = json.loads((other / "tokenizer.json").read_text())
  tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 2048, "content": "<extra>"})
  (other / "tokenizer.json").write_text(json.dumps(tok))
  (tmp_path / "neither").mkdir()
  cases = [
      (["--decoder", "medusa"],
       "unknown decoder 'medusa': pick one of ar, jacobi, jacobi-released, jacobi-mr"),
      (["--decoder", "speculative"], "--decoder speculative needs a draft model: --draft DIR"),
      (["--decoder", "deer"], "--decoder deer needs a draft model: --draft DIR"),
      (["--decoder", "jacobi", "--ngram", "2"], "--ngram does not apply to the jacobi decoder"),
      (["--decoder", "jacobi", "--block-size", "5000"], "Jacobi block_size=5000 does not fit the "
       "model's max_seq_len 512: a step works on 5000 tokens at once"),
      (["--decoder", "speculative", "--draft", str(other)], "has another tokenizer than the model"),
      (["--draft", str(tmp_path / "neither"), "--decoder", "deer"],
       "expected a paraflax workdir (config.json + checkpoints/) or a Hugging Face directory "
       "(config.json + *.safetensors)"),
      (["--chat"], "has no chat template"),
      (["--prompts-file", str(_jsonl(tmp_path, {"text": "x"}))], "one.jsonl:1: expected a JSON "
       "object with \"prompt\""),
  ]
  for flags, match in cases:
    assert cli.main(["generate", "--workdir", BASE, "--prompt", "x", *flags]) == 2, flags
    err = capsys.readouterr().err.strip()
    assert err.startswith("paraflax generate: error:") and "\n" not in err and match in err, err
  assert cli.main(["generate", "--workdir", str(tmp_path / "neither"), "--prompt", "x"]) == 2
  assert "is not a model directory: expected a paraflax workdir" in capsys.readouterr().err
  assert cli.main(["generate", "--hf", BASE, "--prompt", "x"]) == 2
  assert "expected a Hugging Face directory (config.json + *.safetensors)" in capsys.readouterr().err
  assert cli.main(["generate", "--workdir", BASE]) == 2
  assert "no prompt: give --prompt TEXT or --prompts-file" in capsys.readouterr().err
