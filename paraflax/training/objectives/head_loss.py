"""Per-position losses through the output head in a few large kernels, so a loss holds the
float32 logits `[B, T, V]` of a whole row only while they fit (`RunControl.loss_chunk`).

`weighted_nll(model, hidden, targets, weights)` gives the weighted mean of the NLL, and each
position's NLL and argmax hit for metrics (AR, TiDAR, DEER, the AS-ARM). Its total's
cotangent is one scalar g, so its gradient is g x (dx, dw) of the logits' gradient
weights (softmax(z) - onehot(y)): both are made in the forward pass, where the logits are,
and a chunked loss recomputes no logits (its residuals: dx in the compute dtype, dw float32).
`token_nll(model, hidden, targets)` gives each position's NLL, differentiable, and its argmax
hit (Jacobi Forcing's prompt rows). `pair_cross_entropy(model, pairs, targets, temperature)`
takes two rows a position, a teacher and its student with one target, and gives both rows'
NLL and hit and the student's soft cross entropy against the teacher's logits, detached
(Jacobi Forcing: a clean slot and its noisy twin). The teacher's logits are its own row's: no
row is projected twice. For the last two a custom VJP writes the gradient of the logits z
itself, with a and c the NLL's and the soft term's cotangents, u the teacher's logits and tau
the temperature:

  dz = a (softmax(z) - onehot(y)), and the student's + c tau (softmax(z/tau) - softmax(u/tau))

so the targets need no scatter, and the hit is the target's logit being the largest (no argmax).
The max and the sum of exponentials come from one reduction (an online softmax's pair); at
tau = 1 the soft part is the two rows' softmaxes' difference, so only softmax(z) is kept. The
chunk is `RunControl.loss_chunk` (`chunk_size`, in positions: a pair's two rows together):
  - a chunk covering the row (tiny demo shapes; any row whose logits fit): no loop. The forward
    is the head's gemm and its reductions; the backward one elementwise pass (from the kept
    softmax, or the logits XLA may keep instead) and two gemms: no logits are recomputed;
  - smaller chunks: a loop over them each way. The forward keeps each position's log-sum-exps
    (`[B, C]`, written with the outputs as one array a chunk), the backward recomputes one
    chunk's logits at a time: a gemm, one elementwise pass and two gemms per chunk.
The head is cast to the compute dtype once; its gradient sums over chunks in float32 (returned
in the parameter dtype), so bf16 compute does not accumulate it in bf16.

tokamax 0.0.17's fused `linear_softmax_cross_entropy_loss` is not routed here. Off the TPU it
is the whole-logits reference or an XLA loop whose zero-padded last vocabulary block enters the
log-sum-exp (wrong unless V is a multiple of its 2048-wide blocks; Qwen2.5's 151,936 is not).
Its TPU kernel masks that block itself, but like the others it gives neither the hit nor the
soft term, and it recomputes the logits in its backward pass.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from paraflax.model.transformer import logits as project
from paraflax.parallel import sharding
from paraflax.training.objectives.means import Mean

# "auto" (loss_chunk=None): the float32 logits computed at once stay under this many bytes
LOGITS_BUDGET = 256 * 2**20


def chunk_size(setting: int | None, b: int, t: int, v: int) -> int:
  """Positions per chunk (t: the whole row) for `RunControl.loss_chunk` = `setting`: an
  int forces it; None takes the whole row while its logits `[b, t, v]` float32 fit
  `LOGITS_BUDGET`, else the fewest equal chunks that do. `b`: the rows one device holds."""
  if setting is not None:
    return min(setting, t)
  n = max(1, -(-(b * t * v * 4) // LOGITS_BUDGET))  # no positions (t = 0): one empty chunk
  return -(-t // n)


def token_nll(model, hidden_BxTxD, targets_BxT):
  """(nll, argmax hit) `[B, T]` float32 of `targets` under the logits of `hidden`."""
  out = _head(model, hidden_BxTxD[:, :, None], targets_BxT, None)
  return out["nll"][..., 0], out["hit"][..., 0]


def weighted_nll(model, hidden_BxTxD, targets_BxT, weights_BxT=None):
  """(mean, nll, hit): the `Mean` of the NLL of `targets` weighted by `weights` (all 1 when
  None), its total differentiable, and each position's (nll, argmax hit) `[B, T]` float32 for
  metrics, with no gradient. The total's gradient is made in its forward pass (`_weighted`),
  so that chunks recompute no logits."""
  b, t, _ = hidden_BxTxD.shape
  w_DxV = model.unembedding()
  weights = (jnp.ones((b, t), jnp.float32) if weights_BxT is None
             else weights_BxT.astype(jnp.float32))
  total, stats_BxTx2 = _weighted(_chunk(model, hidden_BxTxD[:, :, None], w_DxV), hidden_BxTxD,
                                 w_DxV, targets_BxT, weights)
  stats_BxTx2 = jax.lax.stop_gradient(stats_BxTx2)
  return Mean(total, weights.sum()), stats_BxTx2[..., 0], stats_BxTx2[..., 1]


def pair_cross_entropy(model, pairs_BxTx2xD, targets_BxT, temperature: float | None = 1.0):
  """{"nll", "hit"} `[B, T, 2]` float32 of each position's two rows (hidden states `[B, T, 2,
  D]`: the teacher's, then its student's) against the position's target and, unless
  `temperature` is None, "soft" `[B, T]`: the student's -sum softmax(u/tau) log_softmax(z/tau)
  x tau^2, u the teacher row's logits (detached: the soft term sends the teacher no gradient)."""
  tau = None if temperature is None else float(temperature)
  return _head(model, pairs_BxTx2xD, targets_BxT, tau)


def _head(model, x_BxTxRxD, y_BxT, tau):
  w_DxV = model.unembedding()
  return _cross_entropy(_chunk(model, x_BxTxRxD, w_DxV), tau, x_BxTxRxD, w_DxV, y_BxT)


def _chunk(model, x_BxTxRxD, w_DxV) -> int:
  """The loss chunk (`chunk_size`) of `x`'s positions for the rows one device holds."""
  b, t, r, _ = x_BxTxRxD.shape
  rows = b // sharding.batch_shards(b)  # per device: the batch is split over a mesh's axes
  return chunk_size(model.run.loss_chunk, rows * r, t, w_DxV.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(chunk, tau, x_BxTxRxD, w_DxV, y_BxT):
  return _forward(chunk, tau, x_BxTxRxD, w_DxV, y_BxT)[0]


def _forward(chunk, tau, x_BxTxRxD, w_DxV, y_BxT):
  """The outputs, and what the backward keeps: softmax(z) (and, at tau != 1, the soft term's
  part) in the compute dtype (whole row) or each chunk's log-sum-exps."""
  t = x_BxTxRxD.shape[1]
  w_c = w_DxV.astype(x_BxTxRxD.dtype)
  if chunk >= t:
    z = _logits(x_BxTxRxD, w_c)
    out, lses = _stats(z, y_BxT, tau)
    dense = jax.tree.map(lambda a: a.astype(x_BxTxRxD.dtype), _dense(z, lses, tau))
    return out, ((x_BxTxRxD, y_BxT), w_DxV, dense)

  def chunk_stats(xy):
    x, y = xy
    return _stats(_logits(x, w_c), y, tau)

  out, lses = _map_packed(chunk_stats, _cut((x_BxTxRxD, y_BxT), chunk))  # lses: [n, B, C, R]
  return _join(out, t), ((x_BxTxRxD, y_BxT), w_DxV, lses)


def _backward(chunk, tau, res, ct):
  (x_BxTxRxD, y_BxT), w_DxV, kept = res
  t, d = x_BxTxRxD.shape[1], x_BxTxRxD.shape[-1]
  w_c = w_DxV.astype(x_BxTxRxD.dtype)
  cts = (ct["nll"], ct.get("soft"))  # the hit has no gradient
  if chunk >= t:
    dz = _dlogits(*kept, y_BxT, *cts, x_BxTxRxD.dtype)
    dx, dw = _head_grads(x_BxTxRxD, w_c, dz)
  else:
    per_position, unpack = _pack((_cut(cts, chunk), kept), 3)  # [n, B, C, S]: one slice a chunk

    def step(dw, xs):
      (x, y), packed = xs
      (a, c), lses = unpack(packed)
      dz = _dlogits(*_dense(_logits(x, w_c), lses, tau), y, a, c, x.dtype)
      dx, dw_c = _head_grads(x, w_c, dz)
      return dw + dw_c, dx

    xs = (_cut((x_BxTxRxD, y_BxT), chunk), per_position)
    dw, dx = jax.lax.scan(step, jnp.zeros((d, w_DxV.shape[1]), jnp.float32), xs)
    dx = _join(dx, t)
  return dx, dw.astype(w_DxV.dtype), None


_cross_entropy.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted(chunk, x_BxTxD, w_DxV, y_BxT, a_BxT):
  """(sum of a x nll `[]`, (nll, hit) `[B, T, 2]`) of the logits of `x`."""
  stats = _nll_hit(_cross_entropy(chunk, None, x_BxTxD[:, :, None], w_DxV, y_BxT))
  return jnp.sum(a_BxT * stats[..., 0]), stats


def _weighted_forward(chunk, x_BxTxD, w_DxV, y_BxT, a_BxT):
  """The outputs and the total's gradients (dx, and dw float32), one chunk's logits at a time:
  with its cotangent a scalar, the total's gradient is known before the backward pass, so the
  logits' gradient a (softmax(z) - onehot(y)) is made and used where z is."""
  t, d = x_BxTxD.shape[1:]
  w_c = w_DxV.astype(x_BxTxD.dtype)

  def one(x, y, a):  # [B, C, D], [B, C], [B, C] -> stats [B, C, 2], dx [B, C, D], dw [D, V]
    z = _logits(x[:, :, None], w_c)
    out, lses = _stats(z, y, None)
    p, _ = _dense(z, lses, None)
    dx, dw = _head_grads(x[:, :, None], w_c, _dlogits(p, None, y, a[..., None], None, x.dtype))
    return _nll_hit(out), dx[:, :, 0], dw

  if chunk >= t:
    stats, dx, dw = one(x_BxTxD, y_BxT, a_BxT)
  else:
    def step(dw, xya):
      stats, dx, dw_c = one(*xya)
      return dw + dw_c, (stats, dx)
    dw, (stats, dx) = jax.lax.scan(step, jnp.zeros((d, w_DxV.shape[1]), jnp.float32),
                                   _cut((x_BxTxD, y_BxT, a_BxT), chunk))
    stats, dx = _join((stats, dx), t)
  return (jnp.sum(a_BxT * stats[..., 0]), stats), (dx, dw, stats[..., 0], w_DxV)


def _nll_hit(out):
  """(nll, hit) `[B, T, 2]` of one row a position's outputs."""
  return jnp.stack([out["nll"][..., 0], out["hit"][..., 0]], -1)


def _weighted_backward(chunk, res, ct):
  dx, dw, nll, w_DxV = res
  g = ct[0]  # the (nll, hit) are returned without a gradient
  return (g * dx).astype(dx.dtype), (g * dw).astype(w_DxV.dtype), None, g * nll


_weighted.defvjp(_weighted_forward, _weighted_backward)


def _logits(x_BxCxRxD, w_c):
  """float32 logits `[B, C, R, V]` of each position's rows."""
  b, c, r, d = x_BxCxRxD.shape
  return project(x_BxCxRxD.reshape(b, c * r, d), w_c).reshape(b, c, r, w_c.shape[1])


def _stats(z_BxCxRxV, y_BxC, tau):
  """(outputs, log-sum-exps `[B, C, R]`) of one chunk's logits; with `tau`, a pair's soft term
  (row 1 against row 0) and, at tau != 1, both rows' log-sum-exps at tau."""
  m, s = _max_and_sum_exp(z_BxCxRxV)
  lse = m + jnp.log(s)
  r = z_BxCxRxV.shape[2]
  z_y = jnp.take_along_axis(z_BxCxRxV, jnp.broadcast_to(y_BxC[:, :, None, None],
                                                        (*y_BxC.shape, r, 1)), -1)[..., 0]
  out = {"nll": lse - z_y, "hit": (z_y >= m).astype(jnp.float32)}
  lses = {"z": lse}
  if tau is not None:
    u, z = z_BxCxRxV[:, :, 0], z_BxCxRxV[:, :, 1]  # the teacher's logits, the student's
    at_tau = lse if tau == 1 else _logsumexp(z_BxCxRxV / tau)  # [B, C, 2]
    if tau != 1:
      lses["tau"] = at_tau
    q = jnp.exp(u / tau - at_tau[..., :1])
    out["soft"] = tau * (tau * at_tau[..., 1] - jnp.sum(q * z, -1))
  return out, lses


def _max_and_sum_exp(z):
  """(max z, sum exp(z - max z)) over the last axis in one pass over the vocabulary (an online
  softmax's running pair, rescaled as the maximum grows)."""
  def combine(a, b):
    m = jnp.maximum(a[0], b[0])
    return m, a[1] * jnp.exp(a[0] - m) + b[1] * jnp.exp(b[0] - m)
  # the lowest finite float starts the maximum: identities combined give sum 0, not NaN
  init = (jnp.float32(jnp.finfo(jnp.float32).min), jnp.float32(0))
  return jax.lax.reduce((z, jnp.ones_like(z)), init, combine, (z.ndim - 1,))


def _logsumexp(z):
  m, s = _max_and_sum_exp(z)
  return m + jnp.log(s)


def _dense(z_BxCxRxV, lses, tau):
  """The logits' gradient parts that fill the vocabulary: softmax(z) `[B, C, R, V]` and, at
  tau != 1, the soft term's tau (softmax(z/tau) - softmax(u/tau)) `[B, C, V]` (else None:
  at tau = 1 it is the rows' softmaxes' difference)."""
  p = jnp.exp(z_BxCxRxV - lses["z"][..., None])
  if "tau" not in lses:
    return p, None
  q = jnp.exp(z_BxCxRxV / tau - lses["tau"][..., None])
  return p, tau * (q[:, :, 1] - q[:, :, 0])


def _dlogits(p_BxCxRxV, soft_BxCxV, y_BxC, a_BxCxR, c_BxC, dtype):
  """The logits' gradient `[B, C, R, V]` in `dtype`: a (p - onehot(y)), plus c x the soft part
  on the student's row; one elementwise pass (the one-hot compared in place)."""
  p = p_BxCxRxV.astype(jnp.float32)
  v = jax.lax.broadcasted_iota(jnp.int32, p.shape, 3)
  g = a_BxCxR[..., None] * jnp.where(v == y_BxC[:, :, None, None], p - 1.0, p)
  if c_BxC is not None:
    soft = p[:, :, 1] - p[:, :, 0] if soft_BxCxV is None else soft_BxCxV.astype(jnp.float32)
    g = jnp.stack([g[:, :, 0], g[:, :, 1] + c_BxC[..., None] * soft], 2)
  return g.astype(dtype)


def _einsum_f32(spec: str, a, b):
  """`einsum` accumulated and returned in float32. XLA:CPU's dot thunk has no 16-bit x 16-bit =
  float32 product, so a CPU casts the operands first: the same products (one of two 16-bit
  floats is exact in float32), summed in float32."""
  mixed = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  cast = lambda a, b: jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST)
  return jax.lax.platform_dependent(a, b, cpu=cast, default=mixed)


def _head_grads(x_BxCxRxD, w_c, dz_BxCxRxV):
  """(dx in x's dtype, dw float32 `[D, V]`) of the logits' gradient `dz`."""
  dx = _einsum_f32("bcrv,dv->bcrd", dz_BxCxRxV, w_c)
  dw = _einsum_f32("bcrd,bcrv->dv", x_BxCxRxD, dz_BxCxRxV)
  return dx.astype(x_BxCxRxD.dtype), dw


def _cut(tree, chunk: int):
  """`[B, T, ...]` leaves -> `[n, B, C, ...]`, T padded to n chunks of `chunk`."""
  def cut(x):
    b, t = x.shape[:2]
    n = -(-t // chunk)
    x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
  return jax.tree.map(cut, tree)


def _map_packed(fn, xs):
  """`lax.map(fn, xs)` for an `fn` giving float32 `[B, C, ...]` leaves, written as one array a
  chunk (one kernel, not one a leaf) and unpacked to `[n, B, C, ...]` leaves."""
  unpack = []

  def packed(x):
    flat, f = _pack(fn(x), 2)
    unpack.append(f)
    return flat
  flat = jax.lax.map(packed, xs)  # traces `packed`: sets the unpacker
  return unpack[0](flat)


def _pack(tree, r: int):
  """(one float32 array `[*P, S]`, its unpacker) of a pytree whose leaves share their first
  `r` dims P; the unpacker takes any leading dims in place of P."""
  leaves, treedef = jax.tree.flatten(tree)
  tails = [leaf.shape[r:] for leaf in leaves]
  flat = jnp.concatenate([leaf.reshape(*leaf.shape[:r], -1) for leaf in leaves], -1)

  def unpack(a):
    parts = jnp.split(a, np.cumsum([math.prod(tail) for tail in tails])[:-1], -1)
    return treedef.unflatten([p.reshape(*a.shape[:-1], *tail) for p, tail in zip(parts, tails)])
  return flat, unpack


def _join(tree, t: int):
  """`[n, B, C, ...]` leaves -> `[B, T, ...]` (the padding dropped)."""
  def join(y):
    n, b, c = y.shape[:3]
    return jnp.moveaxis(y, 0, 1).reshape(b, n * c, *y.shape[3:])[:, :t]
  return jax.tree.map(join, tree)
