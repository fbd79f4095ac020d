"""Hugging Face checkpoints: logit and greedy parity with transformers, exact round trips, errors.

Tiny random checkpoints are written offline by transformers' `save_pretrained` (safetensors),
with weights re-drawn at unit gain so logits have std ~4: a layout or RoPE mistake then moves
logits by O(1), far above the 1e-4 tolerance.
"""

import copy
import dataclasses
import json
import math
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

import paraflax as pf
from paraflax.hf import (
  encode_prompt,
  export_hf,
  load_hf,
  load_hf_tokenizer,
  model_config_from_hf,
)
from paraflax.hf.export import write_auto_map
from paraflax.hf.load import abstract_model
from paraflax.hf.safetensors_io import read_header, read_tensor, write_safetensors
from paraflax.training import load_trained
from paraflax.training.workdirs.convert import convert_hf
from conftest import full_logits, reference_libs

torch, transformers = reference_libs()

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
VARIANTS = {  # name: (transformers config class, overrides, save_pretrained kwargs)
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6), {}),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1e6), {}),
    "llama": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=False), {}),
    # wavelengths 6.3 (kept), 20 (interpolated), 63.. (divided by 8): all three regimes
    "llama3_rope": ("LlamaConfig", dict(rope_scaling=LLAMA3, rope_theta=10000.0), {}),
    "sharded": ("Qwen2Config", dict(tie_word_embeddings=False), dict(max_shard_size="40KB")),
}
EOS = 127  # "<|eos|>" in the tiny tokenizer


def _tokenizer() -> tokenizers.Tokenizer:
  """A word-level tokenizer over the 128 ids: "w0".."w124", BOS "<s>"=125, pad 126, EOS 127."""
  vocab = {f"w{i}": i for i in range(125)} | {"<s>": 125, "<pad>": 126, "<|eos|>": 127}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<s>", "<pad>", "<|eos|>"])
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", 125)])
  return tok


def _randomize(model, seed: int, logit_std: float = 4.0) -> None:
  """Unit-gain weights, random norm scales and biases, logits rescaled to `logit_std`."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      elif name.endswith("bias"):
        p.normal_(0.0, 0.5)
      elif "embed_tokens" in name:
        p.normal_(0.0, 1.0)
      else:
        p.normal_(0.0, p.shape[1] ** -0.5)
    tokens = torch.randint(0, 128, (2, 32))
    scale = logit_std / float(model(tokens).logits.std())
    head = model.model.norm.weight if model.config.tie_word_embeddings else model.lm_head.weight
    head.mul_(scale)
    assert float(model(tokens).logits.std()) >= 2.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (directory, transformers model in float32 eval mode); each directory carries the
  `auto_map` exports do, so that transformers reads its word-level tokenizer as it is."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for i, (name, (cls, over, save)) in enumerate(VARIANTS.items()):
    cfg = getattr(transformers, cls)(**copy.deepcopy({**BASE, **over}))  # it edits dicts
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    _randomize(model, seed=i)
    path = root / name
    model.save_pretrained(path, **save)
    _tokenizer().save(str(path / "tokenizer.json"))
    write_auto_map(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 0]}))
    out[name] = (path, model)
  assert len(list((root / "sharded").glob("model-*.safetensors"))) > 1
  assert (root / "sharded" / "model.safetensors.index.json").is_file()
  return out


def _hf_logits(model, tokens, positions=None) -> np.ndarray:
  with torch.no_grad():
    pos = None if positions is None else torch.tensor(positions)
    return model(torch.tensor(tokens), position_ids=pos).logits.numpy()


def _params(model) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(checkpoints, name):
  """Same tokens, same logits: max |paraflax - transformers| <= 1e-4 in float32."""
  path, hf = checkpoints[name]
  model = load_hf(path)
  t = 160 if name == "llama3_rope" else 48  # llama3: far beyond original_max_position (32)
  tokens = np.random.RandomState(0).randint(0, 128, (2, t))
  ref = _hf_logits(hf, tokens)
  assert ref.std() >= 2.0
  np.testing.assert_allclose(full_logits(model, tokens), ref, rtol=0, atol=1e-4)
  # shifted positions (a chunk after a cache, or a left-padded row)
  positions = np.broadcast_to(np.arange(t) + 37, (2, t))
  np.testing.assert_allclose(full_logits(model, tokens, positions),
                             _hf_logits(hf, tokens, positions), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_llama3_rope_scaling_matters(checkpoints):
  """The llama3 parity above has power: the same weights without the scaling differ by O(1)."""
  path, hf = checkpoints["llama3_rope"]
  model = load_hf(path)
  assert model.cfg.rope_scaling == pf.RopeScaling(original_max_position_embeddings=32)
  plain_def, _ = abstract_model(dataclasses.replace(model.cfg, rope_scaling=None))
  plain = nnx.merge(plain_def, nnx.state(model, nnx.Param))
  tokens = np.random.RandomState(1).randint(0, 128, (1, 160))
  gap = np.abs(full_logits(plain, tokens) - _hf_logits(hf, tokens)).max()
  assert gap > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_tied", "llama3_rope"])
def test_greedy_generate_matches_transformers(checkpoints, name):
  """pf.generate (greedy AR) equals transformers' greedy generate, token for token, per row."""
  path, hf = checkpoints[name]
  model = load_hf(path)
  rs = np.random.RandomState(2)
  prompts = [rs.randint(0, 125, n).tolist() for n in (5, 13, 9)]
  out = pf.generate(model, prompts, max_new_tokens=32)
  width = max(map(len, prompts))  # transformers: left padding + attention mask
  ids = torch.tensor([[126] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.no_grad():
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                      do_sample=False, pad_token_id=126, eos_token_id=None)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref[:, width:].numpy())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "llama3_rope"])
def test_export_round_trip_is_exact(checkpoints, name, tmp_path):
  """load -> export -> load: same config, bit-identical params; transformers reads the export
  as the same model (bit-identical logits)."""
  path, hf = checkpoints[name]
  model = load_hf(path)
  export_hf(model, tmp_path, tokenizer=load_hf_tokenizer(path))
  again = load_hf(tmp_path)
  assert again.cfg == model.cfg
  a, b = _params(model), _params(again)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
  assert load_hf_tokenizer(tmp_path).eos_id == EOS
  reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
  tokens = np.random.RandomState(3).randint(0, 128, (2, 40))
  np.testing.assert_array_equal(_hf_logits(reread.eval(), tokens), _hf_logits(hf, tokens))


