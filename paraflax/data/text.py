"""Data sources of packed text rows `{"tokens": [B, data.seq_len]}`, split, tokenized and cut
as the run's `DataConfig` says (`pipeline.py`). The tokenizer is the one of the model directory
`data.tokenizer` (with the method tokens `data.mask_token` / `data.sep_token`), or, without
one, a BPE trained on the train split (`data.vocab_size` ids, cached in `data.cache_dir`):

    "stdlib"  the standard-library corpus (`corpus.py`); no arguments, `DataConfig` has them
    "jsonl"   the records of JSON Lines files (`jsonl.py`: text, prompt/response, chat), with a
              `"loss_mask"` (`records.py`: by default only responses are targets)
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import numpy as np

from paraflax.data import corpus
from paraflax.data.chat import ChatTemplate
from paraflax.data.jsonl import ChatRecord, read_records
from paraflax.data.pipeline import (
  Data,
  DataConfig,
  documents_tokenizer,
  prepare_stdlib,
  train_iterator,
  validation_batches,
)
from paraflax.data.records import LOSS_ON, RecordEncoder, chat_mode, record_streams, split_key
from paraflax.data.source import TrainData, register_source
from paraflax.data.tokenizer import load_tokenizer


def data_tokenizer(data: DataConfig):
  """The tokenizer of `data.tokenizer` with the data config's method tokens, or None."""
  if data.tokenizer is None:
    return None
  return load_tokenizer(os.path.expanduser(data.tokenizer), mask_token=data.mask_token,
                        sep_token=data.sep_token)


def _opened(prepared: Data, data: DataConfig, corpus_desc: str, split_field: str) -> TrainData:
  source = (f"the tokenizer of {data.tokenizer!r} (data.tokenizer)" if data.tokenizer else
            f"the tokenizer trained on {corpus_desc} (data.vocab_size={data.vocab_size}, "
            f"cached in {data.cache_dir!r})")
  return TrainData(
      train_iterator(prepared.train_tokens, data, prepared.train_mask),
      validation_batches(prepared.val_tokens, data, prepared.val_mask, split_field=split_field),
      prepared.tokenizer,
      max_position=data.seq_len, rows="text", tokenizer_source=source)


@register_source("stdlib")
@dataclasses.dataclass(frozen=True)
class StdlibData:
  """The standard-library corpus, split by file (`data.val_fraction`, `data.max_files`)."""

  fields: ClassVar[tuple[str, ...]] = ("tokens",)

  def open(self, data: DataConfig, *, progress: bool = True) -> TrainData:
    data = dataclasses.replace(data, progress=data.progress and progress)
    prepared = prepare_stdlib(data, tokenizer=data_tokenizer(data))
    name = corpus.corpus_name(data.val_fraction, data.max_files)
    return _opened(prepared, data, f"the data config's corpus {name}", "data.val_fraction")


@register_source("jsonl")
@dataclasses.dataclass(frozen=True)
class JsonlData:
  """The records of JSON Lines `paths` (files, globs, directories; a single string too; an old
  config's `path` is read as one more), split by a stable hash of each record (a repeated
  record lands on one side), `val_fraction` of them held out. Batches: `tokens` and
  `loss_mask` [B, L]: `loss_on="response"` makes only prompt/response and chat replies targets
  (the SFT convention), "all" every token (text records always). `chat`: "auto" puts
  prompt/response pairs through the tokenizer's chat template when it has one, "yes" always,
  "no" never (chat records always need one). `skip_bad_lines`: skip and count bad lines
  instead of refusing the files."""

  fields: ClassVar[tuple[str, ...]] = ("tokens", "loss_mask")
  paths: tuple[str, ...] = ()
  val_fraction: float = 0.05
  loss_on: str = "response"
  chat: str | bool = "auto"
  skip_bad_lines: bool = False
  path: str | None = None  # older configs' single file: read after `paths`

  def __post_init__(self):
    paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
    if not all(isinstance(p, (str, os.PathLike)) and os.fspath(p) for p in paths):
      raise ValueError(f"jsonl paths must be non-empty strings (files or globs), got "
                       f"{self.paths!r}")
    object.__setattr__(self, "paths", tuple(map(os.fspath, paths)))
    if not self.files:
      raise ValueError("the jsonl data source needs `paths`: JSONL files or globs")
    object.__setattr__(self, "chat", chat_mode(self.chat))
    if not 0.0 < self.val_fraction < 1.0:
      raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
    if self.loss_on not in LOSS_ON:
      raise ValueError(f"loss_on must be one of {list(LOSS_ON)}, got {self.loss_on!r}")

  @property
  def files(self) -> tuple[str, ...]:
    """`paths`, then the old `path`."""
    return self.paths + ((self.path,) if self.path else ())

  def shapes(self, data: DataConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {k: ((data.batch_size, data.seq_len), np.dtype(np.int32)) for k in self.fields}

  def open(self, data: DataConfig, *, progress: bool = True) -> TrainData:
    data = dataclasses.replace(data, progress=data.progress and progress)
    records = read_records(self.files, skip_bad_lines=self.skip_bad_lines)
    where = ", ".join(map(repr, self.files))
    if data.tokenizer is None and any(isinstance(r, ChatRecord) for r in records):
      raise ValueError(f"{where}: chat records ('messages') need a chat template: set "
                       "data.tokenizer to a model directory that has one")
    split = [corpus.split_of(split_key(r), self.val_fraction) for r in records]
    train = [r for r, s in zip(records, split) if s == "train"]
    val = [r for r, s in zip(records, split) if s == "validation"]
    if not train or not val:
      raise ValueError(f"{where}: {len(records)} records leave no "
                       f"{'training' if not train else 'validation'} documents at "
                       f"data_source_args.val_fraction={self.val_fraction}")
    tok = data_tokenizer(data)
    template = None
    if tok is None:
      tok = documents_tokenizer([r.text for r in train], data, name="jsonl")
    else:
      template = ChatTemplate.of(os.path.expanduser(data.tokenizer))
    encoder = RecordEncoder(tok, template, loss_on=self.loss_on, chat=self.chat)
    streams = [record_streams(rs, encoder, data.cache_dir, progress=data.progress,
                              desc=f"tokenizing {name}")
               for rs, name in ((train, "train"), (val, "validation"))]
    prepared = Data(tok, streams[0][0], streams[1][0], streams[0][1], streams[1][1])
    return _opened(prepared, data, where, "data_source_args.val_fraction")
