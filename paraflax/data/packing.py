"""Documents -> one token stream (EOS after every document) -> fixed-length rows.

    stream = encode(doc_0) + [eos] + encode(doc_1) + [eos] + ...     # int32 [N]
    rows   = stream[: (N // L) * L].reshape(-1, L)                     # int32 [N // L, L]

Packing is lossless except for the tail: the last `N % L` (< L) tokens of a stream are
dropped, once per stream (not per epoch). Rows may start and end mid-document; the
EOS tokens mark the boundaries.

The stream is cached as `.npy` under a key made of the tokenizer's fingerprint and
the documents' content, so a second run with the same corpus and tokenizer is a load.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from paraflax.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 64  # documents per encode_batch call (granularity of the progress bar)


def stream_key(docs: Sequence[str], tokenizer: Tokenizer) -> str:
  """Cache key: sha1 over the tokenizer and every document (length-prefixed)."""
  h = hashlib.sha1(b"paraflax-stream-v1\0")
  h.update(tokenizer.fingerprint().encode())
  for doc in docs:
    data = doc.encode("utf-8")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
  return h.hexdigest()


def encode_documents(
  docs: Sequence[str], tokenizer: Tokenizer, *, progress: bool = True, desc: str = "tokenizing"
) -> np.ndarray:
  """The token stream of `docs`, EOS after each one. int32 [N]."""
  if tokenizer.eos_id is None:
    raise ValueError("tokenizer has no EOS token; packing needs one to separate documents")
  if not docs:
    raise ValueError("no documents to tokenize")
  parts = []
  eos = np.array([tokenizer.eos_id], np.int32)
  with tqdm(total=len(docs), desc=desc, unit="doc", disable=not progress) as bar:
    for start in range(0, len(docs), _ENCODE_CHUNK):
      chunk = docs[start : start + _ENCODE_CHUNK]
      for ids in tokenizer.encode_batch(chunk):
        parts.append(np.asarray(ids, np.int32))
        parts.append(eos)
      bar.update(len(chunk))
  return np.concatenate(parts)


def token_stream(
  docs: Sequence[str],
  tokenizer: Tokenizer,
  cache_dir: str | os.PathLike | None = None,
  *,
  progress: bool = True,
  desc: str = "tokenizing",
) -> np.ndarray:
  """`encode_documents`, cached as `<cache_dir>/tokens-<key>.npy` when cache_dir is set.

  A cached stream is memory-mapped read-only. int32 [N].
  """
  if cache_dir is None:
    return encode_documents(docs, tokenizer, progress=progress, desc=desc)
  path = Path(cache_dir).expanduser() / f"tokens-{stream_key(docs, tokenizer)}.npy"
  if not path.is_file():
    stream = encode_documents(docs, tokenizer, progress=progress, desc=desc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.npy")
    np.save(tmp, stream)
    os.replace(tmp, path)  # atomic: a killed run never leaves a truncated cache
  return np.load(path, mmap_mode="r")


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """Consecutive rows of `seq_len` tokens; the final partial row is dropped. [N // L, L]."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  stream = np.asarray(stream)
  if stream.ndim != 1:
    raise ValueError(f"stream must be 1-D, got shape {stream.shape}")
  n_rows = len(stream) // seq_len
  if n_rows == 0:
    raise ValueError(
      f"stream of {len(stream)} tokens is shorter than seq_len={seq_len}: "
      "use more documents or a shorter seq_len"
    )
  return stream[: n_rows * seq_len].reshape(n_rows, seq_len)
