"""JSONL records for training: chat records, many files and globs, skipped bad lines; response-
only loss masks (exactly the reply and its end token) under a chat template; the jsonl source's
deterministic split and `loss_mask` batches, packed with their tokens."""

import gzip
import json
import re

import numpy as np
import pytest
import tokenizers

from paraflax.data.chat import ChatTemplate
from paraflax.data.corpus import split_of
from paraflax.data.jsonl import ChatRecord, PairRecord, TextRecord, parse_record, read_records
from paraflax.data.pipeline import DataConfig
from paraflax.data.records import RecordEncoder, encode_records, split_key
from paraflax.data.source import batch_shapes, get_source
from paraflax.data.tokenizer import Tokenizer

QWENISH = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["system", "user", "assistant", "hi", "yo", "how", "are", "you", "fine", "thanks",
         "be", "brief", "one", "two"]
CHAT = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                     {"role": "user", "content": "how are you"},
                     {"role": "assistant", "content": "fine thanks"}]}


def _write(path, records):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


@pytest.fixture(scope="module")
def tok():
  """A word-level tokenizer with Qwen-like turn tokens; EOS is "<|im_end|>", BOS "<s>"."""
  specials = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]
  vocab = {w: i for i, w in enumerate(specials + WORDS + ["<unk>"])}
  hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  hf.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  hf.add_special_tokens(specials)
  t = Tokenizer(hf, special_tokens={"pad": "<pad>", "eos": "<|im_end|>"},
                encode_special_tokens=False)
  t.bos_id = vocab["<s>"]
  return t


@pytest.mark.fast
def test_chat_records_globs_and_skipped_lines(tmp_path):
  _write(tmp_path / "a.jsonl", [CHAT, {"text": "one"}])
  with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
    f.write(json.dumps({"prompt": "hi", "response": "yo"}) + "\n")
  records = read_records([str(tmp_path / "*.jsonl*")])
  assert records[0] == ChatRecord(tuple((m["role"], m["content"]) for m in CHAT["messages"]))
  assert records[1:] == [TextRecord("one"), PairRecord("hi", "yo")]
  assert read_records(tmp_path) == records  # a directory: its .jsonl and .jsonl.gz files
  bad = _write(tmp_path / "bad.jsonl", [CHAT, "{oops", {"messages": []}, {"text": "two"},
                                        {"messages": [{"role": "user", "content": "hi"}]}])
  with pytest.raises(ValueError, match=f"{bad}:2: malformed JSON"):
    read_records([bad])
  with pytest.warns(UserWarning, match=f"skipped 3 bad JSONL lines \\(the first: {bad}:2:"):
    kept = read_records([bad], skip_bad_lines=True)
  assert kept == [records[0], TextRecord("two")]
  for record, match in (({"messages": []}, "non-empty list"),
                        ({"messages": [{"role": "tool", "content": "x"}]}, "message 0 must be"),
                        ({"messages": [{"role": "user", "content": "hi"}]},
                         "last message must be the assistant's"),
                        ({"messages": [], "text": "x"}, "both 'text' and 'messages'")):
    one = _write(tmp_path / "one.jsonl", [CHAT, record])
    with pytest.raises(ValueError, match=f"{one}:2: .*{match}"):
      read_records([one])
  with pytest.raises(FileNotFoundError, match="no JSONL file matches"):
    read_records([str(tmp_path / "*.nope")])


@pytest.mark.fast
def test_response_masks_cover_exactly_the_reply_and_its_end(tok):
  template = ChatTemplate(QWENISH)
  enc = RecordEncoder(tok, template)
  chat = ChatRecord(tuple((m["role"], m["content"]) for m in CHAT["messages"]))
  [(ids, mask)] = enc.encode_many([chat])
  prompt = tok.encode(template.render(chat.as_dicts(-1), add_generation_prompt=True))
  reply = [tok.backend.token_to_id(w) for w in ("fine", "thanks", "<|im_end|>")]
  assert ids.tolist() == prompt + reply  # "<|im_end|>" is the EOS: no second one
  assert mask.tolist() == [0] * len(prompt) + [1] * 3
  # a pair goes through the template as a user/assistant exchange ("auto"); plain with "no"
  pair = PairRecord("how are you", "fine")
  [(ids, mask)] = enc.encode_many([pair])
  assert tok.decode(ids[mask == 1]) == "fine <|im_end|>" and ids[0] == tok.backend.token_to_id(
      "<|im_start|>")
  [(ids, mask)] = RecordEncoder(tok, template, chat="no").encode_many([pair])
  assert ids.tolist() == [tok.bos_id] + tok.encode("how are you fine") + [tok.eos_id]
  assert mask.tolist() == [0, 0, 0, 0, 1, 1]
  [(ids, mask)] = RecordEncoder(tok, template, loss_on="all").encode_many([chat, pair])[:1]
  assert mask.all()
  [(ids, mask)] = enc.encode_many([TextRecord("one two")])
  assert ids.tolist() == [tok.bos_id] + tok.encode("one two") + [tok.eos_id] and mask.all()
  with pytest.raises(ValueError, match="need a chat template"):
    RecordEncoder(tok).encode_many([chat])
  tokens, masks = encode_records([chat, pair], enc, progress=False)
  assert len(tokens) == len(masks) and tokens.dtype == np.int32


