"""Per-position quantities of the output head computed over chunks of positions, so a loss
never holds the float32 logits `[B, T, V]` of a whole row (nor their softmax or gradient).

`per_position(fn, model, hidden_BxTxD, extras)` pads T to a multiple of the chunk, then runs
`fn(logits_BxCxV, extras_chunk, head)` on each chunk inside `lax.map` under `jax.checkpoint`:
the forward keeps only each chunk's outputs `[B, C]`, and the backward recomputes one chunk's
logits at a time. `head(h_BxCxD)` projects other hidden states of the chunk (Jacobi Forcing's
teacher). The chunk is `RunControl.loss_chunk` (`chunk_size`); a chunk covering the row runs
`fn` once on the whole row, without the loop (tiny demo shapes: faster, the same values).

The head's gradient sums over chunks in the parameter dtype (the projection is cast to the
compute dtype inside each chunk), so bf16 compute does not accumulate it in bf16.
tokamax's fused `linear_softmax_cross_entropy_loss` (TPU) is not routed here: this loop is
the path on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from paraflax.model.transformer import logits as project
from paraflax.parallel import sharding

# "auto" (loss_chunk=None): the float32 logits computed at once stay under this many bytes
LOGITS_BUDGET = 256 * 2**20


def chunk_size(setting: int | None, b: int, t: int, v: int) -> int:
  """Positions per chunk (t: the whole row) for `RunControl.loss_chunk` = `setting`: an
  int forces it; None takes the whole row while its logits `[b, t, v]` float32 fit
  `LOGITS_BUDGET`, else the fewest equal chunks that do. `b`: the rows one device holds."""
  if setting is not None:
    return min(setting, t)
  n = -(-(b * t * v * 4) // LOGITS_BUDGET)
  return -(-t // n)


def per_position(fn, model, hidden_BxTxD, extras=None):
  """`fn(logits_BxCxV, extras_chunk, head) -> pytree of [B, C]` over the row's chunks,
  concatenated to `[B, T]`. `extras`: a pytree of `[B, T, ...]` arrays cut like the row."""
  b, t, _ = hidden_BxTxD.shape
  w_DxV = model.unembedding()
  rows = b // sharding.batch_shards(b)  # per device: the batch is split over a mesh's axes
  chunk = chunk_size(model.run.loss_chunk, rows, t, w_DxV.shape[1])
  inputs = (hidden_BxTxD, extras)

  def run(w, h_and_x):
    h, x = h_and_x
    head = functools.partial(project, w_DxV=w)
    return fn(head(h), x, head)

  if chunk >= t:
    return run(w_DxV, inputs)
  n = -(-t // chunk)

  def cut(x):  # [B, T, ...] -> [n, B, C, ...]
    x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

  body = jax.checkpoint(run, prevent_cse=False)
  out = jax.lax.map(lambda hx: body(w_DxV, hx), jax.tree.map(cut, inputs))
  return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(b, n * chunk)[:, :t], out)


def token_stats(logits_BxTxV, targets_BxT):
  """(nll, argmax hit) `[B, T]` float32 of integer targets."""
  nll = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
  hit = (jnp.argmax(logits_BxTxV, -1) == targets_BxT).astype(jnp.float32)
  return nll, hit


def token_nll(model, hidden_BxTxD, targets_BxT):
  """(nll, argmax hit) `[B, T]` of `targets` under the logits of `hidden`, chunked."""
  return per_position(lambda z, y, _: token_stats(z, y), model, hidden_BxTxD, targets_BxT)


def soft_cross_entropy(logits_BxTxV, teacher_BxTxV, temperature: float):
  """`[B, T]`: -sum softmax(teacher / tau) log_softmax(logits / tau) x tau^2 (teacher detached)."""
  p = jax.nn.softmax(jax.lax.stop_gradient(teacher_BxTxV) / temperature)
  return -jnp.sum(p * jax.nn.log_softmax(logits_BxTxV / temperature), -1) * temperature ** 2
