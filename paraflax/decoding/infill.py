"""`infill`: fill the holes (`HOLE` = -1) of token sequences with an any-subset model.

Host-side checks, then one compiled `lax.while_loop` per (batch, length, decoder) shape; the
Python-loop twin (`loop="python"`) runs the same jitted init/step one iteration at a time.
"""

from __future__ import annotations

import jax
import numpy as np

from paraflax.decoding import checks, lattice
from paraflax.decoding.any_order import AnyOrder
from paraflax.decoding.generate import TRACES
from paraflax.decoding.lattice import HOLE, InfillOutput
from paraflax.decoding.protocol import InfillDecoder, check_kind
from paraflax.decoding.state import Forward


def infill_loop(fwd, dec: InfillDecoder, canvas_BxN, rng) -> InfillOutput:
  """The pure loop: `dec.init`, then `dec.step` while holes are left (jittable)."""
  state = dec.init(fwd, canvas_BxN, rng)
  return lattice.finish(jax.lax.while_loop(lattice.cond, lambda s: dec.step(fwd, s), state))


@jax.jit
def _infill_while(fwd, dec, canvas, rng):
  TRACES[type(dec).__name__] += 1
  return infill_loop(fwd, dec, canvas, rng)


@jax.jit
def _init(fwd, dec, canvas, rng):
  return dec.init(fwd, canvas, rng)


@jax.jit
def _step(fwd, dec, state):
  return dec.step(fwd, state)


def prepare_canvas(tokens_with_holes, cfg) -> np.ndarray:
  """Checks and an int32 [B, N] array: equal-length rows of token ids and HOLEs."""
  try:
    canvas = np.asarray(tokens_with_holes)
  except ValueError as e:  # ragged nested lists
    raise ValueError("infill needs rows of equal length (pad them with prompt tokens)") from e
  if canvas.ndim != 2 or canvas.shape[0] < 1 or canvas.shape[1] < 1:
    raise ValueError(f"infill needs tokens [B, N] with B, N >= 1, got shape {canvas.shape}")
  if not np.issubdtype(canvas.dtype, np.integer):
    raise ValueError(f"infill needs integer token ids (HOLE = {HOLE}), got {canvas.dtype}")
  n = canvas.shape[1]
  if n > cfg.max_seq_len:
    raise ValueError(f"sequences of {n} positions (holes included) do not fit the model's "
                     f"max_seq_len {cfg.max_seq_len}")
  bad = (canvas != HOLE) & ((canvas < 0) | (canvas >= cfg.vocab_size))
  if bad.any():
    rows, cols = np.nonzero(bad)
    raise ValueError(f"token ids outside the vocabulary [0, {cfg.vocab_size}) and not HOLE "
                     f"({HOLE}): (row, position) = {list(zip(rows.tolist(), cols.tolist()))[:5]}")
  no_holes = np.flatnonzero(~(canvas == HOLE).any(1))
  if no_holes.size:
    raise ValueError(f"rows {no_holes.tolist()[:5]} have no holes to fill (mark them with "
                     f"HOLE = {HOLE})")
  all_holes = np.flatnonzero((canvas == HOLE).all(1))
  if all_holes.size:
    raise ValueError(f"rows {all_holes.tolist()[:5]} are all holes: give every row at least "
                     "one visible token to condition on (a BOS or EOS token will do)")
  return canvas.astype(np.int32)


def infill(model, tokens_with_holes, decoder=None, rng=None, *, loop: str = "while"
           ) -> InfillOutput:
  """Fill every HOLE of `tokens_with_holes` ([B, N] ints, or equal-length lists) with
  `decoder`: `AnyOrder()` (default, one call per token) or `ASSD(k)`. Holes are decided in
  ascending position order given every visible token (the lattice order); with a stochastic
  sampler (`rng=jax.random.key(seed)` required) the output is a sample of the model's joint
  over the holes."""
  decoder = AnyOrder() if decoder is None else check_kind(decoder, InfillDecoder)
  if loop not in ("while", "python"):
    raise ValueError(f"loop must be 'while' or 'python', got {loop!r}")
  decoder.validate(model.cfg)
  canvas = prepare_canvas(tokens_with_holes, model.cfg)
  rng = checks.key(rng, decoder)
  canvas = jax.numpy.asarray(canvas)
  fwd = Forward.of(model)
  if loop == "while":
    return _infill_while(fwd, decoder, canvas, rng)
  state = _init(fwd, decoder, canvas, rng)
  while bool(lattice.cond(state)):
    state = _step(fwd, decoder, state)
  return lattice.finish(state)
