"""Per-position losses through the output head in a few large kernels, so a loss holds the
float32 logits `[B, T, V]` of a whole row only while they fit (`RunControl.loss_chunk`).

`cross_entropy(model, hidden, targets_BxTxK, teacher, temperature)` gives each position's NLL
and argmax hit of K integer targets and, given a teacher's hidden states (projected by the same
head, detached), its soft cross entropy; `token_nll` is the one-target case every objective
uses (Jacobi Forcing takes two targets and the teacher). A custom VJP writes the gradient of
the logits z itself, with u the teacher's logits and tau the temperature:

  dz = sum_k dnll_k (softmax(z) - onehot(y_k)) + dsoft tau (softmax(z/tau) - softmax(u/tau))

so the targets need no scatter, and the hit is the target's logit being the largest (no argmax).
The max and the sum of exponentials come from one reduction (an online softmax's pair). The
chunk is `RunControl.loss_chunk` (`chunk_size`):
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


def token_nll(model, hidden_BxTxD, targets_BxT):
  """(nll, argmax hit) `[B, T]` float32 of `targets` under the logits of `hidden`."""
  out = cross_entropy(model, hidden_BxTxD, targets_BxT[..., None])
  return out["nll"][..., 0], out["hit"][..., 0]


def cross_entropy(model, hidden_BxTxD, targets_BxTxK, teacher_BxTxD=None,
                  temperature: float = 1.0) -> dict:
  """{"nll", "hit"} `[B, T, K]` float32 of K integer targets per position ("hit": the
  target's logit is the largest) and, with `teacher` (hidden states `[B, T, D]`, detached),
  "soft" `[B, T]`: -sum softmax(u/tau) log_softmax(z/tau) x tau^2, u the teacher's logits."""
  b, t, _ = hidden_BxTxD.shape
  w_DxV = model.unembedding()
  rows = b // sharding.batch_shards(b)  # per device: the batch is split over a mesh's axes
  chunk = chunk_size(model.run.loss_chunk, rows, t, w_DxV.shape[1])
  if teacher_BxTxD is not None:
    teacher_BxTxD = jax.lax.stop_gradient(teacher_BxTxD)
  return _cross_entropy(chunk, float(temperature), hidden_BxTxD, w_DxV, targets_BxTxK,
                        teacher_BxTxD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(chunk, tau, x_BxTxD, w_DxV, y_BxTxK, u_BxTxD):
  return _forward(chunk, tau, x_BxTxD, w_DxV, y_BxTxK, u_BxTxD)[0]


def _forward(chunk, tau, x_BxTxD, w_DxV, y_BxTxK, u_BxTxD):
  """The outputs, and what the backward keeps: the gradient's dense parts in the compute dtype
  (whole row) or each chunk's log-sum-exps."""
  t = x_BxTxD.shape[1]
  w_c = w_DxV.astype(x_BxTxD.dtype)
  inputs = (x_BxTxD, y_BxTxK, u_BxTxD)
  if chunk >= t:
    z, u = _logits(x_BxTxD, u_BxTxD, w_c)
    out, lses = _stats(z, y_BxTxK, u, tau)
    dense = jax.tree.map(lambda a: a.astype(x_BxTxD.dtype), _dense(z, u, lses, tau))
    return out, (inputs, w_DxV, dense)

  def chunk_stats(xyu):
    x, y, u = xyu
    z, u = _logits(x, u, w_c)
    return _stats(z, y, u, tau)

  out, lses = _map_packed(chunk_stats, _cut(inputs, chunk))  # lses: [n, B, C] each
  return _join(out, t), (inputs, w_DxV, lses)


def _backward(chunk, tau, res, ct):
  (x_BxTxD, y_BxTxK, u_BxTxD), w_DxV, kept = res
  _, t, d = x_BxTxD.shape
  w_c = w_DxV.astype(x_BxTxD.dtype)
  cts = (ct["nll"], ct.get("soft"))  # the hit has no gradient
  if chunk >= t:
    dz = _dlogits(*kept, y_BxTxK, *cts, x_BxTxD.dtype)
    dx, dw = _head_grads(x_BxTxD, w_c, dz)
  else:
    per_position, unpack = _pack((_cut(cts, chunk), kept), 3)  # [n, B, C, S]: one slice a chunk

    def step(dw, xs):
      (x, y, u), packed = xs
      (a, c), lses = unpack(packed)
      z, u = _logits(x, u, w_c)
      dx, dw_c = _head_grads(x, w_c, _dlogits(*_dense(z, u, lses, tau), y, a, c, x.dtype))
      return dw + dw_c, dx

    xs = (_cut((x_BxTxD, y_BxTxK, u_BxTxD), chunk), per_position)
    dw, dx = jax.lax.scan(step, jnp.zeros((d, w_DxV.shape[1]), jnp.float32), xs)
    dx = _join(dx, t)
  return dx, dw.astype(w_DxV.dtype), None, None


_cross_entropy.defvjp(_forward, _backward)


def _logits(x_BxCxD, u_BxCxD, w_c):
  """float32 logits `[B, C, V]` of the positions and of their teacher (None without one)."""
  return project(x_BxCxD, w_c), None if u_BxCxD is None else project(u_BxCxD, w_c)


def _stats(z_BxCxV, y_BxCxK, u_BxCxV, tau):
  """(outputs, log-sum-exps) of one chunk's logits `z` and teacher logits `u` (or None)."""
  m_BxC, s_BxC = _max_and_sum_exp(z_BxCxV)
  lse = m_BxC + jnp.log(s_BxC)
  z_y = jnp.take_along_axis(z_BxCxV, y_BxCxK, -1)
  out = {"nll": lse[..., None] - z_y, "hit": (z_y >= m_BxC[..., None]).astype(jnp.float32)}
  lses = {"z": lse}
  if u_BxCxV is not None:
    lses["z_tau"] = lse if tau == 1 else _logsumexp(z_BxCxV / tau)
    lses["u_tau"] = _logsumexp(u_BxCxV / tau)
    q = jnp.exp(u_BxCxV / tau - lses["u_tau"][..., None])
    out["soft"] = tau * (tau * lses["z_tau"] - jnp.sum(q * z_BxCxV, -1))
  return out, lses


def _max_and_sum_exp(z_BxCxV):
  """(max z, sum exp(z - max z)) `[B, C]` in one pass over the vocabulary (an online
  softmax's running pair, rescaled as the maximum grows)."""
  def combine(a, b):
    m = jnp.maximum(a[0], b[0])
    return m, a[1] * jnp.exp(a[0] - m) + b[1] * jnp.exp(b[0] - m)
  # the lowest finite float starts the maximum: identities combined give sum 0, not NaN
  init = (jnp.float32(jnp.finfo(jnp.float32).min), jnp.float32(0))
  return jax.lax.reduce((z_BxCxV, jnp.ones_like(z_BxCxV)), init, combine, (2,))


def _logsumexp(z_BxCxV):
  m_BxC, s_BxC = _max_and_sum_exp(z_BxCxV)
  return m_BxC + jnp.log(s_BxC)


def _dense(z_BxCxV, u_BxCxV, lses, tau):
  """The logits' gradient parts that fill the vocabulary: softmax(z) and, with a teacher,
  tau (softmax(z/tau) - softmax(u/tau)) (None without)."""
  p = jnp.exp(z_BxCxV - lses["z"][..., None])
  if u_BxCxV is None:
    return p, None
  p_tau = p if tau == 1 else jnp.exp(z_BxCxV / tau - lses["z_tau"][..., None])
  return p, tau * (p_tau - jnp.exp(u_BxCxV / tau - lses["u_tau"][..., None]))


def _dlogits(p_BxCxV, soft_BxCxV, y_BxCxK, a_BxCxK, c_BxC, dtype):
  """The logits' gradient `[B, C, V]` in `dtype`: sum_k a_k (p - onehot(y_k)) + c soft, one
  elementwise pass (the one-hots compared in place)."""
  g = p_BxCxV.astype(jnp.float32) * jnp.sum(a_BxCxK, -1)[..., None]
  v = jax.lax.broadcasted_iota(jnp.int32, p_BxCxV.shape, 2)
  for k in range(y_BxCxK.shape[-1]):
    g = g - jnp.where(v == y_BxCxK[..., k:k + 1], a_BxCxK[..., k:k + 1], 0.0)
  if soft_BxCxV is not None:
    g = g + c_BxC[..., None] * soft_BxCxV.astype(jnp.float32)
  return g.astype(dtype)


def _einsum_f32(spec: str, a, b):
  """`einsum` accumulated and returned in float32. XLA:CPU's dot thunk has no 16-bit x 16-bit =
  float32 product, so a CPU casts the operands first: the same products (one of two 16-bit
  floats is exact in float32), summed in float32."""
  mixed = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  cast = lambda a, b: jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST)
  return jax.lax.platform_dependent(a, b, cpu=cast, default=mixed)


def _head_grads(x_BxCxD, w_c, dz_BxCxV):
  """(dx in x's dtype, dw float32 `[D, V]`) of the logits' gradient `dz`."""
  dx = _einsum_f32("bcv,dv->bcd", dz_BxCxV, w_c)
  dw = _einsum_f32("bcd,bcv->dv", x_BxCxD, dz_BxCxV)
  return dx.astype(x_BxCxD.dtype), dw


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
