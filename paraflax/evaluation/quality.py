"""Output quality that does not depend on the decoder: held-out losses of a model's weights."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from paraflax.data import corpus
from paraflax.data.packing import token_stream
from paraflax.data.pipeline import DataConfig, validation_batches


def heldout_metrics(model, tokenizer, objective: str = "ar", args=(), *, batches: int = 8,
                    seq_len: int = 256, batch_size: int = 8,
                    cache_dir: str = DataConfig.cache_dir) -> dict[str, float]:
  """Mean loss and metrics of `objective` for `model` on the first `batches` packed rows of the
  stdlib validation split ("ar": next-token loss, nats/token; "tidar": also the diffusion
  mode's `diff_loss`)."""
  from paraflax.training import get_objective
  docs = corpus.stdlib_documents("validation")
  cfg = DataConfig(seq_len=seq_len, batch_size=batch_size, cache_dir=cache_dir)
  val = validation_batches(token_stream(docs, tokenizer, cfg.cache_dir, progress=False), cfg)
  graphdef, params = nnx.split(model)
  loss_fn = get_objective(objective, args)

  @functools.partial(jax.jit)
  def metrics(params, batch, rng):
    loss, m = loss_fn(nnx.merge(graphdef, params), batch, rng)
    return {**m, "loss": loss}

  rows = [jax.device_get(metrics(params, b, jax.random.key(i)))
          for i, b in enumerate(val[:batches])]
  return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def heldout_loss(model, tokenizer, **kw) -> float:
  """Next-token loss (nats/token) on held-out stdlib rows: the AR quality of the weights."""
  return heldout_metrics(model, tokenizer, "ar", **kw)["loss"]
