"""Sharded runs equal single-device runs, on 8 forced CPU devices.

Not collected by default: `test_sharding.py` runs this file in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set before JAX starts,
and the main test process already runs JAX on one device).
"""

import dataclasses
import functools
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import paraflax as pf
from paraflax.decoding.generate import TRACES
from paraflax.parallel import sharding
from paraflax.training import load_config, load_trained, read_metrics, train
from paraflax.training.config.recipes import RECIPES
from paraflax.training.objectives.protocol import get_objective
from paraflax.training.run.dry_run import dry_run_from_config_path
from paraflax.training.run.trainer import init_opt_state, jit_train_step, train_step
from paraflax.training.workdirs.checkpoint import Checkpoints
from conftest import compiled_micro_model

MESHES = [(8, 1, 1), (2, 2, 2), (1, 1, 8)]
PROMPTS = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3], [11], [3, 3, 3, 3], [1, 2, 1, 2, 1, 2],
           [40], [8, 9], [20, 21, 22, 20, 21]]  # 8 rows of different lengths
DECODERS = [pf.decoders.AR(), pf.decoders.PromptLookup(max_ngram=2, num_tokens=4)]
NEW = 12


def test_eight_devices():
  assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


@pytest.fixture(scope="module")
def model():
  """conftest's micro model, 1 layer (compile time), built by compiled calls."""
  return compiled_micro_model(n_layers=1)


# ---------------------------------------------------------------- one training step

@pytest.fixture(scope="module")
def step_setup(model):
  graphdef, params = nnx.split(model, nnx.Param)
  # SGD with momentum, not AdamW: Adam's first update lr * g / (|g| + eps) turns reduction-order
  # noise in a near-zero gradient into 1e-5-scale parameter differences (an lm_head entry
  # with g = -1.45e-7 sharded vs -1.48e-7 on one device moved 2.5e-5 apart) and hides
  # gradient-magnitude errors; this update is linear in the gradient and has a sharded state
  tx = optax.sgd(1e-2, momentum=0.9)
  loss_fn = get_objective("ar")
  batch = {"tokens": np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 48), np.int32)}
  rng = jax.random.key(2)
  step = jax.jit(functools.partial(train_step, graphdef, loss_fn=loss_fn, tx=tx))
  ref = step(params, tx.init(params), batch, rng)
  return graphdef, params, tx, loss_fn, batch, rng, ref


@pytest.mark.parametrize("shape", MESHES)
def test_train_step_equals_one_device(shape, step_setup):
  graphdef, params, tx, loss_fn, batch, rng, (ref_params, _, ref_metrics) = step_setup
  mesh = sharding.make_mesh(shape)
  sharded = sharding.shard_state(params, mesh)
  opt_state = init_opt_state(tx, sharded, mesh)
  step = jit_train_step(graphdef, loss_fn, tx, mesh, sharded, opt_state)
  want = sharding.state_shardings(sharded, mesh)
  new_params, _, metrics = step(sharded, opt_state, sharding.shard_batch(batch, mesh),
                                      sharding.put(rng, sharding.replicated(mesh)))
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-4)
  for got, ref in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
  # params stay sharded by the rules, step after step
  for got, s in zip(jax.tree.leaves(new_params), jax.tree.leaves(want)):
    assert got.sharding.is_equivalent_to(s, got.ndim)
  wq = new_params["layers"][0]["attn"]["wq"][...]
  expect = {(8, 1, 1): P(None, None, None), (2, 2, 2): P("fsdp", "tensor", None),
            (1, 1, 8): P(None, None, None)}[shape]  # 4 heads do not split 8 ways: replicated
  assert wq.sharding.spec == expect
  assert new_params["layers"][0]["mlp"]["w_up"][...].sharding.spec == {
      (8, 1, 1): P(None, None), (2, 2, 2): P("fsdp", "tensor"), (1, 1, 8): P(None, "tensor")}[shape]


# ---------------------------------------------------------------- generation

@pytest.fixture(scope="module")
def gen_setup(model):
  refs = [pf.generate(model, PROMPTS, decoder=d, max_new_tokens=NEW) for d in DECODERS]
  return model, refs


@pytest.mark.parametrize("shape", MESHES)
def test_every_decoder_on_a_mesh_equals_one_device(shape, gen_setup):
  model, refs = gen_setup
  mesh = sharding.make_mesh(shape)
  for decoder, ref in zip(DECODERS, refs):
    out = pf.generate(model, PROMPTS, decoder=decoder, max_new_tokens=NEW, mesh=mesh)
    assert out.tokens.sharding.is_fully_replicated
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.forwards, ref.forwards)
    # still one compiled while_loop: new prompts and seeds on the same mesh do not retrace
    before = TRACES[type(decoder).__name__]
    pf.generate(model, PROMPTS[::-1], decoder=decoder, max_new_tokens=NEW, mesh=mesh,
                rng=jax.random.key(5))
    assert TRACES[type(decoder).__name__] == before


