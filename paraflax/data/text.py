"""Data sources of packed text rows `{"tokens": [B, data.seq_len]}`, split, tokenized and cut
as the run's `DataConfig` says (`pipeline.py`), the tokenizer trained on the train split
(`data.vocab_size` ids, cached in `data.cache_dir`):

    "stdlib"  the standard-library corpus (`corpus.py`); no arguments, `DataConfig` has them
    "jsonl"   the records of a JSON Lines file (`jsonl.py`: `text`, or `prompt + response`)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from paraflax.data import corpus
from paraflax.data.jsonl import jsonl_documents
from paraflax.data.pipeline import (Data, DataConfig, prepare_documents, prepare_stdlib,
                                    train_iterator, validation_batches)
from paraflax.data.source import TrainData, register_source


def _opened(prepared: Data, data: DataConfig, corpus_desc: str) -> TrainData:
  return TrainData(
      train_iterator(prepared.train_tokens, data),
      validation_batches(prepared.val_tokens, data), prepared.tokenizer,
      max_position=data.seq_len, rows="text",
      tokenizer_source=(f"the tokenizer trained on {corpus_desc} (data.vocab_size="
                        f"{data.vocab_size}, cached in {data.cache_dir!r})"))


@register_source("stdlib")
@dataclasses.dataclass(frozen=True)
class StdlibData:
  """The standard-library corpus, split by file (`data.val_fraction`, `data.max_files`)."""

  fields: ClassVar[tuple[str, ...]] = ("tokens",)

  def open(self, data: DataConfig, *, progress: bool = True) -> TrainData:
    prepared = prepare_stdlib(dataclasses.replace(data, progress=data.progress and progress))
    name = corpus.corpus_name(data.val_fraction, data.max_files)
    return _opened(prepared, data, f"the data config's corpus {name}")


@register_source("jsonl")
@dataclasses.dataclass(frozen=True)
class JsonlData:
  """The documents of the JSON Lines file `path`, split by a stable hash of each document's
  text (a repeated document lands on one side), `val_fraction` of them held out."""

  fields: ClassVar[tuple[str, ...]] = ("tokens",)
  path: str
  val_fraction: float = 0.05

  def __post_init__(self):
    if not 0.0 < self.val_fraction < 1.0:
      raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

  def open(self, data: DataConfig, *, progress: bool = True) -> TrainData:
    docs = jsonl_documents(Path(self.path).expanduser())
    split = [corpus.split_of(d, self.val_fraction) for d in docs]
    train = [d for d, s in zip(docs, split) if s == "train"]
    val = [d for d, s in zip(docs, split) if s == "validation"]
    if not train or not val:
      raise ValueError(f"{self.path}: {len(docs)} records leave no "
                       f"{'training' if not train else 'validation'} documents at "
                       f"val_fraction={self.val_fraction}")
    prepared = prepare_documents(train, val, dataclasses.replace(
        data, progress=data.progress and progress), name=f"jsonl-{Path(self.path).stem}")
    return _opened(prepared, data, f"{self.path!r}")