@pytest.mark.slow
def test_bfloat16_round_trip_is_exact(checkpoints, tmp_path):
  """A bf16 load exports bf16 tensors, which load back bit-identically (dtype from config)."""
  model = load_hf(checkpoints["qwen3"][0], dtype="bfloat16")
  export_hf(model, tmp_path)
  assert {i.dtype for i in read_header(tmp_path / "model.safetensors").values()} == {
      np.dtype(jnp.bfloat16)}
  again = load_hf(tmp_path)
  assert again.cfg == model.cfg and again.cfg.param_dtype == "bfloat16"
  a, b = _params(model), _params(again)
  assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_convert_writes_a_load_trained_workdir(checkpoints, tmp_path):
  """convert_hf -> load_trained gives the same config, params and tokenizer as load_hf."""
  path, _ = checkpoints["llama3_rope"]
  summary = convert_hf(path, tmp_path / "conv")
  model, tok, train_cfg = load_trained(tmp_path / "conv")
  ref = load_hf(path)
  assert model.cfg == ref.cfg and train_cfg.model.rope_scaling == ref.cfg.rope_scaling
  a, b = _params(model), _params(ref)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert summary["n_params"] == sum(x.size for x in a.values())
  assert tok.fingerprint() == load_hf_tokenizer(path).fingerprint()
  assert load_hf_tokenizer(tmp_path / "conv").eos_id == EOS
  with pytest.raises(ValueError, match=r"is not empty \(paraflax convert output\): pass "):
    convert_hf(path, tmp_path / "conv")
  with pytest.raises(ValueError, match="it is the model's own source directory"):
    convert_hf(path, path, overwrite=True)
  (tmp_path / "conv" / "stale").write_text("x")
  convert_hf(path, tmp_path / "conv", overwrite=True)  # an earlier convert: replaced whole
  assert not (tmp_path / "conv" / "stale").exists() and load_trained(tmp_path / "conv")
  (tmp_path / "conv" / "hf_config.json").unlink()  # a training workdir: never written over
  with pytest.raises(ValueError, match="it is a paraflax workdir"):
    convert_hf(path, tmp_path / "conv", overwrite=True)


@pytest.mark.fast
def test_tokenizer_ids_and_prompt_encoding(checkpoints):
  """EOS comes from generation_config.json (first of a list); prompts encode as HF does."""
  path, _ = checkpoints["llama"]
  tok = load_hf_tokenizer(path)
  assert tok.eos_id == EOS and tok.vocab_size == 128
  text = "w3 w17 <|eos|> w5"
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
  assert encode_prompt(tok, text) == ref(text)["input_ids"] == [125, 3, 17, EOS, 5]
  assert tok.decode(tok.encode("w1 w2")) == "w1 w2"


# ---- errors (no transformers model needed) ----

def _write_config(path, **fields):
  path.mkdir(parents=True, exist_ok=True)
  cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, **fields}
  (path / "config.json").write_text(json.dumps(cfg))
  return path


