"""`paraflax export` writes a complete Hugging Face directory for every model with a counterpart:
transformers' AutoModelForCausalLM + AutoTokenizer load it with paraflax's logits and token ids,
the configs name the tokenizer's EOS/PAD, and `generate` stops at EOS. AS-ARMs are refused.
The export never writes over what a user owns, and appears whole or not at all."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paraflax import cli, destination
from paraflax.hf import auto_tokenizer, export
from paraflax.training import load_trained
from conftest import full_logits, reference_libs

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
  assert auto_tokenizer.differences(hf_tok, tok, auto_tokenizer.probe_texts(tok)) is None
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


# ---- nothing a user owns is overwritten; an export appears whole or not at all -------------

def _one_line_error(capsys, argv) -> str:
  assert cli.main(argv) == 2, argv
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("paraflax export: error:"), err
  return err


def _files(path: Path) -> dict:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
          if p.is_file()}


@pytest.mark.fast
def test_export_writes_over_nothing_a_user_owns(tmp_path, capsys):
  """The workdir itself, a directory inside it, a file, a non-empty directory without
  --overwrite, and even with it a directory holding a store or the model's own directory are
  refused in one line before anything is written; --overwrite replaces an earlier export
  whole (its stale files gone)."""
  work = shutil.copytree(ROOT / "checkpoints" / "ar_drafter", tmp_path / "W")
  before = _files(work)
  argv = lambda out, *flags: ["export", "--workdir", str(work), "--to-hf", str(out), *flags]
  (tmp_path / "file").write_text("x")
  store = tmp_path / "outer" / "store"
  store.mkdir(parents=True)
  (store / "meta.json").write_text('{"answer_len": 8, "examples": 2, "batch_size": 2}')
  (store / "progress.json").write_text('{"batches": 0}')
  for out, flags, says in [
      (work, ["--overwrite"], "it is a paraflax workdir"),
      (work / "hf", ["--overwrite"], f"it lies inside {str(work)!r}, a paraflax workdir"),
      (tmp_path / "file", [], "is a file"),
      (tmp_path / "outer", [], "is not empty (other files): pass --overwrite"),
      (tmp_path / "outer", ["--overwrite"], f"it contains {str(store)!r}, a teacher store"),
      (tmp_path, ["--overwrite"], "it contains the model's own source directory")]:
    assert says in _one_line_error(capsys, argv(out, *flags)), (out, flags)
  assert _files(work) == before and (tmp_path / "file").read_text() == "x"
  old = tmp_path / "old"
  assert cli.main(argv(old)) == 0
  (old / "model.safetensors.index.json").write_text("{}")  # would shadow the new weights
  assert "is not empty (Hugging Face directory)" in _one_line_error(capsys, argv(old))
  assert "it is the model's own source directory" in _one_line_error(
      capsys, ["export", "--hf", str(old), "--to-hf", str(old), "--overwrite"])
  assert cli.main(argv(old, "--overwrite")) == 0
  assert not (old / "model.safetensors.index.json").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["W", "file", "old", "outer"]


@pytest.mark.fast
@pytest.mark.parametrize("stage", ["writing", "written", "moved aside"])
def test_a_failed_export_leaves_the_destination_absent_or_old(tmp_path, monkeypatch, stage):
  """An error or Ctrl-C at any point of an export (mid-write, before or between the renames)
  leaves no destination (a new one) or the old one byte for byte (with --overwrite), and
  nothing beside it."""
  model, tok, _ = load_trained(ROOT / "checkpoints" / "ar_drafter")
  out = export.export_hf(model, tmp_path / "out", tok)
  old = _files(out)

  def fail(at):
    if at == stage:
      raise KeyboardInterrupt
  monkeypatch.setattr(destination, "fault", fail)
  if stage == "writing":  # after the weights, before the tokenizer files
    monkeypatch.setattr(export, "write_tokenizer_files", lambda *a, **k: fail("writing"))
  for dest, overwrite in ((tmp_path / "new", False), (out, True)):
    with pytest.raises(KeyboardInterrupt):
      export.export_hf(model, dest, tok, overwrite=overwrite)
  assert not (tmp_path / "new").exists() and _files(out) == old
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_KILLED = """
import importlib.util, os, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("destination", sys.argv[1])
destination = importlib.util.module_from_spec(spec)
spec.loader.exec_module(destination)
destination.fault = lambda at: os._exit(9) if at == sys.argv[3] else None
with destination.replacing(Path(sys.argv[2])) as new:
  (new / "weights").write_text("new")
"""


@pytest.mark.fast
@pytest.mark.parametrize("stage, left", [
    ("written", {"out": "old", "out.paraflax-new-PID": "new"}),
    ("moved aside", {"out.paraflax-old-PID": "old", "out.paraflax-new-PID": "new"}),
    ("never", {"out": "new"})])
def test_a_killed_swap_leaves_the_destination_old_absent_or_complete(tmp_path, stage, left):
  """A process killed during `destination.replacing` (the swap of every export and convert)
  leaves the destination old, absent or complete, and the rest where the docs say: the
  complete new directory in OUT.paraflax-new-PID, the old one in OUT.paraflax-old-PID."""
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "weights").write_text("old")
  proc = subprocess.run([sys.executable, "-c", _KILLED, destination.__file__,
                         str(tmp_path / "out"), stage], check=False)
  assert proc.returncode == (0 if stage == "never" else 9)
  found = {re.sub(r"-\d+$", "-PID", p.name): (p / "weights").read_text()
           for p in tmp_path.iterdir()}
  assert found == left
