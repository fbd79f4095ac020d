"""Tokenizer: exact round trip, fixed special ids, save/load identity, caching."""

import json

import pytest

from paraflax.data import corpus
from paraflax.data.tokenizer import Tokenizer, load_or_train, train_tokenizer

TRICKY = [
  "",
  " ",
  "\t\t  \n\n\r\n   \x0b\x0c",
  "def f(x):\n\treturn x  # trailing   \n",
  "    leading spaces\n        deeper\n",
  "naïve café — 東京 😀 \u200b zero-width, combining e\u0301",
  "\x00\x01 control \x7f bytes",
  "literal <eos> <pad><mask> <sep> specials stay text",
  "a" * 500,
]


@pytest.fixture(scope="module")
def texts():
  return corpus.stdlib_documents("train", max_files=25)


@pytest.fixture(scope="module")
def tok(texts):
  return train_tokenizer(texts, vocab_size=400)


@pytest.mark.fast
def test_special_ids_are_fixed(tok):
  assert (tok.pad_id, tok.eos_id, tok.mask_id, tok.sep_id) == (0, 1, 2, 3)
  assert tok.vocab_size == 400
  assert tok.decode([tok.eos_id]) == "<eos>"
  assert tok.decode([5, tok.eos_id, 6], skip_special_tokens=True) == tok.decode([5, 6])


@pytest.mark.fast
def test_round_trip_is_exact(tok, texts):
  held_out = corpus.stdlib_documents("validation", max_files=5)
  for s in TRICKY + texts + held_out:
    ids = tok.encode(s)
    assert all(4 <= i < tok.vocab_size for i in ids)  # text never yields a special id
    assert tok.decode(ids) == s
  assert tok.encode_batch(TRICKY) == [tok.encode(s) for s in TRICKY]


@pytest.mark.fast
def test_save_load_gives_identical_encodings(tok, texts, tmp_path):
  path = tok.save(tmp_path / "my_tokenizer.json")
  loaded = Tokenizer.load(path)
  assert loaded.fingerprint() == tok.fingerprint()
  assert (loaded.pad_id, loaded.eos_id, loaded.mask_id, loaded.sep_id) == (0, 1, 2, 3)
  for s in TRICKY + texts[:5]:
    assert loaded.encode(s) == tok.encode(s)
  (tmp_path / "ckpt").mkdir()  # a directory means <dir>/tokenizer.json, both ways
  assert tok.save(tmp_path / "ckpt") == tmp_path / "ckpt" / "tokenizer.json"
  assert Tokenizer.from_file(tmp_path / "ckpt").fingerprint() == tok.fingerprint()


@pytest.mark.fast
def test_training_is_deterministic(tok, texts):
  assert train_tokenizer(texts, vocab_size=400).fingerprint() == tok.fingerprint()


@pytest.mark.fast
def test_load_or_train_caches(texts, tmp_path):
  calls = []

  def texts_fn():
    calls.append(1)
    return texts[:10]

  a = load_or_train(tmp_path, texts_fn, 300, name="unit")
  b = load_or_train(tmp_path, texts_fn, 300, name="unit")
  assert len(calls) == 1 and a.fingerprint() == b.fingerprint()
  assert (tmp_path / "tokenizer-unit-v300.json").is_file()


@pytest.mark.fast
def test_foreign_tokenizer_json_has_optional_specials(tok, tmp_path):
  # A checkpoint-style tokenizer whose EOS is "<|endoftext|>" and which has no <mask>.
  data = json.loads(tok.backend.to_str())
  data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in ("<pad>", "<eos>")]
  for t in data["added_tokens"]:
    if t["content"] == "<eos>":
      t["content"] = "<|endoftext|>"
  vocab = data["model"]["vocab"]
  vocab["<|endoftext|>"] = vocab.pop("<eos>")
  del vocab["<mask>"], vocab["<sep>"]
  path = tmp_path / "tokenizer.json"
  path.write_text(json.dumps(data))
  hf = Tokenizer.from_file(path, special_tokens={"eos": "<|endoftext|>"})
  assert (hf.pad_id, hf.eos_id, hf.mask_id, hf.sep_id) == (0, 1, None, None)
  assert hf.decode(hf.encode(TRICKY[5])) == TRICKY[5]


@pytest.mark.fast
def test_bad_inputs(tok, tmp_path):
  with pytest.raises(ValueError, match="vocab_size"):
    train_tokenizer(["abc"], vocab_size=100)
  with pytest.raises(FileNotFoundError, match="tokenizer file"):
    Tokenizer.from_file(tmp_path / "missing.json")
  (tmp_path / "junk.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a valid tokenizers JSON"):
    Tokenizer.from_file(tmp_path / "junk.json")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
