"""Synthetic training batches: one batch of a config's data-source shapes with valid contents,
so a training step runs without a corpus or a store. One row maker per data source, registered
under the source's name (`synthetic_rows`); a new data source registers its own."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# data source name -> (row length, vocabulary size, rng) -> {field: [length] array}
ROWS: dict[str, Callable] = {}


def synthetic_rows(*sources: str):
  """Decorator: the row maker of the data sources `sources`."""
  def register(fn):
    for name in sources:
      ROWS[name] = fn
    return fn
  return register


@synthetic_rows("stdlib")
def text_row(length: int, vocab: int, rng: np.random.Generator) -> dict:
  return {"tokens": rng.integers(0, vocab, length)}


@synthetic_rows("jsonl")
def record_row(length: int, vocab: int, rng: np.random.Generator) -> dict:
  """Random tokens, the loss on the second half (a prompt/response record)."""
  return {"tokens": rng.integers(0, vocab, length),
          "loss_mask": (np.arange(length) >= length // 2).astype(np.int32)}


JACOBI_BLOCK = 16  # the synthetic Jacobi Forcing rows' block size


def jacobi_prompt_len(length: int, n: int = JACOBI_BLOCK) -> int:
  """The prompt region of a synthetic Jacobi Forcing row of `length` slots: about an eighth
  of it, the rest blocks of `n` in two streams (`jacobi_forcing_loss`'s `prompt_len`)."""
  return length - 2 * n * max(1, (length - length // 8) // (2 * n))


@synthetic_rows("trajectories")
def jacobi_row(length: int, vocab: int, rng: np.random.Generator, n: int = JACOBI_BLOCK) -> dict:
  """One packed Jacobi Forcing row filling `length`: a prompt of `jacobi_prompt_len`, then
  noisy and clean blocks (noisy = clean from a random first divergent slot on), through
  `jacobi_forcing.example`."""
  from paraflax.training.objectives.jacobi_forcing import example
  p = jacobi_prompt_len(length, n)
  blocks = (length - p) // (2 * n)
  clean = rng.integers(0, vocab, (blocks, n))
  first = rng.integers(0, n + 1, blocks)  # n: the block had already converged
  noisy = np.where(np.arange(n)[None] >= first[:, None], rng.integers(0, vocab, (blocks, n)),
                   clean)
  return example(rng.integers(0, vocab, p), noisy, clean, length)


def teacher_prompt_len(length: int) -> int:
  """The longest prompt of synthetic teacher rows of `length` slots (a store's
  max_prompt_len: `length` less the answer, half of it; `deer_stage1_loss`'s `prompt_len`)."""
  return length - length // 2


@synthetic_rows("teacher")
def teacher_row(length: int, vocab: int, rng: np.random.Generator) -> dict:
  """One teacher row: a prompt of three quarters of `teacher_prompt_len`, the answer,
  right-padded with 0."""
  answer = length // 2
  p = teacher_prompt_len(length) * 3 // 4
  tokens = np.zeros(length, np.int32)
  tokens[:p + answer] = rng.integers(0, vocab, p + answer)
  return {"tokens": tokens, "prompt_lens": np.int32(p), "lengths": np.int32(p + answer)}


def row_args(source: str, length: int) -> dict:
  """The objective arguments the synthetic rows of `source` at `length` fix, as a store's
  fix a run's (`DataSource.objective_args`, `TrainConfig.with_fixed_args`)."""
  prompt_len = {"trajectories": jacobi_prompt_len, "teacher": teacher_prompt_len}.get(source)
  return {} if prompt_len is None else {"prompt_len": prompt_len(length)}


def synthetic_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
  """A batch of `cfg`'s data-source shapes (`dry_run.abstract_batch`: what `train` feeds its
  step) with valid contents for the source."""
  from paraflax.training.run.dry_run import abstract_batch
  if cfg.data_source not in ROWS:
    raise ValueError(f"no synthetic rows for the data source {cfg.data_source!r} (known: "
                     f"{', '.join(ROWS)}): register a row maker with "
                     "paraflax.perf.batches.synthetic_rows")
  rng = np.random.default_rng(seed)
  b, length, vocab = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  rows = [ROWS[cfg.data_source](length, vocab, rng) for _ in range(b)]
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  batch["step"] = np.zeros(b, np.int32)  # kept only when the objective reads it
  out = {}
  for k, s in abstract_batch(cfg).items():
    out[k] = np.asarray(batch[k]).astype(s.dtype)
    if out[k].shape != s.shape:
      raise ValueError(f"synthetic {k} has shape {out[k].shape}, the source's is {s.shape}")
  return out
