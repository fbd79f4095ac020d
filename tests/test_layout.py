"""The training state stacked by layer (`training/run/layout.py`): `stack` and `unstack`
round-trip params and optimizer state; the stacked step makes the same update as the
per-layer one (AdamW, its decay mask, clipping, schedule; with gradient accumulation too);
a stacked layer axis is never split on a mesh; checkpoints hold the per-layer tree, restore
into either layout, and a per-layer checkpoint resumes a stacked run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import paraflax as pf
from paraflax.parallel import sharding
from paraflax.training import get_objective
from paraflax.training.config.train import OptimConfig
from paraflax.training.run import layout, optim
from paraflax.training.run.step import init_opt_state, stack_params, train_step
from paraflax.training.workdirs.checkpoint import Checkpoints
from conftest import MICRO

CFG = pf.ModelConfig(**{**MICRO, "n_layers": 3}, qkv_bias=True)
OPTIM = OptimConfig(peak_lr=1e-2, warmup_steps=1, weight_decay=0.1, grad_clip_norm=0.5)


@functools.cache
def _model():
  return nnx.split(pf.Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)


def _batch(seed: int) -> dict:
  return {"tokens": jax.random.randint(jax.random.key(seed), (4, 16), 0, CFG.vocab_size)}


def _assert_trees_close(a, b, **tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.fast
def test_stack_and_unstack_round_trip_params_and_optimizer_state():
  _, params = _model()
  stacked = stack_params(params)
  wq = stacked["layers"]["attn"]["wq"]
  assert wq[...].shape == (3, *params["layers"][0]["attn"]["wq"][...].shape)
  assert wq.get_metadata()["out_sharding"] == (None, "embed", "heads", None)
  assert layout.is_stacked(stacked) and not layout.is_stacked(params)
  assert len(jax.tree.leaves(stacked)) == 3 + 12  # embed, final norm, lm_head + 12 kinds
  _assert_trees_close(layout.unstack(stacked), params, rtol=0, atol=0)
  assert layout.per_layer(params) is params
  tx = optim.optimizer(OPTIM, 10)
  opt = tx.init(params)
  _assert_trees_close(layout.unstack(layout.stack(opt)), opt, rtol=0, atol=0)
  assert jax.tree.structure(layout.stack(opt)) == jax.tree.structure(tx.init(stacked))


@pytest.mark.fast
def test_the_decay_mask_is_the_per_layer_one_in_either_layout():
  _, params = _model()
  flat = dict(nnx.to_flat_state(params))
  stacked = dict(nnx.to_flat_state(optim._decay_mask(layout.stack(params))))
  for path, decays in nnx.to_flat_state(optim._decay_mask(params)):
    assert decays.get_value() == (flat[path][...].ndim >= 2)  # matrices and biases, not norm scales
    kind = (path[0], *path[2:]) if path[0] == "layers" else path
    assert stacked[kind].get_value() == decays.get_value(), path


@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.fast), 2])
def test_the_stacked_step_makes_the_per_layer_update(accum):
  graphdef, params = _model()
  tx = optim.optimizer(OPTIM, 10)
  step = jax.jit(functools.partial(train_step, graphdef, loss_fn=get_objective("ar"), tx=tx,
                                   accum=accum))
  per = (params, tx.init(params))
  stacked = layout.stack(per)
  for i in range(3):  # warmup, then decay: the schedule's count advances alike
    *per, m_per = step(*per, _batch(i), jax.random.key(i))
    *stacked, m_stacked = step(*stacked, _batch(i), jax.random.key(i))
    _assert_trees_close(m_stacked, m_per, rtol=1e-5)
  assert layout.is_stacked(stacked[0])
  # atol: the key bias's gradient is zero but for rounding, which Adam scales up to ~lr
  _assert_trees_close(layout.unstack(tuple(stacked)), tuple(per), rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_a_stacked_leaf_keeps_its_layer_axis_whole_on_a_mesh():
  _, params = _model()
  mesh = AbstractMesh((2, 2, 2), sharding.AXES)
  stacked = jax.eval_shape(layout.stack, params)
  specs = sharding.state_shardings(stacked, mesh)
  assert specs["layers"]["attn"]["wq"].spec == P(None, "fsdp", "tensor", None)
  assert specs["layers"]["mlp"]["w_down"].spec == P(None, "tensor", "fsdp")
  opt_specs = sharding.state_shardings(jax.eval_shape(optim.optimizer(OPTIM, 10).init,
                                                      stacked), mesh)
  assert opt_specs[1][0].mu["layers"]["mlp"]["w_up"].spec == P(None, "fsdp", "tensor")


@pytest.mark.fast
def test_checkpoints_hold_the_per_layer_tree_and_restore_either_layout(tmp_path):
  _, params = _model()
  tx = optim.optimizer(OPTIM, 10)
  stacked = stack_params(params)
  opt = init_opt_state(tx, stacked)
  ckpt = Checkpoints(tmp_path)
  ckpt.save(1, stacked, opt, {"pos": 1})
  ckpt.save(2, params, layout.unstack(opt), {"pos": 2})  # a per-layer (older) run's save
  ckpt.wait()
  for step in (1, 2):
    # on disk: the per-layer tree, as `load_trained` and exports read it
    _assert_trees_close(ckpt.restore_params(step, params), params, rtol=0, atol=0)
    got_p, got_o, data = ckpt.restore(step, stacked, opt)
    assert data == {"pos": step}
    _assert_trees_close((got_p, got_o), (stacked, opt), rtol=0, atol=0)
    for got, want in zip(jax.tree.leaves(got_p), jax.tree.leaves(stacked)):
      assert got.sharding == want.sharding
  assert ckpt.restore_latest(stacked, opt)[0] == 2
  ckpt.close()


@pytest.mark.fast
def test_a_resumed_stacked_run_repeats_an_uninterrupted_one(tmp_path):
  graphdef, params = _model()
  tx = optim.optimizer(OPTIM, 10)
  step = jax.jit(functools.partial(train_step, graphdef, loss_fn=get_objective("ar"), tx=tx))
  state = (stack_params(params), init_opt_state(tx, stack_params(params)))
  ckpt = Checkpoints(tmp_path)
  for i in range(4):
    if i == 2:
      ckpt.save(2, *state, {})
      resumed = ckpt.restore_latest(*jax.tree.map(jnp.zeros_like, state))[1][:2]
    state = step(*state, _batch(i), jax.random.key(i))[:2]
    if i >= 2:
      resumed = step(*resumed, _batch(i), jax.random.key(i))[:2]
  ckpt.close()
  _assert_trees_close(resumed, state, rtol=0, atol=0)
