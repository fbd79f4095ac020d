"""`paraflax export` writes a complete Hugging Face directory for every model with a counterpart:
transformers' AutoModelForCausalLM + AutoTokenizer load it with paraflax's logits and token ids,
the configs name the tokenizer's EOS/PAD, and `generate` stops at EOS. AS-ARMs are refused."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import full_logits, reference_libs

from paraflax import cli
from paraflax.training import load_trained

torch, transformers = reference_libs()

ROOT = Path(__file__).resolve().parent.parent
EXPORTABLE = ["tiny_ar", "jacobi_forcing_r1", "tidar_continual", "deer_drafter", "ar_drafter"]
TEXT = 'def f(x):\n    return x + 1  # "<eos>" in text stays text\n'


def _export(name, out) -> Path:
  assert cli.main(["export", "--workdir", str(ROOT / "checkpoints" / name),
                   "--to-hf", str(out)]) == 0
  return out


def _load_hf(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPORTABLE)
def test_export_loads_in_transformers_with_its_tokenizer(name, tmp_path):
  """Equal logits (1e-4), equal token ids, EOS/PAD (and <mask>/<sep>) in every config."""
  model, tok, _ = load_trained(ROOT / "checkpoints" / name)
  out = _export(name, tmp_path / "hf")
  hf_model, hf_tok = _load_hf(out)
  tokens = np.random.RandomState(0).randint(0, tok.vocab_size, (2, 48))
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ref, full_logits(model, tokens), atol=1e-4, rtol=0)
  assert hf_tok(TEXT)["input_ids"] == tok.encode(TEXT)
  assert hf_tok.decode(tok.encode(TEXT)) == TEXT
  configs = [json.loads((out / f).read_text()) for f in ("config.json", "generation_config.json")]
  for c in (*configs, hf_model.config, hf_model.generation_config):
    c = c if isinstance(c, dict) else c.to_dict()
    assert (c["eos_token_id"], c["pad_token_id"]) == (tok.eos_id, tok.pad_id) == (1, 0)
  assert (hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.bos_token_id) == (1, 0, None)
  assert {tok.mask_id, tok.sep_id} <= set(hf_tok.all_special_ids)
  if model.cfg.mask_token_id is not None:  # TiDAR, DEER: the method token keeps its string
    assert hf_tok.convert_tokens_to_ids("<mask>") == model.cfg.mask_token_id


@pytest.mark.slow
def test_generate_stops_at_the_first_eos(tmp_path):
  """Greedy `generate` with only the exported generation_config ends at EOS, well before
  max_new_tokens, and each token is paraflax's greedy choice (EOS included)."""
  model, tok, _ = load_trained(ROOT / "checkpoints" / "tiny_ar")
  hf_model, hf_tok = _load_hf(_export("tiny_ar", tmp_path / "hf"))
  prompt = hf_tok('if __name__ == "__main__":\n    unittest.main(', return_tensors="pt")
  out = hf_model.generate(**prompt, max_new_tokens=32, do_sample=False)[0].numpy()
  new = out[prompt["input_ids"].shape[1]:].tolist()
  assert new[-1] == tok.eos_id and tok.eos_id not in new[:-1] and 1 < len(new) < 32
  greedy = full_logits(model, out[None, :-1])[0, -len(new):].argmax(-1)
  assert greedy.tolist() == new


@pytest.mark.fast
def test_export_refuses_an_asarm_in_one_line(tmp_path, capsys):
  assert cli.main(["export", "--workdir", str(ROOT / "checkpoints" / "asarm"),
                   "--to-hf", str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no Hugging Face counterpart" in err
  assert not (tmp_path / "hf").exists()