@pytest.mark.fast
def test_missing_directory_and_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="directory .* not found"):
    load_hf(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(tmp_path)
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    load_hf(_write_config(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load_hf_tokenizer(tmp_path / "empty")
  (tmp_path / "empty" / "model.safetensors.index.json").write_text('{"weight_map": []}')
  with pytest.raises(ValueError, match=r"index.json: field 'weight_map' must be an object, "
                     r"got \[\]$"):
    load_hf(tmp_path / "empty")
  (tmp_path / "empty" / "config.json").write_text("[]")
  with pytest.raises(ValueError, match=r"empty/config.json: expected a JSON object, got list"):
    load_hf(tmp_path / "empty")


@pytest.mark.fast
@pytest.mark.parametrize("fields, match", [
    (dict(model_type="qwen3_moe"), "model_type='qwen3_moe'.*Mixture-of-experts.*not supported"),
    (dict(model_type="mistral"), "model_type='mistral'.*supported: llama"),
    (dict(model_type="gpt2"), "supported: llama .*qwen2 .*qwen3"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "'dynamic'"),
    (dict(use_sliding_window=True, sliding_window=16), "sliding-window"),
    (dict(model_type="llama", attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
])
def test_unsupported_configs_are_named(tmp_path, fields, match):
  with pytest.raises(ValueError, match=match):
    load_hf(_write_config(tmp_path, **fields))


@pytest.mark.fast
def test_config_layouts_agree():
  """transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters) layouts read alike."""
  common = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=128)
  v4 = model_config_from_hf({**common, "rope_theta": 5e5, "rope_scaling": LLAMA3})
  v5 = model_config_from_hf({**common, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
  assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling.factor == 8.0
  assert v4.n_kv_heads == 4 and v4.head_dim is None and not v4.qkv_bias


def _rewrite(src, dst, drop=(), reshape=None):
  """Copy checkpoint `src` to `dst` without the tensors in `drop`."""
  shutil.copytree(src, dst)
  for f in dst.glob("*.safetensors"):
    infos = read_header(f)
    with open(f, "rb") as fh:
      arrays = {n: read_tensor(fh, i) for n, i in infos.items() if n not in drop}
    write_safetensors(f, [(n, a.shape, a.dtype, lambda a=a: a) for n, a in arrays.items()])
  return dst


@pytest.mark.fast
def test_missing_and_mismatched_tensors_are_named(checkpoints, tmp_path):
  src, _ = checkpoints["qwen2_untied"]
  gone = _rewrite(src, tmp_path / "gone", drop={"model.layers.1.mlp.up_proj.weight",
                                                  "lm_head.weight"})
  with pytest.raises(ValueError, match="missing tensors: lm_head.weight, "
                                       "model.layers.1.mlp.up_proj.weight"):
    load_hf(gone)
  wide = _rewrite(src, tmp_path / "wide")
  cfg = json.loads((wide / "config.json").read_text())
  (wide / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight \[64, 128\] "
                                       r"\(expected \[64, 256\]\)"):
    load_hf(wide)
  deep = _rewrite(src, tmp_path / "deep")
  (deep / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
  with pytest.raises(ValueError, match="unexpected tensors .*model.layers.1."):
    load_hf(deep)


@pytest.mark.fast
def test_export_refuses_configs_without_a_counterpart(tmp_path):
  cfg = pf.ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                       max_seq_len=32, qkv_bias=True, qk_norm=True)
  model = nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="qk_norm together with qkv_bias"):
    export_hf(model, tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_rope_scaling_json_round_trip():
  """A ModelConfig with llama3 scaling survives asdict -> JSON -> ModelConfig (TrainConfig)."""
  cfg = pf.ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                       max_seq_len=32, rope_scaling=pf.RopeScaling(factor=32.0))
  back = pf.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
  assert back == cfg and hash(back) == hash(cfg)
  with pytest.raises(ValueError, match="'yarn' is not supported"):
    pf.RopeScaling(rope_type="yarn")
  assert math.isclose(back.rope_scaling.factor, 32.0)


@pytest.mark.slow
def test_cli_generate_convert_export_on_a_hf_checkpoint(checkpoints, tmp_path, capsys):
  """`paraflax generate --hf`, `convert --from-hf` then `generate --workdir`, `export --to-hf`:
  text in, the same greedy text out from every route."""
  from paraflax import cli
  src = checkpoints["qwen2_tied"][0]
  prompt = ["--prompt", "w5 w9 w2", "--max-new-tokens", "6"]
  assert cli.main(["generate", "--hf", str(src), *prompt]) == 0
  direct = capsys.readouterr().out
  assert direct.startswith("w5 w9 w2") and len(direct.split()) > 3
  assert cli.main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "conv")]) == 0
  capsys.readouterr()
  assert cli.main(["generate", "--workdir", str(tmp_path / "conv"), *prompt]) == 0
  assert capsys.readouterr().out == direct
  assert cli.main(["export", "--workdir", str(tmp_path / "conv"), "--to-hf",
                   str(tmp_path / "back")]) == 0
  capsys.readouterr()
  assert cli.main(["generate", "--hf", str(tmp_path / "back"), *prompt]) == 0
  assert capsys.readouterr().out == direct


@pytest.mark.slow
@pytest.mark.parametrize("route", ["hf", "convert"])
def test_export_keeps_several_eos_ids_bos_and_the_prompt_encoding(checkpoints, tmp_path, route):
  """Every EOS id of the source (generation_config lists two) and its BOS reach the export's
  configs, straight from the HF dir or through `convert`; AutoTokenizer encodes prompts as
  paraflax does (BOS first, special-token strings parsed as the HF tokenizer parses them)."""
  from paraflax import cli
  src = checkpoints["llama"][0]
  flag = ["--hf", str(src)]
  if route == "convert":
    assert cli.main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "conv")]) == 0
    flag = ["--workdir", str(tmp_path / "conv")]
  assert cli.main(["export", *flag, "--to-hf", str(tmp_path / "out")]) == 0
  for name in ("config.json", "generation_config.json"):
    c = json.loads((tmp_path / "out" / name).read_text())
    assert (c["eos_token_id"], c["bos_token_id"], c["pad_token_id"]) == ([EOS, 0], 125, 126)
  hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  assert (hf_tok.eos_token, hf_tok.bos_token, hf_tok.pad_token) == ("<|eos|>", "<s>", "<pad>")
  text = "w3 w17 <|eos|> w5"
  assert hf_tok(text)["input_ids"] == encode_prompt(load_hf_tokenizer(src), text)
  assert load_hf_tokenizer(tmp_path / "out").eos_id == EOS


