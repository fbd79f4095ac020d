"""The `DataSource` protocol (what a training run reads) and its registry.

A data source is a frozen dataclass whose fields are its arguments, registered under a name
(`register_source`); `TrainConfig(data_source=name, data_source_args={...})` picks one and the
trainer calls `open` without knowing which it is:

    source = get_source("teacher", {"path": "~/.cache/paraflax/deer/teacher"})
    data = source.open(cfg.data, progress=True)   # -> TrainData
    batch = next(data.train)                      # {field: [B, ...]}, `source.fields` keys

Registered by their own files: "stdlib" and "jsonl" (packed text rows of the standard-library
corpus, or of JSON Lines records with a `loss_mask` field, `text.py`), "trajectories" (packed
Jacobi Forcing rows of a trajectory store, `training/objectives/jacobi_forcing.py`), "teacher"
(prompt + answer rows of a DEER teacher store, `training/objectives/deer.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class TrainData:
  """What an opened source gives the trainer."""

  train: Any  # infinite iterator of batch dicts, checkpointable: get_state() / set_state()
  validation: list  # equally shaped batch dicts, in order
  tokenizer: Any  # the `Tokenizer` its token ids come from
  max_position: int  # longest position + 1 its rows reach (checked against max_seq_len)
  tokenizer_source: str  # where that tokenizer comes from, for messages
  rows: str = "data"  # what its rows are, for messages ("trajectory", "teacher")


@runtime_checkable
class DataSource(Protocol):
  """A frozen dataclass of arguments that opens into `TrainData`.

  `fields`: the batch keys every batch carries (an objective declares the ones it needs).
  `open(data, progress=...)`: `data` is the run's `DataConfig` (batch_size and seed always;
  the corpus settings for sources that read one). `data.seq_len` is the row length: a source
  whose rows have another length (a store's) refuses to open.
  Optional `shapes(data) -> {field: (shape, dtype)}`: one batch's shapes without opening
  anything (`batch_shapes`; what `train --dry-run` compiles with).
  Optional `objective_args(data) -> {name: value}`: the objective arguments its rows fix
  (a store's layout), read without opening the rows; FileNotFoundError when there is nothing
  to read yet (`TrainConfig.with_row_args`). Optional `stand_in_args(data)`: those a dry run
  compiles with before there is anything to read, where the objective needs them.
  """

  fields: ClassVar[tuple[str, ...]]

  def open(self, data, *, progress: bool) -> TrainData:
    ...


SOURCES: dict[str, type] = {}


def register_source(name: str, *, replace: bool = False):
  """Class decorator: make a frozen dataclass available as `TrainConfig(data_source=name)`."""
  def register(cls: type) -> type:
    if not (dataclasses.is_dataclass(cls) and hasattr(cls, "open") and hasattr(cls, "fields")):
      raise TypeError(f"data source {name!r} must be a dataclass with `fields` and `open`")
    if name in SOURCES and not replace and SOURCES[name] is not cls:
      raise ValueError(f"data source {name!r} is already registered; pass replace=True to "
                       "override")
    SOURCES[name] = cls
    return cls
  return register


def source_class(name: str) -> type:
  """The registered source class `name` (a clear ValueError for an unknown one)."""
  if name not in SOURCES:
    raise ValueError(f"unknown data source {name!r}; registered: {sorted(SOURCES)}")
  return SOURCES[name]


def get_source(name: str, args: Any = ()) -> DataSource:
  """The registered source `name` built with its arguments (a mapping or pairs)."""
  cls = source_class(name)
  args = dict(args)
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(args) - set(known))
  if unknown:
    raise ValueError(f"data source {name!r} takes no argument {unknown[0]!r}; its arguments: "
                     f"{known}")
  try:
    return cls(**args)
  except TypeError as e:  # a missing argument
    raise ValueError(f"data source {name!r}: {e}") from None


def batch_shapes(source, data) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{field: (shape, dtype)} of one batch of `source` under `data` (its `shapes`; a source
  without one: every field int32 `[data.batch_size, data.seq_len]`)."""
  if hasattr(source, "shapes"):
    return source.shapes(data)
  return {k: ((data.batch_size, data.seq_len), np.dtype(np.int32)) for k in source.fields}


def source_args(source) -> tuple[tuple[str, Any], ...]:
  """A source's arguments as sorted pairs, defaults included (how a config stores them)."""
  return tuple(sorted((f.name, getattr(source, f.name)) for f in dataclasses.fields(source)))


def as_pairs(args: Any) -> tuple[tuple[str, Any], ...]:
  """A mapping or pairs of arguments as sorted pairs."""
  return tuple(sorted((args if isinstance(args, Mapping) else dict(args)).items()))
