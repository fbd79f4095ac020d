"""Data: stdlib code corpus, JSONL user data (text, prompt/response, chat records), HumanEval prompts, BPE tokenizer, grain pipelines,
the `DataSource` protocol and its registry (`source.py`)."""

from paraflax.data.corpus import (
  Document,
  corpus_name,
  heldout_prompts,
  load_documents,
  stdlib_documents,
  stdlib_root,
)
from paraflax.data.humaneval import Problem, load_humaneval
from paraflax.data.jsonl import (ChatRecord, PairRecord, TextRecord, jsonl_documents, read_jsonl,
                                 read_records)
from paraflax.data.packing import encode_documents, pack, token_stream
from paraflax.data.records import RecordEncoder
from paraflax.data.pipeline import (
  Data,
  DataConfig,
  prepare_documents,
  prepare_stdlib,
  train_dataset,
  train_iterator,
  validation_batches,
  validation_dataset,
)
from paraflax.data.source import SOURCES, DataSource, TrainData, get_source, register_source
from paraflax.data.text import JsonlData, StdlibData
from paraflax.data.tokenizer import SPECIAL_TOKENS, Tokenizer, load_or_train, train_tokenizer

__all__ = [
  "ChatRecord",
  "Data",
  "DataConfig",
  "DataSource",
  "Document",
  "JsonlData",
  "PairRecord",
  "Problem",
  "RecordEncoder",
  "SOURCES",
  "SPECIAL_TOKENS",
  "StdlibData",
  "TextRecord",
  "Tokenizer",
  "TrainData",
  "corpus_name",
  "encode_documents",
  "get_source",
  "heldout_prompts",
  "jsonl_documents",
  "load_documents",
  "load_humaneval",
  "load_or_train",
  "pack",
  "prepare_documents",
  "prepare_stdlib",
  "read_jsonl",
  "read_records",
  "register_source",
  "stdlib_documents",
  "stdlib_root",
  "token_stream",
  "train_dataset",
  "train_iterator",
  "train_tokenizer",
  "validation_batches",
  "validation_dataset",
]
