"""Checksum manifests (`paraflax.training.workdirs.checksums`): a digest is the file's size and crc32, and
`verify` names the first file that is missing, truncated or changed by a single bit."""

import os
import zlib

import pytest

from paraflax.training.workdirs.checksums import (
  ChecksumError,
  digest,
  file_digest,
  files_under,
  verify,
)


@pytest.mark.fast
def test_digest_is_size_and_crc32_of_the_whole_file_read_in_blocks(tmp_path):
  data = os.urandom((8 << 20) + 12345)  # more than one 8 MiB read
  (tmp_path / "big").write_bytes(data)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "empty").write_bytes(b"")
  assert file_digest(tmp_path / "big") == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
  assert files_under(tmp_path) == ["big", "sub/empty"]
  assert files_under(tmp_path, skip=("empty",)) == ["big"]
  files = digest(tmp_path, files_under(tmp_path))
  assert files["sub/empty"] == {"size": 0, "crc32": "00000000"}
  verify(tmp_path, files, "m.json")  # intact: no error


@pytest.mark.fast
def test_verify_names_a_flipped_bit_a_truncated_and_a_missing_file(tmp_path):
  for name in ("a", "b"):
    (tmp_path / name).write_bytes(bytes(range(256)) * 4)
  files = digest(tmp_path, ["a", "b"])
  raw = bytearray((tmp_path / "b").read_bytes())
  raw[700] ^= 0x04  # one bit, same size
  (tmp_path / "b").write_bytes(bytes(raw))
  with pytest.raises(ChecksumError,
                     match=rf"^{tmp_path / 'b'}: crc32 \w+, \w+ when saved .*m.json"):
    verify(tmp_path, files, "m.json")
  (tmp_path / "a").write_bytes(bytes(range(256)) * 3)
  with pytest.raises(ChecksumError, match=rf"^{tmp_path / 'a'}: 768 bytes, 1024 when saved "
                                          r"\(truncated"):
    verify(tmp_path, files, "m.json")
  (tmp_path / "a").unlink()
  with pytest.raises(ChecksumError, match=rf"^{tmp_path / 'a'}: missing \(listed in m.json\)"):
    verify(tmp_path, files, "m.json")
