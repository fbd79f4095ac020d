"""Read and write `.safetensors` files one tensor at a time, with plain file reads.

The format is an 8-byte little-endian header length, a JSON header mapping each name to
`{dtype, shape, data_offsets}` (offsets relative to the end of the header), then the bytes.
Reading with `readinto` rather than a memory map keeps the checkpoint's pages out of the
process's resident memory, so converting a checkpoint never holds it twice; bfloat16 comes
from `ml_dtypes` (a JAX dependency), which numpy-based readers lack.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in DTYPES.items()}
FLOATS = ("F64", "F32", "F16", "BF16")


class TensorInfo(NamedTuple):
  """Where one tensor lives: file, dtype, shape and absolute byte range."""

  file: Path
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int
  end: int


def read_header(file: str | os.PathLike) -> dict[str, TensorInfo]:
  """Name -> TensorInfo for every tensor in `file` (reads only the header).

  Checks what a file without checksums allows: a JSON header of known dtypes and
  non-negative shapes, each tensor's byte range the size of its shape, the ranges contiguous
  from the end of the header, and the file ending where the last one does (a truncated or
  appended-to file, or a flipped bit in an offset, is refused naming the tensor).
  """
  file = Path(file)
  size = file.stat().st_size
  with open(file, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{file}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
      raise ValueError(f"{file}: not a safetensors file (header length {n} > file size)")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{file}: the safetensors header is not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{file}: the safetensors header is not a JSON object")
  out = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      code, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
      raise ValueError(f"{file}: tensor {name!r} has a malformed header entry") from None
    if code not in DTYPES:
      raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {code}")
    if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(
        isinstance(o, int) for o in (start, end)):
      raise ValueError(f"{file}: tensor {name!r} has a malformed shape or byte range")
    info = TensorInfo(file, DTYPES[code], tuple(shape), 8 + n + start, 8 + n + end)
    if info.end - info.start != info.dtype.itemsize * int(np.prod(info.shape, dtype=np.int64)):
      raise ValueError(f"{file}: tensor {name!r} has an inconsistent byte range ({start}..{end} "
                       f"for {code}{list(shape)})")
    out[name] = info
  at = 8 + n  # the tensors tile the data section in offset order, with no gap or overlap
  for name, info in sorted(out.items(), key=lambda kv: (kv[1].start, kv[1].end)):
    if info.start != at:
      raise ValueError(f"{file}: tensor {name!r} starts at byte {info.start - 8 - n} of the "
                       f"data, expected {at - 8 - n} (overlapping or non-contiguous offsets)")
    at = info.end
  if at != size:
    raise ValueError(f"{file}: {size} bytes, but its header ends the data at byte {at} "
                     f"({'truncated' if size < at else 'trailing bytes'})")
  return out


def is_float(dtype: np.dtype) -> bool:
  return _CODES.get(np.dtype(dtype)) in FLOATS


def read_tensor(f: BinaryIO, info: TensorInfo) -> np.ndarray:
  """The tensor `info` from the open file `f`, in a fresh array (no memory map)."""
  out = np.empty(info.shape, info.dtype)
  f.seek(info.start)
  got = f.readinto(out.reshape(-1).view(np.uint8))
  if got != info.end - info.start:
    raise ValueError(f"{info.file}: truncated tensor data ({got} of {info.end - info.start} "
                     "bytes)")
  return out


def write_safetensors(file: str | os.PathLike,
                      tensors: Iterable[tuple[str, tuple[int, ...], np.dtype,
                                              Callable[[], np.ndarray]]],
                      metadata: dict[str, str] | None = None) -> None:
  """Write `(name, shape, dtype, produce)` tensors, calling `produce()` one at a time."""
  tensors = list(tensors)
  header: dict = {"__metadata__": metadata or {"format": "pt"}}
  offset = 0
  for name, shape, dtype, _ in tensors:
    nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
    header[name] = {"dtype": _CODES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the format asks
  file = Path(file)
  tmp = file.with_name(file.name + f".tmp{os.getpid()}")
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, shape, dtype, produce in tensors:
      x = np.ascontiguousarray(produce())
      if x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
        raise ValueError(f"tensor {name!r}: produced {x.dtype}{list(x.shape)}, declared "
                         f"{np.dtype(dtype)}{list(shape)}")
      f.write(x.reshape(-1).view(np.uint8).data)
  os.replace(tmp, file)
