"""grain pipelines over packed token rows.

Training: rows -> global shuffle -> repeat forever (a new shuffle each epoch) -> batch.
Batches are `{"tokens": int32 [B, L]}`, and `"loss_mask": int32 [B, L]` (1: token i is a
target) when the stream has a mask stream (JSONL records, `records.py`), packed in parallel
with the tokens, so a row's mask is the mask of its tokens. The iterator is a
`grain.DatasetIterator` whose `get_state()` / `set_state()` checkpoint the exact data position (orbax saves it
beside the model with `grain.checkpoint.CheckpointSave` / `CheckpointRestore`).
Batches may straddle an epoch boundary, so no row is ever skipped.

Validation: the same rows in order, no shuffle, finite; the last partial batch is
dropped so every batch has the same shape (one compilation of the eval step).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np

from paraflax.data import corpus
from paraflax.data.packing import pack, token_stream
from paraflax.data.tokenizer import Tokenizer, load_or_train


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read, how to cut it, and where to cache it."""

  seq_len: int = 256
  batch_size: int = 16
  seed: int = 0
  vocab_size: int = 2048  # tokenizer trained on the train split when none is given
  val_fraction: float = 0.05  # share of corpus files held out, by file
  cache_dir: str = "~/.cache/paraflax/data"
  max_files: int | None = None  # per split; None: the whole corpus
  progress: bool = True  # tqdm bars while tokenizing
  # a model directory (Hugging Face checkpoint, training workdir, `paraflax convert` output)
  # whose tokenizer encodes the data; None: a BPE trained on the train split (`vocab_size`)
  tokenizer: str | None = None
  # with `tokenizer`: the method tokens (TiDAR/DEER/AS-ARM <mask>, DEER <sep>) by their strings,
  # a token the tokenizer has (Qwen's reserved "<|fim_pad|>") or a new one it gains
  mask_token: str | None = None
  sep_token: str | None = None

  def __post_init__(self):
    if self.seq_len < 2:
      raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
    if not 0.0 <= self.val_fraction < 1.0:
      raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
    for name in ("tokenizer", "mask_token", "sep_token"):
      if getattr(self, name) is not None and not getattr(self, name):
        raise ValueError(f"data.{name} must be a non-empty string or None")
    if self.mask_token is not None and self.mask_token == self.sep_token:
      raise ValueError(f"data.mask_token and data.sep_token are both {self.mask_token!r}")
    if self.max_files is not None and self.max_files < 1:
      raise ValueError(f"max_files must be a positive integer or None, got {self.max_files}")


@dataclasses.dataclass(frozen=True, eq=False)
class Data:
  """A tokenizer and the token streams of both splits (EOS after every document)."""

  tokenizer: Tokenizer
  train_tokens: np.ndarray  # int32 [N_train]
  val_tokens: np.ndarray  # int32 [N_val]
  train_mask: np.ndarray | None = None  # int8 [N_train]: 1 where a token is a target
  val_mask: np.ndarray | None = None  # int8 [N_val]


def _shuffle_seed(seed: int) -> int:
  # grain shuffles epoch e with seed + e, so seeds s and s+1 would give the same
  # epochs shifted by one. Hashing the user seed keeps different seeds unrelated.
  digest = hashlib.sha1(f"paraflax-shuffle-{seed}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


def _as_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
  return {"tokens": np.asarray(tokens, np.int32)}  # [B, L]


def _as_masked_batch(rows_Bx2xL: np.ndarray) -> dict[str, np.ndarray]:
  return {"tokens": np.asarray(rows_Bx2xL[:, 0], np.int32),
          "loss_mask": np.asarray(rows_Bx2xL[:, 1], np.int32)}


class _Paired:
  """Rows i of tokens and mask as one [2, L] item (lazy: the streams stay memory-mapped)."""

  def __init__(self, rows: np.ndarray, mask_rows: np.ndarray):
    self.rows, self.mask_rows = rows, mask_rows

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, i):
    return np.stack([np.asarray(self.rows[i], np.int32), np.asarray(self.mask_rows[i], np.int32)])


def _rows(tokens: np.ndarray, seq_len: int, mask: np.ndarray | None):
  """(rows source, batch function): packed rows, paired with their mask rows when given."""
  rows = pack(tokens, seq_len)  # [R, L]
  if mask is None:
    return rows, _as_batch
  if np.shape(mask) != np.shape(tokens):
    raise ValueError(f"loss mask stream has shape {np.shape(mask)}, tokens {np.shape(tokens)}")
  return _Paired(rows, pack(mask, seq_len)), _as_masked_batch


