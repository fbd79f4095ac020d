"""Gradient accumulation (`TrainConfig.grad_accum`, `accumulate.py`): k micro-batches holding
unequal numbers of targets give the update, loss and metrics of one batch k times larger (a
mean of micro-batch means would not); bf16 compute keeps float32 master weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_head_loss import _jacobi_rows, _teacher_rows

import paraflax as pf
from paraflax.training import apply_overrides, dry_run, get_objective, load_config
from paraflax.training.config.recipes import RECIPES
from paraflax.training.run.accumulate import split
from paraflax.training.run.step import train_step
from conftest import MICRO


def _ar_rows():
  rows = _teacher_rows()  # 3 rows of 12, 4 and 9 answer tokens, plus one of 1
  more = {"tokens": rows["tokens"][:1], "prompt_lens": jnp.array([12], jnp.int32),
          "lengths": jnp.array([14], jnp.int32)}
  return {k: jnp.concatenate([rows[k], more[k]]) for k in rows}


def _jf_rows():
  rows = _jacobi_rows()
  return {k: jnp.concatenate([v, v[:, ::-1] if k == "kl_weights" else v]) for k, v in rows.items()}


# rows, micro-batches, objective arguments (Jacobi Forcing's rows: prompt region 7)
CASES = {"ar": (_ar_rows, 4, {}), "jacobi_forcing": (_jf_rows, 2, {"prompt_len": 7})}


@functools.cache
def _model():
  return nnx.split(pf.Transformer(pf.ModelConfig(**MICRO), rngs=nnx.Rngs(0)), nnx.Param)


def _steps(name):
  graphdef, params = _model()
  tx = optax.sgd(1.0)  # the update is minus the gradient
  loss_fn = get_objective(name, CASES[name][2])
  step = jax.jit(functools.partial(train_step, graphdef, loss_fn=loss_fn, tx=tx),
                 static_argnames="accum")
  return graphdef, params, tx.init(params), step


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(CASES))
def test_accumulated_micro_batches_equal_one_big_batch(name):
  rows, k, _ = CASES[name]
  batch = rows()
  _, params, opt, step = _steps(name)
  whole = step(params, opt, batch, jax.random.key(0), accum=1)
  got = step(params, opt, batch, jax.random.key(0), accum=k)
  for what, a, b in zip(("params", "metrics"), (whole[0], whole[2]), (got[0], got[2])):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=what)
  assert set(got[2]) == set(whole[2])


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_mean_of_micro_batch_means_differs_there(name):
  """What `optax.MultiSteps` computes: the test batches do hold unequal target counts."""
  batch = CASES[name][0]()
  graphdef, params, _, _ = _steps(name)
  loss_fn = get_objective(name, CASES[name][2])
  loss = jax.jit(lambda b: loss_fn(nnx.merge(graphdef, params), b, None)[0])
  micro = split(batch, 2)
  means = [loss({k: v[i] for k, v in micro.items()}) for i in range(2)]
  assert abs(float(np.mean(means)) - float(loss(batch))) > 1e-3


@pytest.mark.fast
def test_counts_pass_runs_no_forward():
  """The micro-batch counts are traced with a forward whose outputs are unused: XLA drops it
  (measured: 0.508 of the whole batch's flops at k=2, not ~0.67 with a forward more)."""
  batch = _ar_rows()
  _, params, opt, step = _steps("ar")
  flops = {k: step.lower(params, opt, batch, jax.random.key(0), accum=k).compile()
           .cost_analysis()["flops"] for k in (1, 2)}
  # XLA counts a loop body once: two micro-batches of half the rows, one pass
  assert flops[2] < 0.55 * flops[1], flops


@pytest.mark.fast
def test_bf16_compute_keeps_float32_master_weights():
  batch = _ar_rows()
  graphdef, params = nnx.split(pf.Transformer(pf.ModelConfig(**MICRO, dtype="bfloat16"),
                                              rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-2)
  step = jax.jit(functools.partial(train_step, graphdef, loss_fn=get_objective("ar"), tx=tx,
                                   accum=2))
  opt, losses = tx.init(params), []
  for i in range(6):
    params, opt, metrics = step(params, opt, batch, jax.random.key(i))
    losses.append(float(metrics["loss"]))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


def test_grad_accum_is_checked_run_control_and_shows_in_the_dry_run():
  cfg = load_config(RECIPES / "micro_ar.py")  # batch_size 8
  for bad in ("3", "0"):
    with pytest.raises(ValueError, match="grad_accum must be >= 1 and divide") as e:
      apply_overrides(cfg, {"grad_accum": bad})
    assert "\n" not in str(e.value)
  one, four = (dry_run(apply_overrides(cfg, {"grad_accum": k})) for k in ("1", "4"))
  assert four["grad_accum"] == 4 and four["temp_bytes"] < one["temp_bytes"]
  with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
    split({"tokens": jnp.zeros((4, 2))}, 3)