# ---- what can be verified without checksums: a corrupt file is named, tensor by tensor ----

def _corrupt(checkpoints, tmp_path, edit):
  """A copy of the qwen2_untied checkpoint whose model.safetensors bytes went through `edit`."""
  path = shutil.copytree(checkpoints["qwen2_untied"][0], tmp_path / "bad")
  file = path / "model.safetensors"
  raw = bytearray(file.read_bytes())
  edit(raw, read_header(file))
  file.write_bytes(bytes(raw))
  return path


def _flip_exponent(raw, at):  # element 7's top exponent bit (float32, LE): ~0.1 becomes ~1e37
  raw[at + 7 * 4 + 3] ^= 0x40


def _nan(raw, at):  # element 9 overwritten with a NaN (a diverged run, a bad conversion)
  raw[at + 9 * 4:at + 10 * 4] = np.float32(np.nan).tobytes()


@pytest.mark.fast
@pytest.mark.parametrize("edit, match", [
    (_flip_exponent, r"holds an implausible value \(.*e\+3\d at index \[0, 7\]\)"),
    (_nan, r"holds a non-finite value \(nan at index \[0, 9\]\)"),
])
def test_a_corrupt_weight_is_named_as_it_is_read(checkpoints, tmp_path, edit, match):
  name = "model.layers.1.mlp.up_proj.weight"
  path = _corrupt(checkpoints, tmp_path, lambda raw, infos: edit(raw, infos[name].start))
  with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}' {match}"):
    load_hf(path)


@pytest.mark.fast
def test_a_corrupt_header_truncation_and_wrong_dtype_are_named(checkpoints, tmp_path):
  def offset_bit(raw, infos):  # one bit of the last digit of a tensor's end offset
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode()
    at = header.index('"data_offsets":[', header.index('"model.layers.0.mlp.up_proj.weight"'))
    last = header.index("]", at) - 1
    raw[8 + last] ^= 0x01

  with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.up_proj"
                                       r".weight' has an inconsistent byte range"):
    load_hf(_corrupt(checkpoints, tmp_path / "a", offset_bit))
  cut = _corrupt(checkpoints, tmp_path / "b", lambda raw, infos: raw.__delitem__(slice(-4, None)))
  with pytest.raises(ValueError, match=r"model.safetensors: \d+ bytes, but its header ends the "
                                       r"data at byte \d+ \(truncated\)"):
    load_hf(cut)
  half = _corrupt(checkpoints, tmp_path / "c", lambda raw, infos: None)
  cfg = json.loads((half / "config.json").read_text())
  cfg.pop("torch_dtype", None)
  (half / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
  with pytest.raises(ValueError, match=r"model.safetensors: tensor '[\w.]+' is float32, "
                                       r"expected bfloat16 \(config.json\)"):
    load_hf(half)
  (half / "config.json").write_text(json.dumps(cfg)[:40])
  with pytest.raises(ValueError, match=rf"{half / 'config.json'}: not valid JSON, truncated"):
    load_hf(half)
