"""`read_json`: a truncated or empty JSON file is one error line naming the file, wherever
paraflax reads one (a training workdir's config.json here; stores and HF dirs in their tests)."""

import pytest

from paraflax.json_io import read_json, write_json
from paraflax.training import load_trained


@pytest.mark.fast
def test_truncated_empty_and_missing_json_name_the_file(tmp_path):
  write_json(tmp_path / "ok.json", {"a": [1, 2]})
  assert read_json(tmp_path / "ok.json") == {"a": [1, 2]}
  text = (tmp_path / "ok.json").read_text()
  (tmp_path / "cut.json").write_text(text[:len(text) // 2])
  with pytest.raises(ValueError, match=rf"^{tmp_path / 'cut.json'}: not valid JSON, truncated"):
    read_json(tmp_path / "cut.json")
  (tmp_path / "empty.json").write_text("")
  with pytest.raises(ValueError, match=rf"^{tmp_path / 'empty.json'}: not valid JSON, empty"):
    read_json(tmp_path / "empty.json")
  with pytest.raises(FileNotFoundError, match="nope.json"):
    read_json(tmp_path / "nope.json")


@pytest.mark.fast
def test_load_trained_names_a_truncated_config_json(tmp_path):
  (tmp_path / "config.json").write_text('{"model": {"vocab_size": 3')
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(ValueError) as e:
    load_trained(tmp_path)
  assert str(e.value).startswith(f"{tmp_path / 'config.json'}: not valid JSON, truncated")
  assert "\n" not in str(e.value)
