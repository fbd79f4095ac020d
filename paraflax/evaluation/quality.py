"""Output quality that does not depend on the decoder: held-out losses of a model's weights."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from paraflax.data import corpus
from paraflax.data.jsonl import read_records
from paraflax.data.packing import token_stream
from paraflax.data.pipeline import DataConfig, validation_batches
from paraflax.data.records import RecordEncoder, record_streams


def heldout_batches(tokenizer, *, batches: int = 8, seq_len: int = 256, batch_size: int = 8,
                    cache_dir: str = DataConfig.cache_dir) -> list[dict[str, np.ndarray]]:
  """The first `batches` packed batches of the stdlib validation split (read and tokenised
  once per call: compute them once and score every set of weights on them)."""
  docs = corpus.stdlib_documents("validation")
  cfg = DataConfig(seq_len=seq_len, batch_size=batch_size, cache_dir=cache_dir)
  stream = token_stream(docs, tokenizer, cfg.cache_dir, progress=False)
  return validation_batches(stream, cfg)[:batches]


def records_batches(tokenizer, paths, model_dir, *, seq_len: int = 256,
                    batch_size: int = 8) -> list[dict[str, np.ndarray]]:
  """Every record of the JSONL `paths` encoded as training encodes them (the chat template of
  `model_dir` when it has one; loss on responses), packed into `{"tokens", "loss_mask"}`
  batches of `seq_len` (fewer rows than `batch_size`: one batch of them all)."""
  from paraflax.data.chat import ChatTemplate
  encoder = RecordEncoder(tokenizer, ChatTemplate.of(model_dir))
  tokens, mask = record_streams(read_records(paths), encoder, progress=False)
  rows = len(tokens) // seq_len
  if rows == 0:
    raise ValueError(f"--eval-data {paths}: {len(tokens)} tokens, fewer than one row of "
                     f"{seq_len}")
  cfg = DataConfig(seq_len=seq_len, batch_size=min(batch_size, rows))
  return validation_batches(tokens, cfg, mask)


def heldout_metrics(model, batches, objective: str = "ar", args=()) -> dict[str, float]:
  """Mean loss and metrics of `objective` for `model` over `batches` ("ar": next-token loss,
  nats/token; "tidar": also the diffusion mode's `diff_loss`)."""
  from paraflax.training import get_objective
  graphdef, params = nnx.split(model)
  loss_fn = get_objective(objective, args)

  @jax.jit
  def metrics(params, batch, rng):
    loss, m = loss_fn(nnx.merge(graphdef, params), batch, rng)
    return {**m, "loss": loss}

  rows = [jax.device_get(metrics(params, b, jax.random.key(i))) for i, b in enumerate(batches)]
  return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def heldout_loss(model, batches) -> float:
  """Next-token loss (nats/token) over held-out batches: the AR quality of the weights."""
  return heldout_metrics(model, batches, "ar")["loss"]