@pytest.mark.parametrize("shape", MESHES)
def test_kv_cache_is_split_over_batch_and_kv_heads_where_they_divide(shape, gen_setup):
  model, refs = gen_setup
  mesh = sharding.make_mesh(shape)
  state = next(pf.generate_steps(model, PROMPTS, max_new_tokens=NEW, mesh=mesh))
  # 2 kv heads: split 2 ways on (2,2,2), replicated (not refused) on an 8-way tensor axis
  expect = {(8, 1, 1): P(None, "data", None, None, None),
            (2, 2, 2): P(None, ("data", "fsdp"), None, "tensor", None),
            (1, 1, 8): P(None, None, None, None, None)}[shape]
  assert state.cache.k.sharding.is_equivalent_to(NamedSharding(mesh, expect), 5)
  assert state.tokens.sharding.is_equivalent_to(NamedSharding(mesh, P(expect[1])), 2)
  # the same specs when a host copy of the state is placed outside jit
  host = jax.tree.map(lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                      else np.asarray(x), state)
  placed = sharding.shard_decode_state(host, mesh)
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(state)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  if shape == (2, 2, 2):  # the Python-loop twin on a mesh agrees with the while loop
    out = pf.generate(model, PROMPTS, max_new_tokens=NEW, mesh=mesh, loop="python")
    np.testing.assert_array_equal(out.tokens, refs[0].tokens)


# ---------------------------------------------------------------- the meshes users make

def user_meshes():
  """(mesh, axis_rules) as users make them: JAX's default Explicit axes, Auto axes with their
  own names."""
  return {"explicit data/model": (jax.make_mesh((2, 4), ("data", "model")), {"tensor": "model"}),
          "explicit data/fsdp/tensor": (jax.make_mesh((2, 2, 2), sharding.AXES), None),
          "auto replica/model": (jax.make_mesh((2, 4), ("replica", "model"),
                                               axis_types=(AxisType.Auto,) * 2),
                                 {"data": "replica", "tensor": "model"})}


@pytest.mark.parametrize("batch", [2, 8])  # the sizes that crashed on Explicit meshes
def test_meshes_users_make_equal_one_device(batch, gen_setup):
  model, refs = gen_setup
  prompts = PROMPTS[:batch]
  ref = jax.tree.map(lambda x: x[:batch], refs[0])  # rows of the one-device AR run
  runs = {kind: pf.generate(model, prompts, max_new_tokens=NEW, mesh=mesh, axis_rules=rules)
          for kind, (mesh, rules) in user_meshes().items()}
  explicit = user_meshes()["explicit data/fsdp/tensor"][0]
  assert explicit.are_all_axes_explicit
  with jax.set_mesh(explicit):  # generate inside the user's own mesh context
    runs["inside jax.set_mesh"] = pf.generate(model, prompts, max_new_tokens=NEW)
    if batch == 8:  # and its Python-loop twin (compiled by the cache test)
      runs["set_mesh, python loop"] = pf.generate(model, prompts, max_new_tokens=NEW,
                                                  loop="python")
    # outputs come back on the user's mesh: their own code under it takes them
    jax.jit(lambda t: t + 1)(runs["inside jax.set_mesh"].tokens)
  for kind, out in runs.items():
    assert out.tokens.sharding.is_fully_replicated, kind
    np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=kind)
    np.testing.assert_array_equal(out.lengths, ref.lengths, err_msg=kind)
    np.testing.assert_array_equal(out.forwards, ref.forwards, err_msg=kind)


def placed_as(x, sharding_) -> bool:
  """Whether every device holds the same slice of `x` as under `sharding_` (meshes may list
  their devices in other orders)."""
  return x.sharding.devices_indices_map(x.shape) == sharding_.devices_indices_map(x.shape)


def test_params_are_split_over_the_renamed_axis(model):
  """Axes in another order and with other names (model first, Explicit) place params where
  the rules say, on the user's axis: heads and vocab over `model`, not replicated."""
  user = jax.make_mesh((4, 2), ("model", "data"))
  mesh = sharding.resolve_mesh(user, {"tensor": "model"})
  _, params = nnx.split(model)
  placed = sharding.shard_state(params, mesh)
  wq = placed["layers"][0]["attn"]["wq"][...]  # [embed, heads 4, dh]
  assert not wq.sharding.is_fully_replicated
  assert placed_as(wq, NamedSharding(user, P(None, "model", None)))
  w_up = placed["layers"][0]["mlp"]["w_up"][...]  # [embed, mlp]
  assert placed_as(w_up, NamedSharding(user, P(None, "model")))
  assert not placed_as(w_up, NamedSharding(user, P(None, "data")))  # the check can fail
  batch = sharding.shard_batch(np.zeros((8, 3), np.int32), mesh)
  assert placed_as(batch, NamedSharding(user, P("data", None)))
  # the same Auto mesh without axis_rules: an error, no longer a silent full replication
  auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match=r"mesh axis 'model' \(size 4\) has no role"):
    pf.generate(model, PROMPTS, max_new_tokens=NEW, mesh=auto)
  with pytest.raises(ValueError, match=r"mesh axis 'model' \(size 4\) has no role"):
    with jax.set_mesh(auto):
      pf.generate(model, PROMPTS, max_new_tokens=NEW)


