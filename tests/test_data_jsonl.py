"""JSONL user data: both record kinds load; bad lines are named by file and line."""

import gzip
import json

import pytest

from paraflax.data.jsonl import PairRecord, TextRecord, jsonl_documents, read_jsonl


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


@pytest.mark.fast
def test_both_record_kinds(tmp_path):
  path = _write(
    tmp_path / "d.jsonl",
    [
      json.dumps({"text": "def f():\n\treturn 1\n", "id": 7}),
      "",
      json.dumps({"prompt": "def g():\n", "response": "    return 'é'\n"}),
    ],
  )
  assert read_jsonl(path) == [
    TextRecord("def f():\n\treturn 1\n"),
    PairRecord("def g():\n", "    return 'é'\n"),
  ]
  assert jsonl_documents(path) == ["def f():\n\treturn 1\n", "def g():\n    return 'é'\n"]


@pytest.mark.fast
@pytest.mark.parametrize(
  "bad, message",
  [
    ('{"text": "ok"', "malformed JSON"),
    ('["text"]', "expected a JSON object"),
    ('{"prompt": "p"}', "expected key 'text' or both 'prompt' and 'response'"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"text": "a", "prompt": "b", "response": "c"}', "both 'text' and"),
  ],
)
def test_bad_line_error_names_file_and_line(tmp_path, bad, message):
  path = _write(tmp_path / "bad.jsonl", [json.dumps({"text": "fine"}), bad])
  with pytest.raises(ValueError, match=message) as err:
    read_jsonl(path)
  assert f"{path}:2:" in str(err.value)


@pytest.mark.fast
def test_missing_and_empty_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    read_jsonl(tmp_path / "nope.jsonl")
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="no records"):
    read_jsonl(tmp_path / "empty.jsonl")


@pytest.mark.fast
def test_a_cut_last_line_names_its_column_once(tmp_path):
  path = tmp_path / "cut.jsonl"
  path.write_text('{"text": "ok"}\n{"text": "cu')  # a writer killed mid-line
  with pytest.raises(ValueError) as err:
    read_jsonl(path)
  assert str(err.value) == f"{path}:2: malformed JSON (Unterminated string starting at column 10)"


@pytest.mark.fast
def test_invalid_utf8_names_file_line_and_column(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
  with pytest.raises(ValueError, match="invalid UTF-8") as err:
    read_jsonl(path)
  assert str(err.value) == f"{path}:2: invalid UTF-8 (byte 0xe9 at column 14)"


@pytest.mark.fast
def test_gzip_files_load_and_corrupt_ones_name_file_and_line(tmp_path):
  lines = [json.dumps({"text": f"doc {i} " + "x" * 200}) for i in range(400)]
  good = tmp_path / "d.jsonl.gz"
  good.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
  assert jsonl_documents(good) == [json.loads(line)["text"] for line in lines]
  data = good.read_bytes()
  truncated = tmp_path / "truncated.jsonl.gz"
  truncated.write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"^{truncated}:[0-9]+: corrupt gzip data"):
    read_jsonl(truncated)
  not_gzip = tmp_path / "plain.jsonl.gz"
  not_gzip.write_text(lines[0] + "\n")
  with pytest.raises(ValueError, match=f"^{not_gzip}:1: corrupt gzip data"):
    read_jsonl(not_gzip)


@pytest.mark.fast
def test_duplicate_keys_are_refused_naming_file_line_and_key(tmp_path):
  path = _write(tmp_path / "dup.jsonl", [json.dumps({"text": "a"}),
                                         '{"prompt": "p", "response": "r", "prompt": "q"}'])
  with pytest.raises(ValueError) as err:
    read_jsonl(path)
  assert str(err.value) == f"{path}:2: duplicate key 'prompt' in a JSON object"
  nested = _write(tmp_path / "nested.jsonl", ['{"text": "a", "meta": {"id": 1, "id": 2}}'])
  with pytest.raises(ValueError, match=f"{nested}:1: duplicate key 'id'"):
    read_jsonl(nested)