def _source_cfg(tmp_path, seq_len=8, **kw):
  return DataConfig(seq_len=seq_len, batch_size=2, cache_dir=str(tmp_path / "cache"), progress=False,
                    vocab_size=300, **kw)


@pytest.mark.fast
def test_jsonl_source_split_masks_and_packing(tmp_path):
  records = [{"prompt": f"q{i} ", "response": f"a{i} " * 3} for i in range(60)]
  records += [{"text": f"t{i} x y"} for i in range(20)]
  _write(tmp_path / "d.jsonl", records)
  data = _source_cfg(tmp_path)
  src = get_source("jsonl", {"paths": str(tmp_path / "d.jsonl"), "val_fraction": 0.25})
  assert src.paths == (str(tmp_path / "d.jsonl"),)
  assert set(batch_shapes(src, data)) == {"tokens", "loss_mask"}
  opened = src.open(data, progress=False)
  again = src.open(data, progress=False)
  first = next(opened.train)
  assert first["loss_mask"].shape == first["tokens"].shape == (2, 8)
  np.testing.assert_array_equal(first["tokens"], next(again.train)["tokens"])
  val = np.concatenate([b["tokens"].ravel() for b in opened.validation])
  mask = np.concatenate([b["loss_mask"].ravel() for b in opened.validation])
  tok = opened.tokenizer
  # the targets of a packed pair are its response and EOS; its prompt never is a target
  text = tok.decode(val[mask == 1])
  assert "q" not in text and "a" in text
  assert set(val[mask == 0]) - {tok.eos_id} and tok.eos_id in set(val[mask == 1])
  # the split is a stable hash of each record: the same in any file order, on any run
  held = {json.dumps(r) for r in records
          if split_of(split_key(parse_record(r, "")), 0.25) == "validation"}
  assert 0 < len(held) < len(records)
  for a, b in zip(opened.validation, again.validation):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
  all_on = get_source("jsonl", {"paths": [str(tmp_path / "d.jsonl")], "loss_on": "all",
                                "val_fraction": 0.25}).open(data, progress=False)
  assert all(b["loss_mask"].all() for b in all_on.validation)
  # a split too small names the JSONL source's own field (data.val_fraction is the corpus's)
  for fraction, cfg, says in ((0.25, _source_cfg(tmp_path, seq_len=200),
                               "fewer than one batch of 2: raise data_source_args.val_fraction"),
                              (0.001, data, "leave no validation documents at "
                               "data_source_args.val_fraction=0.001")):
    with pytest.raises(ValueError, match=re.escape(says)):
      get_source("jsonl", {"paths": str(tmp_path / "d.jsonl"),
                           "val_fraction": fraction}).open(cfg, progress=False)


@pytest.mark.fast
def test_chat_records_need_a_template_and_bad_arguments_are_named(tmp_path):
  _write(tmp_path / "c.jsonl", [CHAT] * 40)
  with pytest.raises(ValueError, match="need a chat template"):
    get_source("jsonl", {"paths": [str(tmp_path / "c.jsonl")], "val_fraction": 0.5}).open(
        _source_cfg(tmp_path), progress=False)
  with pytest.raises(ValueError, match="loss_on must be one of"):
    get_source("jsonl", {"paths": ["x"], "loss_on": "prompt"})
  with pytest.raises(ValueError, match="chat must be one of"):
    get_source("jsonl", {"paths": ["x"], "chat": "maybe"})
  assert get_source("jsonl", {"path": "old.jsonl"}).files == ("old.jsonl",)


def test_the_trainer_trains_on_loss_masked_records(tmp_path):
  import dataclasses

  from paraflax.training import load_config, train
  cfg = load_config("micro_ar")
  _write(tmp_path / "d.jsonl", [{"prompt": f"q{i} ", "response": f"a{i} " * 3}
                                for i in range(80)])
  cfg = dataclasses.replace(
      cfg, data_source="jsonl", data_source_args={"paths": [str(tmp_path / "*.jsonl")],
                                                  "val_fraction": 0.3},
      data=_source_cfg(tmp_path, seq_len=16), steps=2, eval_every=2, eval_batches=1,
      checkpoint_every=2, log_every=1)
  summary = train(cfg, tmp_path / "run", progress=False)
  assert summary["step"] == 2 and np.isfinite(summary["val_loss"])
