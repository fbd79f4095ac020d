"""The data source "stdlib": packed rows of the standard-library corpus (`corpus.py`), split,
tokenized and cut as the run's `DataConfig` says (`pipeline.py`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from paraflax.data import corpus
from paraflax.data.pipeline import DataConfig, prepare_stdlib, train_iterator, validation_batches
from paraflax.data.source import TrainData, register_source


@register_source("stdlib")
@dataclasses.dataclass(frozen=True)
class StdlibData:
  """Rows `{"tokens": [B, data.seq_len]}`; the tokenizer is trained on the train split (with
  `data.vocab_size` ids, cached in `data.cache_dir`). No arguments: `DataConfig` has them."""

  fields: ClassVar[tuple[str, ...]] = ("tokens",)

  def open(self, data: DataConfig, *, progress: bool = True) -> TrainData:
    prepared = prepare_stdlib(dataclasses.replace(data, progress=data.progress and progress))
    name = corpus.corpus_name(data.val_fraction, data.max_files)
    return TrainData(
        train_iterator(prepared.train_tokens, data),
        validation_batches(prepared.val_tokens, data), prepared.tokenizer,
        max_position=data.seq_len, rows="stdlib",
        tokenizer_source=(f"the tokenizer trained on the data config's corpus {name} "
                          f"(data.vocab_size={data.vocab_size}, cached in {data.cache_dir!r})"))
