"""Head losses (`head_loss.py`, `RunControl.loss_chunk`): `token_nll`'s, `pair_cross_entropy`'s
and `weighted_nll`'s outputs and gradients, whole row and chunked, equal plain autodiff over
the full logits; every objective's loss, metrics and gradients with a chunk that does not
divide the row equal the whole-row path; the whole row's gradient recomputes no logits; and the
chunked step's temporaries stay far below the full-logits figure at a large vocabulary."""

import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import paraflax as pf
from paraflax.training import get_objective, load_config
from paraflax.training.config.overrides import apply_overrides
from paraflax.training.config.train import config_differences
from paraflax.training.objectives import head_loss
from paraflax.training.objectives import jacobi_forcing as jf
from conftest import MICRO

pytestmark = pytest.mark.fast


def _params(**overrides):
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  return nnx.split(pf.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def _graphdef(run: pf.RunControl, **overrides):
  """The graphdef of a model config computed as `run` says, built abstractly (nothing
  computed)."""
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  return nnx.split(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0), run=run)),
                   nnx.Param)[0]


def _teacher_rows():
  tokens = np.random.default_rng(0).integers(4, 48, (3, 14)).astype(np.int32)
  return {"tokens": jnp.asarray(tokens), "prompt_lens": jnp.array([2, 5, 3], jnp.int32),
          "lengths": jnp.array([14, 9, 12], jnp.int32)}


def _jacobi_rows():
  """Two rows of 19 slots: prompt region 7 (`prompt_len`), streams of 2 blocks of 3."""
  r = np.random.default_rng(1)
  rows = []
  for p in (3, 5):  # unequal prompts: pairs sit at other offsets in each row
    clean = r.integers(4, 48, (2, 3))
    noisy = np.where(r.random((2, 3)) < 0.5, clean, r.integers(4, 48, (2, 3)))
    rows.append(jf.example(r.integers(4, 48, p), noisy, clean, 19))
  return {k: jnp.asarray(np.stack([a[k], b[k]])) for k, (a, b) in
          ((k, (rows[0], rows[1])) for k in rows[0])}


TOKENS = {"tokens": jnp.asarray(np.random.default_rng(2).integers(0, 48, (2, 13)), jnp.int32)}
CASES = {  # name: (objective args, model overrides, batch)
    "ar": ({}, {}, {**_teacher_rows()}),
    "tidar": ({"block_size": [2, 4]}, {"mask_token_id": 2}, TOKENS),
    "asarm": ({}, {"two_stream": True}, {**TOKENS, "step": jnp.array([7, 7])}),
    "jacobi_forcing": ({"prompt_len": 7}, {}, _jacobi_rows()),
    "jacobi_forcing_hard": ({"consistency": "hard", "prompt_len": 7}, {}, _jacobi_rows()),
    "deer_stage1": ({}, {"mask_token_id": 2, "sep_token_id": 3}, _teacher_rows()),
    "deer_stage2": ({"blocks": 2, "max_masked": 4}, {"mask_token_id": 2, "sep_token_id": 3},
                    _teacher_rows()),
}


def assert_grads_close(got, want):
  """Gradient pytrees equal within 1e-5 of each leaf's largest entry."""
  for g, gc in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    scale = float(jnp.abs(g).max()) + 1e-12
    np.testing.assert_allclose(gc / scale, g / scale, atol=1e-5)


