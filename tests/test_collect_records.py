"""Collection from JSONL records: `teacher-data` / `collect-trajectories --hf DIR --data FILE`
store each record's own prompt (a pair's prompt and a chat's messages before its reply under
the model's chat template, cut to their last max_prompt_len tokens, too-short ones skipped and
counted), at most `examples` of them, each once, with the model's tokenizer; an HF model
without --data is a one-line error. And the jsonl training source encoding with that model's
tokenizer and chat template (`data.tokenizer`)."""

import dataclasses
import json

import numpy as np
import pytest
from test_cli_generate import hf_dir  # noqa: F401 (a tiny random Qwen2 dir, a chat template)

from paraflax import cli
from paraflax.data.chat import ChatTemplate
from paraflax.data.jsonl import read_records
from paraflax.data.records import RecordEncoder
from paraflax.data.tokenizer import Tokenizer
from paraflax.hf import load_hf_tokenizer
from paraflax.training.stores import teacher, trajectories
from paraflax.training.stores.store import TOKENIZER, FewerExamples, record_prompts

RECORDS = [
    {"prompt": "def add(a, b):\n", "response": "    return a + b\n"},
    {"messages": [{"role": "user", "content": "import os"},
                  {"role": "assistant", "content": "import sys"}]},
    {"messages": [{"role": "system", "content": "x = 1"},
                  {"role": "user", "content": "print(" * 20},
                  {"role": "assistant", "content": ")"}]},
    {"text": "x"},  # a text record: a prefix of 3..24 tokens, but it has 1: skipped
]
MAX_P = 24


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")


def _data(tmp_path):
  (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:2]))
  (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[2:]))
  return ["--data", str(tmp_path / "a.jsonl"), "--data", str(tmp_path / "b.jsonl")]


def _summary(capsys, *argv) -> tuple[dict, list[str]]:
  """The command's JSON summary and its warning lines about the examples."""
  assert cli.main(list(argv)) == 0
  out, err = capsys.readouterr()
  return (json.loads(out.strip().splitlines()[-1]),
          [line for line in err.splitlines() if ": warning: " in line and "asked" in line])


@pytest.mark.fast
def test_record_prompts_cut_skip_cap_and_order():
  cfg = teacher.TeacherConfig(examples=3, min_prompt_len=2, max_prompt_len=4, seed=1)
  ids = [[1, 2, 3, 4, 5, 6], [7], [8, 9], [10, 11, 12], [13, 14, 15, 16]]
  p = record_prompts(ids, cfg)
  rows = [tuple(r[:n]) for r, n in zip(p.tokens.tolist(), p.lengths)]
  assert len(rows) == 3 and len(set(rows)) == 3
  assert set(rows) <= {(3, 4, 5, 6), (8, 9), (10, 11, 12), (13, 14, 15, 16)}  # the last 4 kept
  assert p.counts["records"] == 5 and p.counts["prompts_too_short"] == 1
  again = record_prompts(ids, cfg)
  np.testing.assert_array_equal(again.tokens, p.tokens)
  assert again.meta == p.meta  # a digest of the prompts: a changed file is not resumed
  with pytest.warns(FewerExamples, match="give 4 usable prompts: the store holds 4 examples, "
                    "not the 99 asked"):  # said, not quietly fewer
    every = record_prompts(ids, dataclasses.replace(cfg, examples=99))
  assert len(every.lengths) == 4  # fewer records than examples: all of them, once each
  text = record_prompts([list(range(1, 30))], dataclasses.replace(cfg, examples=1),
                        prefix=[True])
  assert 2 <= text.lengths[0] <= 4 and text.tokens[0, 0] == 1  # a text record: its beginning


@pytest.mark.fast
def test_teacher_data_and_trajectories_from_records(hf_dir, tmp_path, capsys):
  tok = load_hf_tokenizer(hf_dir)
  enc = RecordEncoder(tok, ChatTemplate.of(hf_dir))
  flags = _data(tmp_path)
  want = {tuple(enc.prompt_ids(r)[-MAX_P:]) for r in read_records(flags[1::2])}
  want = {w for w in want if len(w) >= 3}
  assert len(want) == 3
  out = tmp_path / "teacher"
  summary, warned = _summary(capsys, "teacher-data", "--hf", str(hf_dir), "--out", str(out),
                             *flags, "--examples", "10", "--answer-len", "3",
                             "--min-prompt-len", "3", "--max-prompt-len", str(MAX_P),
                             "--batch-size", "2")
  assert summary["examples"] == 3 and summary["records"] == 4
  assert warned == ["paraflax teacher-data: warning: the records give 3 usable prompts: the "
                    "store holds 3 examples, not the 10 asked (examples)"]
  assert summary["prompts_too_short"] == 1 and summary["prompts_cut_to_max"] == 1
  store = teacher.load(out)
  got = {tuple(r[:n]) for r, n in zip(store.prompts.tolist(), store.prompt_lens)}
  assert got == want and store.answers.shape == (3, 3)
  chat = tuple(tok.encode(ChatTemplate.of(hf_dir).render(
      [{"role": "user", "content": "import os"}], add_generation_prompt=True)))
  assert chat in got  # a chat's prompt: its messages before the reply, the reply's turn opened
  assert Tokenizer.load(out / TOKENIZER).fingerprint() == tok.fingerprint()
  assert store.meta["source"] == str(hf_dir) and len(store.meta["data"]) == 2
  out = tmp_path / "traj"
  summary, warned = _summary(capsys, "collect-trajectories", "--hf", str(hf_dir), "--out",
                             str(out), *flags, "--examples", "2", "--block-size", "2",
                             "--num-blocks", "1", "--min-prompt-len", "3", "--max-prompt-len",
                             str(MAX_P), "--batch-size", "2")
  assert summary["examples"] == 2 and warned == []
  traj = trajectories.load(out)
  assert {tuple(r[:n]) for r, n in zip(traj.prompts.tolist(), traj.prompt_lens)} < want