_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # in-memory rows: no threads


def train_dataset(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                  mask: np.ndarray | None = None) -> grain.MapDataset:
  """Infinite, shuffled, batched packed rows of a token stream (and its `mask` stream).
  Items: {"tokens": [B, L]} (+ "loss_mask": [B, L])."""
  rows, as_batch = _rows(tokens, seq_len, mask)
  return (
    grain.MapDataset.source(rows)
    .shuffle(seed=_shuffle_seed(seed))
    .repeat(None)
    .batch(batch_size, drop_remainder=True)
    .map(as_batch)
  )


def train_iterator(tokens: np.ndarray, cfg: DataConfig,
                   mask: np.ndarray | None = None) -> grain.DatasetIterator:
  """Checkpointable iterator over `train_dataset` (state: `it.get_state()`)."""
  ds = train_dataset(tokens, cfg.seq_len, cfg.batch_size, cfg.seed, mask)
  return iter(ds.to_iter_dataset(_READ))


def validation_dataset(tokens: np.ndarray, seq_len: int, batch_size: int,
                       mask: np.ndarray | None = None, *,
                       split_field: str = "data.val_fraction") -> grain.MapDataset:
  """Finite, unshuffled batches of packed rows: `len(ds)` batches, `ds[i]` is one.
  `split_field`: the config field that sized the split (named when it is too small)."""
  rows, as_batch = _rows(tokens, seq_len, mask)
  if len(rows) < batch_size:
    raise ValueError(
      f"validation stream has {len(rows)} rows of {seq_len} tokens, fewer than one "
      f"batch of {batch_size}: raise {split_field} or lower data.batch_size/data.seq_len"
    )
  return grain.MapDataset.source(rows).batch(batch_size, drop_remainder=True).map(as_batch)


def validation_batches(tokens: np.ndarray, cfg: DataConfig, mask: np.ndarray | None = None, *,
                       split_field: str = "data.val_fraction") -> list[dict[str, np.ndarray]]:
  """All validation batches, in order (small: held in memory; reuse for each evaluation)."""
  ds = validation_dataset(tokens, cfg.seq_len, cfg.batch_size, mask, split_field=split_field)
  return [ds[i] for i in range(len(ds))]  # direct indexing: no reader threads


def prepare_documents(
  train_docs: Sequence[str],
  val_docs: Sequence[str],
  cfg: DataConfig,
  *,
  tokenizer: Tokenizer | None = None,
  name: str = "docs",
) -> Data:
  """Tokenize both splits (cached); train a tokenizer on `train_docs` if none is given."""
  cache = Path(cfg.cache_dir).expanduser()
  if tokenizer is None:
    tokenizer = documents_tokenizer(train_docs, cfg, name=name)
  train = token_stream(train_docs, tokenizer, cache, progress=cfg.progress, desc="tokenizing train")
  val = token_stream(
    val_docs, tokenizer, cache, progress=cfg.progress, desc="tokenizing validation"
  )
  return Data(tokenizer, train, val)


def documents_tokenizer(train_docs: Sequence[str], cfg: DataConfig, *, name: str) -> Tokenizer:
  """A BPE of `cfg.vocab_size` ids trained on `train_docs` (cached in `cfg.cache_dir`)."""
  # Key the tokenizer by the training text itself so a changed corpus retrains.
  digest = hashlib.sha1("\0".join(train_docs).encode("utf-8")).hexdigest()[:12]
  return load_or_train(Path(cfg.cache_dir).expanduser(), lambda: train_docs, cfg.vocab_size,
                       name=f"{name}-{digest}", progress=cfg.progress)


def prepare_stdlib(cfg: DataConfig, *, tokenizer: Tokenizer | None = None) -> Data:
  """`prepare_documents` on the standard-library corpus split by `cfg.val_fraction`."""
  train_docs = corpus.stdlib_documents("train", cfg.val_fraction, cfg.max_files)
  val_docs = corpus.stdlib_documents("validation", cfg.val_fraction, cfg.max_files)
  name = corpus.corpus_name(cfg.val_fraction, cfg.max_files)
  return prepare_documents(train_docs, val_docs, cfg, tokenizer=tokenizer, name=name)