def assert_step_close(got, want):
  """Two `value_and_grad(loss, has_aux=True)` results, ((loss, metrics), grads): loss and
  metrics within 1e-5 relative, gradients as `assert_grads_close`."""
  (loss, metrics), grads = want
  (loss_c, metrics_c), grads_c = got
  np.testing.assert_allclose(loss_c, loss, rtol=1e-5)
  for k in metrics:
    np.testing.assert_allclose(metrics_c[k], metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert_grads_close(grads_c, grads)


def _reference(x_BxTxRxD, w_DxV, y_BxT, tau):
  """The head's outputs from the full float32 logits, by optax and plain autodiff."""
  z = jnp.einsum("btrd,dv->btrv", x_BxTxRxD, w_DxV)
  y = jnp.broadcast_to(y_BxT[..., None], z.shape[:-1])
  out = {"nll": optax.softmax_cross_entropy_with_integer_labels(z, y),
         "hit": (jnp.argmax(z, -1) == y).astype(jnp.float32)}
  if tau is not None:  # the student (row 1) against the teacher's (row 0) detached logits
    u = jax.lax.stop_gradient(z[:, :, 0])
    out["soft"] = -jnp.sum(jax.nn.softmax(u / tau) * jax.nn.log_softmax(z[:, :, 1] / tau),
                           -1) * tau ** 2
  return out


def _fused(chunk):
  """The head as `head_loss` computes it: `token_nll` for one row a position, else
  `pair_cross_entropy`."""
  def run(x_BxTxRxD, w_DxV, y_BxT, tau):
    model = types.SimpleNamespace(unembedding=lambda: w_DxV, run=pf.RunControl(loss_chunk=chunk))
    if x_BxTxRxD.shape[2] == 1:
      nll, hit = head_loss.token_nll(model, x_BxTxRxD[:, :, 0], y_BxT)
      return {"nll": nll[..., None], "hit": hit[..., None]}
    return head_loss.pair_cross_entropy(model, x_BxTxRxD, y_BxT, tau)
  return run


def _inputs(r: int):
  """x `[2, 13, r, 8]`, w `[8, 50]`, targets, weights of the outputs; the targets include
  some rows' argmax (hits) and the largest and smallest ids."""
  g = np.random.default_rng(0)
  x, w = g.normal(size=(2, 13, r, 8)).astype(np.float32), g.normal(size=(8, 50)).astype(np.float32)
  y = g.integers(0, 50, (2, 13))
  y[:, :4] = np.argmax(x @ w, -1)[:, :4, 0]
  y[0, 5], y[1, 5] = 0, 49
  coefs = {"nll": g.normal(size=(2, 13, r)), "hit": g.normal(size=(2, 13, r)),
           "soft": g.normal(size=(2, 13))}
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(y, jnp.int32), coefs


@pytest.mark.parametrize("r, tau", [(1, None), (2, None), (2, 1.0), (2, 2.0)])
@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_head_equals_autodiff_of_the_full_logits(r, tau, chunk):
  """Outputs and gradients (x, w) within 1e-5 in float32, whole row (None) and in chunks (5:
  not dividing the 13 positions); the soft term sends the teacher row no gradient."""
  x, w, y, coefs = _inputs(r)

  def loss(fn, names=tuple(coefs)):
    def value(x, w):
      out = fn(x, w, y, tau)
      return sum(jnp.sum(out[n] * coefs[n]) for n in names if n in out) + 0.0, out
    return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))

  with jax.default_matmul_precision("highest"):
    (_, want), grads = loss(_reference)(x, w)
    (_, got), grads_c = loss(_fused(chunk))(x, w)
    soft_dx = loss(_fused(chunk), ("soft",))(x, w)[1][0] if tau is not None else None
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert_grads_close(grads_c, grads)
  if tau is not None:
    assert not np.any(soft_dx[:, :, 0]) and np.any(soft_dx[:, :, 1])


