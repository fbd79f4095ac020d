"""The tensorstore stores behind trajectories and teacher answers (`training/stores/store.py`): each
batch's chunk files get checksums as they are written, `read_store` refuses a shard with a
flipped bit naming it, a store filled in two sittings verifies, a store without checksums
(made before them) reads with a warning, and a truncated progress.json names the file."""

import json
import re
import warnings

import numpy as np
import pytest

from paraflax.training.stores import store
from paraflax.training.workdirs.checksums import ChecksumError, ChecksumWarning
from conftest import StubTokenizer

META = {"examples": 10, "batch_size": 4}
SHAPES = {"rows": ((10, 3), (4, 3)), "lens": ((10,), (4,))}



def _make(i, lo, hi):
  return {"rows": np.full((hi - lo, 3), i + 1, np.int32), "lens": np.arange(lo, hi, dtype=np.int32)}


def _fill(out, stop_at=None):
  def make(i, lo, hi):
    if i == stop_at:
      raise KeyboardInterrupt  # the process dies before writing batch `stop_at`
    return _make(i, lo, hi)
  arrays, done = store.open_store(out, META, SHAPES, StubTokenizer(), what="test store")
  store.fill(out, arrays, META, done, make, desc="test", progress=False)
  return out


def _read(out):
  return store.read_store(out, SHAPES, what="test store", command="make-it")[1]


@pytest.mark.fast
def test_a_store_filled_in_two_sittings_verifies_and_a_flipped_bit_is_named(tmp_path):
  out = tmp_path / "s"
  with pytest.raises(KeyboardInterrupt):
    _fill(out, stop_at=2)
  _fill(out)  # resumes at batch 2
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # verified: no warning
    arrays = _read(out)
  np.testing.assert_array_equal(arrays["lens"], np.arange(10))
  np.testing.assert_array_equal(arrays["rows"][:, 0], [1] * 4 + [2] * 4 + [3] * 2)
  shard = out / "rows" / "1.0"  # batch 1 of `rows`
  raw = bytearray(shard.read_bytes())
  raw[-1] ^= 0x01
  shard.write_bytes(bytes(raw))
  with pytest.raises(ChecksumError, match=rf"^{shard}: crc32 .* when saved"):
    _read(out)


@pytest.mark.fast
def test_a_store_without_checksums_reads_with_a_warning(tmp_path):
  out = _fill(tmp_path / "s")
  (out / store.CHECKSUMS).unlink()
  with pytest.warns(ChecksumWarning, match="has no checksums"):
    assert _read(out)["lens"].tolist() == list(range(10))


@pytest.mark.fast
def test_a_truncated_progress_json_names_the_file(tmp_path):
  out = _fill(tmp_path / "s")
  (out / store.PROGRESS).write_text('{"batc')
  with pytest.raises(ValueError, match=rf"^{out / store.PROGRESS}: not valid JSON, truncated"):
    _read(out)
  with pytest.raises(ValueError, match=rf"^{out / store.PROGRESS}: not valid JSON"):
    _fill(out)  # resuming reads it too


@pytest.mark.fast
def test_meta_and_progress_of_another_shape_name_the_file_and_the_field(tmp_path):
  """Valid JSON of the wrong shape in a store's meta.json or progress.json: one ValueError
  line naming the file and the field, when reading the store and when resuming it."""
  out = _fill(tmp_path / "s")
  for name, value, says in [
      (store.PROGRESS, {}, "missing field 'batches'"),
      (store.PROGRESS, {"batches": "2"}, "field 'batches' must be an int >= 0, got \"2\""),
      (store.PROGRESS, [3], "expected a JSON object, got list [3]"),
      (store.META, {"examples": 10}, "missing field 'batch_size'"),
      (store.META, {**META, "examples": 0}, "field 'examples' must be an int >= 1, got 0")]:
    kept = (out / name).read_text()
    (out / name).write_text(json.dumps(value))
    for use in (_read, _fill):
      with pytest.raises(ValueError, match=f"^{re.escape(f'{out / name}: {says}')}$"):
        use(out)
    (out / name).write_text(kept)
  (out / store.META).write_text(json.dumps({**META, "max_prompt_len": 8, "block_size": 4}))
  with pytest.raises(ValueError, match=r"meta.json: missing field 'num_blocks'$"):
    store.read_meta(out, what="trajectory store", command="collect-trajectories")