@pytest.mark.fast
def test_a_hf_model_needs_data(hf_dir, tmp_path, capsys):
  for command in ("teacher-data", "collect-trajectories"):
    assert cli.main([command, "--hf", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
    assert "a Hugging Face model has no training split: pass --data FILE.jsonl" in (
        capsys.readouterr().err)


@pytest.mark.fast
def test_jsonl_source_with_a_model_tokenizer_and_its_chat_template(hf_dir, tmp_path):
  from paraflax.data.pipeline import DataConfig
  from paraflax.data.source import get_source
  chat = {"messages": [{"role": "user", "content": "import os"},
                       {"role": "assistant", "content": "import sys"}]}
  records = [chat] + [{"prompt": f"x = {i}", "response": f"y = {i}"} for i in range(40)]
  (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  data = DataConfig(seq_len=16, batch_size=2, progress=False, cache_dir=str(tmp_path / "c"),
                    tokenizer=str(hf_dir), mask_token="<mask>")
  opened = get_source("jsonl", {"paths": [str(tmp_path / "*.jsonl")],
                                "val_fraction": 0.3}).open(data, progress=False)
  assert repr(str(hf_dir)) in opened.tokenizer_source and opened.tokenizer.mask_id == 2
  tok = load_hf_tokenizer(hf_dir)
  assert opened.tokenizer.fingerprint() == tok.fingerprint()
  rows = [b for b in opened.validation]
  tokens = np.concatenate([b["tokens"].ravel() for b in rows])
  mask = np.concatenate([b["loss_mask"].ravel() for b in rows])
  targets = tok.decode(tokens[mask == 1])
  assert "x =" not in targets and "y =" in targets and "<eos>" in targets  # replies, ends
  assert "<sep>assistant" in tok.decode(tokens[mask == 0])  # the template's prompt side


@pytest.mark.fast
def test_the_stdlib_source_encodes_with_data_tokenizer(hf_dir, tmp_path):
  from paraflax.data.pipeline import DataConfig
  from paraflax.data.source import get_source
  data = DataConfig(seq_len=16, batch_size=2, progress=False, cache_dir=str(tmp_path / "c"),
                    max_files=2, val_fraction=0.5, tokenizer=str(hf_dir))
  opened = get_source("stdlib").open(data, progress=False)
  assert repr(str(hf_dir)) in opened.tokenizer_source
  assert opened.tokenizer.fingerprint() == load_hf_tokenizer(hf_dir).fingerprint()
  assert set(next(opened.train)) == {"tokens"}


@pytest.mark.fast
def test_a_store_command_fills_only_a_new_empty_or_same_kind_directory(hf_dir, tmp_path, capsys):
  """Stores resume in their own directory, so `--out` must be new, empty or a store of the
  command's kind: the model's own directory, another kind's store or other files are refused
  in one line before the model loads, and nothing is written there (not even a lock)."""
  teacher_store, notes = tmp_path / "teacher", tmp_path / "notes"
  teacher_store.mkdir()
  (teacher_store / "meta.json").write_text('{"answer_len": 4}')
  (teacher_store / "progress.json").write_text('{"batches": 0}')
  notes.mkdir()
  (notes / "todo.txt").write_text("x")
  before = sorted(p.name for p in hf_dir.iterdir())
  for command, out, holds in [
      ("collect-trajectories", hf_dir, "a Hugging Face directory"),
      ("collect-trajectories", teacher_store, "a teacher store"),
      ("teacher-data", notes, "other files")]:
    assert cli.main([command, "--hf", str(hf_dir), "--out", str(out), *_data(tmp_path)]) == 2
    kind = command.split("-")[0].replace("collect", "trajectory")
    assert capsys.readouterr().err.strip() == (
        f"paraflax {command}: error: {str(out)!r} is not empty and is not a {kind} store (it "
        f"holds {holds}): name an empty or new directory for the {kind} store")
  assert sorted(p.name for p in hf_dir.iterdir()) == before
  assert sorted(p.name for p in teacher_store.iterdir()) == ["meta.json", "progress.json"]