def _dots(jaxpr) -> int:
  """dot_generals of a jaxpr, those of the jaxprs inside it (loop bodies) counted once; of a
  `cond`'s branches (one per platform, `lax.platform_dependent`) the one that has most."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "dot_general"
    subs = [_dots(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
    n += (max(subs, default=0) if eqn.primitive.name == "cond" else sum(subs))
  return n


@pytest.mark.parametrize("r, tau", [(1, None), (2, 1.0), (2, 2.0)])
@pytest.mark.parametrize("chunk, dots", [(None, 3), (5, 4)])
def test_the_whole_row_gradient_recomputes_no_logits(r, tau, chunk, dots):
  """Whole row: the head's forward and its two gradient matmuls; chunked: each chunk's logits
  once more in the backward pass. A pair's teacher is projected with its student, once."""
  x, w, y, _ = _inputs(r)
  grad = jax.grad(lambda x, w: sum(jnp.sum(v) for v in _fused(chunk)(x, w, y, tau).values()),
                  (0, 1))
  assert _dots(jax.make_jaxpr(grad)(x, w).jaxpr) == dots


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_weighted_nll_equals_autodiff_of_the_full_logits(chunk):
  """`weighted_nll`: its total and its gradients (x, w and the weights) within 1e-5 in float32,
  whole row and in chunks, its gradient made in the forward pass: three matmuls, the loop
  body's once; the per-position NLL carries no gradient."""
  x, w, y, coefs = _inputs(1)
  x, a = x[:, :, 0], jnp.asarray(np.abs(coefs["nll"][..., 0]), jnp.float32)
  model = lambda w: types.SimpleNamespace(unembedding=lambda: w,
                                          run=pf.RunControl(loss_chunk=chunk))

  def fused(x, w, a):
    mean, nll, hit = head_loss.weighted_nll(model(w), x, y, a)
    return 2.5 * mean.total + jnp.sum(nll) + jnp.sum(hit), mean.count

  def reference(x, w, a):
    nll = _reference(x[:, :, None], w, y, None)["nll"][..., 0]
    return 2.5 * jnp.sum(a * nll) + jnp.sum(jax.lax.stop_gradient(nll)), jnp.sum(a)

  with jax.default_matmul_precision("highest"):
    (got, count), grads_c = jax.jit(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))(x, w, a)
    (want, _), grads = jax.value_and_grad(reference, (0, 1, 2), has_aux=True)(x, w, a)
  hits = _reference(x[:, :, None], w, y, None)["hit"].sum()
  np.testing.assert_allclose(got - hits, want, rtol=1e-5)
  np.testing.assert_allclose(count, a.sum(), rtol=1e-6)
  assert_grads_close(grads_c, grads)
  total = lambda x, w: head_loss.weighted_nll(model(w), x, y, a)[0].total
  assert _dots(jax.make_jaxpr(jax.grad(total, (0, 1)))(x, w).jaxpr) == 3


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_loss_and_gradients_equal_the_whole_row(name):
  args, overrides, batch = CASES[name]
  loss_fn = get_objective(name.removesuffix("_hard"), args)
  graphdef, params = _params(**overrides)
  chunked = _graphdef(pf.RunControl(loss_chunk=5), **overrides)

  @jax.jit
  def run(p):
    def value(g):
      return jax.value_and_grad(lambda q: loss_fn(nnx.merge(g, q), batch, jax.random.key(3)),
                                has_aux=True)(p)
    return value(graphdef), value(chunked)

  whole, chunked = run(params)
  assert_step_close(chunked, whole)


def test_chunked_step_temporaries_are_far_below_the_full_logits():
  """AR at vocab 65536, 256 positions: logits [1, 256, V] float32 are 64 MiB; chunks of 16
  positions hold a sixteenth of them (what remains: the [V, D] head and its gradients)."""
  cfg = pf.ModelConfig(**{**MICRO, "vocab_size": 65536, "max_seq_len": 256})
  batch = {"tokens": jax.ShapeDtypeStruct((1, 256), jnp.int32)}
  loss_fn = get_objective("ar")

  def temp(run):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0),
                                                                       run=run)))
    grad = jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b, None)[0])
    return jax.jit(grad).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  full, chunked = temp(pf.RunControl()), temp(pf.RunControl(loss_chunk=16))
  assert full > 2 * 64 * 2**20  # logits and their gradient
  assert chunked < 0.2 * full, (chunked, full)


def test_auto_chunk_takes_the_row_while_logits_are_small():
  assert head_loss.chunk_size(None, 8, 256, 512) == 256  # demo shapes: one pass
  assert head_loss.chunk_size(None, 1, 4096, 151936) == 410  # 10 chunks of <= 256 MiB
  assert head_loss.chunk_size(7, 2, 5, 48) == 5
  with pytest.raises(ValueError, match="loss_chunk must be an int >= 1 or None"):
    pf.RunControl(loss_chunk=0)


def test_loss_chunk_is_run_control_and_settable():
  cfg = load_config("micro_ar")
  other = apply_overrides(cfg, {"run.loss_chunk": "64"})
  assert other.run.loss_chunk == 64 and config_differences(cfg, other) == []
  old = cfg.to_dict()
  del old["run"]["loss_chunk"]  # a config saved before the setting existed
  assert pf.training.TrainConfig.from_dict(old) == cfg
