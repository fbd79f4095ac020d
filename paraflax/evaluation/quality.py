"""Output quality that does not depend on the decoder: held-out loss of a model's weights."""

from __future__ import annotations

import jax

from paraflax.data import corpus
from paraflax.data.pipeline import DataConfig, validation_batches
from paraflax.data.packing import token_stream


def heldout_loss(model, tokenizer, *, batches: int = 8, seq_len: int = 256, batch_size: int = 8,
                 cache_dir: str = DataConfig.cache_dir) -> float:
  """Mean next-token loss (nats/token) of `model` on the first `batches` packed rows of the
  stdlib validation split: the quality figure distilled weights are compared on."""
  from paraflax.training import evaluate, get_objective
  docs = corpus.stdlib_documents("validation")
  cfg = DataConfig(seq_len=seq_len, batch_size=batch_size, cache_dir=cache_dir)
  stream = token_stream(docs, tokenizer, cfg.cache_dir, progress=False)
  val = validation_batches(stream, cfg)[:batches]
  return evaluate(model, val, get_objective("ar"), jax.random.key(0))