# ---------------------------------------------------------------- checkpoints across meshes

def test_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path, step_setup):
  _, params, tx, *_ = step_setup
  mesh_a = sharding.make_mesh((2, 2, 2))
  params_a = sharding.shard_state(params, mesh_a)
  opt_a = init_opt_state(tx, params_a, mesh_a)
  ckpt = Checkpoints(tmp_path)
  ckpt.save(1, params_a, opt_a, {"pos": 3})
  for shape in [(1, 1, 8), (8, 1, 1)]:
    mesh_b = sharding.make_mesh(shape)
    like_p = sharding.abstract_state(params_a, mesh_b)
    like_o = sharding.abstract_state(opt_a, mesh_b)
    got_p, got_o, data = ckpt.restore(1, like_p, like_o)
    assert data == {"pos": 3}
    for got, ref, want in zip(jax.tree.leaves(got_p), jax.tree.leaves(params),
                              jax.tree.leaves(sharding.state_shardings(params, mesh_b))):
      np.testing.assert_array_equal(got, ref)
      assert got.sharding.is_equivalent_to(want, got.ndim)
    for got, ref in zip(jax.tree.leaves(got_o), jax.tree.leaves(opt_a)):
      np.testing.assert_array_equal(got, ref)
  ckpt.close()


def test_trainer_resumes_a_single_device_run_on_a_mesh(tmp_path):
  """`train` with cfg.mesh (axes renamed by axis_rules) resumes an unsharded run's checkpoint
  (restored onto the mesh) and logs the same losses as the unsharded run; `load_trained`
  restores onto a third mesh, and onto an Explicit mesh with the user's axis names."""
  cfg = load_config(RECIPES / "micro_ar.py")
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, n_layers=1), steps=4, eval_every=100,
      eval_batches=1, checkpoint_every=2, log_every=1,
      data=dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "cache"), progress=False))
  ref = train(cfg, tmp_path / "one", progress=False)
  shutil.copytree(tmp_path / "one", tmp_path / "mesh")
  shutil.rmtree(tmp_path / "mesh" / "checkpoints" / "4")  # resume from step 2
  # a (2, 2, 2) mesh whose tensor axis goes by the user's name "model" (TrainConfig.mesh)
  named = {"data": 2, "fsdp": 2, "model": 2, "axis_rules": {"tensor": "model"}}
  summary = train(dataclasses.replace(cfg, mesh=named), tmp_path / "mesh", progress=False)
  assert (summary["start_step"], summary["step"]) == (2, 4)
  losses = {w: [e["loss"] for e in read_metrics(tmp_path / w) if "loss" in e]
            for w in ("one", "mesh")}
  assert len(losses["mesh"]) == 4
  np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-4)
  assert summary["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4)
  model, _, _ = load_trained(tmp_path / "mesh", mesh=sharding.make_mesh((1, 1, 8)))
  ref_model, _, _ = load_trained(tmp_path / "one")
  emb = model.embed[...]  # [vocab 320, embed 32]: vocab over the 8-way tensor axis
  assert emb.sharding.spec == P("tensor", None)
  np.testing.assert_allclose(emb, ref_model.embed[...], atol=1e-4)
  # an Explicit mesh with the user's own axis names, mapped by axis_rules
  user = jax.make_mesh((2, 4), ("data", "model"))
  model, _, _ = load_trained(tmp_path / "mesh", mesh=user, axis_rules={"tensor": "model"})
  emb = model.embed[...]
  assert placed_as(emb, NamedSharding(user, P("model", None)))
  np.testing.assert_allclose(emb, ref_model.embed[...], atol=1e-4)


# ---------------------------------------------------------------- FSDP memory

def test_fsdp_keeps_each_row_on_its_device():
  """On a (1, 8, 1) mesh the residual stream stays split over the batch axes: one more row per
  device costs at most about one row's activations on one device (XLA temporaries of the
  compiled step). Unpinned, XLA gathered every row to meet the fsdp-split weights (1.8x)."""
  def temp(batch, mesh=None):
    overrides = {"data.batch_size": batch, "data.seq_len": 512, "model.max_seq_len": 512,
                 "model.d_model": 256, "model.d_ff": 1024, "model.n_heads": 8}
    overrides.update({"mesh": mesh} if mesh else {})
    return dry_run_from_config_path(RECIPES / "micro_ar.py", overrides)["temp_bytes"]
  one_device_row = temp(2) - temp(1)
  row_per_device = temp(16, "1,8,1") - temp(8, "1,8,1")
  assert row_per_device < 1.2 * one_device_row, (row_per_device, one_device_row)
