"""Corpus: deterministic, file-disjoint split; bad files skipped, not fatal."""

import pytest

from paraflax.data import corpus


def _write(root, rel, data: bytes):
  path = root / rel
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)


@pytest.fixture
def tree(tmp_path):
  root = tmp_path / "lib"
  for i in range(40):
    _write(root, f"pkg{i % 4}/mod{i}.py", f"x = {i}\n".encode())
  _write(root, "latin1.py", "s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8
  _write(root, "empty.py", b"")
  _write(root, "blank.py", b"  \n\n")
  _write(root, "test/test_x.py", b"assert True\n")
  _write(root, "idlelib/idle_test/t.py", b"assert True\n")
  _write(root, "site-packages/thirdparty.py", b"import x\n")
  _write(root, "notes.txt", b"not python\n")
  return root


@pytest.mark.fast
def test_split_is_disjoint_complete_and_deterministic(tree):
  train = corpus.load_documents("train", 0.25, root=tree)
  val = corpus.load_documents("validation", 0.25, root=tree)
  train_paths, val_paths = {d.path for d in train}, {d.path for d in val}
  assert not train_paths & val_paths
  assert train_paths | val_paths == {f"pkg{i % 4}/mod{i}.py" for i in range(40)}
  assert val_paths and train_paths
  assert [d.path for d in train] == sorted(train_paths)
  assert corpus.load_documents("train", 0.25, root=tree) == train
  assert all(corpus.split_of(p, 0.25) == "validation" for p in val_paths)


@pytest.mark.fast
def test_non_utf8_empty_and_excluded_files_are_skipped(tree):
  paths = {d.path for s in corpus.SPLITS for d in corpus.load_documents(s, 0.5, root=tree)}
  for skipped in [
    "latin1.py",
    "empty.py",
    "blank.py",
    "test/test_x.py",
    "idlelib/idle_test/t.py",
    "site-packages/thirdparty.py",
    "notes.txt",
  ]:
    assert skipped not in paths


@pytest.mark.fast
def test_max_files_is_a_deterministic_subset(tree):
  full = corpus.load_documents("train", 0.1, root=tree)
  sub = corpus.load_documents("train", 0.1, max_files=7, root=tree)
  assert len(sub) == 7 and set(sub) <= set(full)
  assert sub == corpus.load_documents("train", 0.1, max_files=7, root=tree)


@pytest.mark.fast
def test_bad_arguments_raise_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a directory"):
    corpus.load_documents(root=tmp_path / "missing")
  with pytest.raises(ValueError, match="split"):
    corpus.load_documents("dev", root=tmp_path)
  with pytest.raises(ValueError, match="val_fraction"):
    corpus.load_documents("train", 1.0, root=tmp_path)
  with pytest.raises(ValueError, match="max_files"):
    corpus.load_documents("train", max_files=0, root=tmp_path)


@pytest.mark.fast
def test_stdlib_split_is_disjoint_and_excludes_tests():
  train = corpus.load_documents("train")
  val = corpus.load_documents("validation")
  train_paths, val_paths = {d.path for d in train}, {d.path for d in val}
  assert len(train) > 300 and len(val) > 5
  assert not train_paths & val_paths
  for p in train_paths | val_paths:
    parts = p.split("/")
    assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts[:-1])
  assert "os.py" in train_paths | val_paths
  assert corpus.stdlib_documents("validation") == [d.text for d in val]


@pytest.mark.fast
def test_heldout_prompts_are_fixed_length_validation_prefixes():
  val_texts = corpus.stdlib_documents("validation")
  prompts = corpus.heldout_prompts(8, prefix_chars=200)
  assert len(prompts) == 8 and all(len(p) == 200 for p in prompts)
  assert all(any(t.startswith(p) for t in val_texts) for p in prompts)
  assert prompts == corpus.heldout_prompts(8, prefix_chars=200)
  with pytest.raises(ValueError, match="held-out prompts"):
    corpus.heldout_prompts(10_000)
