"""Sharding: mesh specs fail clearly, the rules replicate what an axis does not divide, mesh
configs round-trip, multi-host settings are validated; and (in a subprocess with 8 CPU
devices, `sharding_cases.py`) sharded training, generation and checkpoints equal one device."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx, struct
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import paraflax as pf
from paraflax.decoding.state import Forward
from paraflax.model.cache import KVCache
from paraflax.parallel import distributed, sharding
from paraflax.parallel.sharding import MeshConfig
from paraflax.training import TrainConfig, apply_overrides, load_config
from paraflax.training.config.train import config_differences
from conftest import MICRO, background_job, background_result, run_cases_on_devices

HERE = Path(__file__).resolve().parent


def abstract(shape):
  return AbstractMesh(shape, sharding.AXES)


@pytest.mark.fast
def test_mesh_sizes_must_multiply_to_the_device_count():
  assert MeshConfig(2, 2, 2).shape(8) == (2, 2, 2)
  assert MeshConfig(data=-1, tensor=2).shape(8) == (4, 1, 2)
  assert MeshConfig.of((1, -1, 1)).shape(8) == (1, 8, 1)
  assert MeshConfig.of({"tensor": 4, "data": 2}) == MeshConfig(2, 1, 4)
  with pytest.raises(ValueError, match=r"mesh data=3 x fsdp=1 x tensor=1 needs 3 devices, "
                                       r"but 8 are available"):
    MeshConfig(3, 1, 1).shape(8)
  with pytest.raises(ValueError, match=r"fixed axes \(3 devices\) do not divide the 8"):
    MeshConfig(-1, 3, 1).shape(8)
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    MeshConfig(-1, -1, 1)
  with pytest.raises(ValueError, match=r"ints >= 1 or -1"):
    MeshConfig(0, 1, 1)
  with pytest.raises(ValueError, match=r"needs 3 sizes"):
    MeshConfig.of((2, 2))
  with pytest.raises(ValueError, match=rf"needs 2 devices, but {jax.device_count()} are"):
    sharding.make_mesh((2, 1, 1) if jax.device_count() != 2 else (4, 1, 1))


@pytest.mark.fast
def test_rules_split_what_divides_and_replicate_the_rest():
  m222, m118, m811 = abstract((2, 2, 2)), abstract((1, 1, 8)), abstract((8, 1, 1))
  kv = sharding.KV_NAMES
  # cache [layers, B, S, Hkv, Dh]: batch over data x fsdp, kv heads over tensor
  assert sharding.logical_spec(kv, (2, 8, 16, 2, 8), m222) == P(None, ("data", "fsdp"), None,
                                                                "tensor", None)
  # 2 kv heads on an 8-way tensor axis: replicated, not refused; same for a batch of 4 on 8
  assert sharding.logical_spec(kv, (2, 4, 16, 2, 8), m118) == P(None, None, None, None, None)
  assert sharding.logical_spec(kv, (2, 4, 16, 2, 8), m811) == P(None, None, None, None, None)
  # the cache's specs are its declared axes' (`state_specs`): no helper of its own (kv_spec)
  cache = KVCache(jnp.zeros((2, 8, 16, 2, 8)), jnp.zeros((2, 8, 16, 2, 8)), jnp.zeros(8))
  specs = sharding.state_specs(cache, m222)
  assert specs.k == specs.v == sharding.logical_spec(kv, (2, 8, 16, 2, 8), m222)
  assert not hasattr(sharding, "kv_spec")
  # a batch of 2 takes the axes' longest dividing prefix (data), a batch of 3 none
  assert sharding.logical_spec(("batch",), (2,), m222) == P("data")
  assert sharding.logical_spec(("batch",), (3,), m222) == P(None)
  # size-1 axes are dropped; an axis is used by one dim only
  assert sharding.logical_spec(("embed", "vocab"), (32, 48), m118) == P(None, "tensor")
  assert sharding.logical_spec(("heads", "kv_heads"), (4, 4), m222) == P("tensor", None)
  with pytest.raises(ValueError, match=r"logical axis 'experts' has no sharding rule"):
    sharding.logical_spec(("experts",), (4,), m222)
  with pytest.raises(ValueError, match="do not match shape"):
    sharding.logical_spec(("embed",), (4, 4), m222)


@pytest.mark.fast
def test_every_model_param_has_a_rule():
  cfg = pf.ModelConfig(**{**MICRO, "qkv_bias": True, "qk_norm": True, "tie_embeddings": False})
  _, params = nnx.split(nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0))))
  mesh = sharding.make_mesh()  # one device: every spec is trivially satisfiable
  shardings = jax.tree.leaves(sharding.state_shardings(params, mesh))
  assert len(shardings) == len(jax.tree.leaves(params))
  for names in jax.tree.leaves(nnx.get_partition_spec(params),
                               is_leaf=lambda x: isinstance(x, P)):
    for shape in [(2, 2, 2), (1, 1, 8), (8, 1, 1)]:
      sharding.logical_spec(tuple(names), (64,) * len(names), abstract(shape))


@pytest.mark.fast
def test_train_config_mesh_round_trips_and_may_change_on_resume():
  cfg = load_config("micro_ar")
  assert cfg.mesh is None
  sharded = dataclasses.replace(cfg, mesh=(2, -1, 1))
  assert sharded.mesh == MeshConfig(2, -1, 1)
  assert TrainConfig.from_dict(sharded.to_dict()) == sharded
  assert TrainConfig.from_dict(cfg.to_dict()) == cfg
  assert config_differences(cfg, sharded) == []  # a run may resume on another mesh
  assert apply_overrides(cfg, {"mesh": "(1, 1, 8)"}).mesh == MeshConfig(1, 1, 8)
  with pytest.raises(ValueError, match="at most one mesh axis"):
    dataclasses.replace(cfg, mesh=(-1, -1, 1))


@pytest.mark.fast
def test_distributed_settings_come_from_arguments_then_environment():
  env = {"PARAFLAX_COORDINATOR": "10.0.0.1:1234", "PARAFLAX_NUM_PROCESSES": "4",
         "PARAFLAX_PROCESS_ID": "3"}
  assert distributed.resolve(env={}) is None
  assert distributed.initialize(env={}) is False  # single process: nothing happens
  assert distributed.resolve(env=env) == ("10.0.0.1:1234", 4, 3)
  assert distributed.resolve("127.0.0.1:9", 2, 0, env=env) == ("127.0.0.1:9", 2, 0)
  with pytest.raises(ValueError, match="host:port"):
    distributed.resolve("localhost", 2, 0, env={})
  with pytest.raises(ValueError, match=r"0 <= process_id < num_processes"):
    distributed.resolve(env={**env, "PARAFLAX_PROCESS_ID": "4"})
  with pytest.raises(ValueError, match="needs num_processes"):
    distributed.resolve("127.0.0.1:9", env={})
  with pytest.raises(ValueError, match="without a coordinator"):
    distributed.resolve(num_processes=2, process_id=0, env={})
  with pytest.raises(ValueError, match="must be an integer"):
    distributed.resolve(env={**env, "PARAFLAX_NUM_PROCESSES": "two"})


background_job(__file__, "test_sharded_runs_on_eight_devices_equal_one_device",
               lambda tmp: run_cases_on_devices(HERE / "sharding_cases.py"))


@pytest.mark.slow
def test_sharded_runs_on_eight_devices_equal_one_device(request, tmp_path):
  """Runs `sharding_cases.py` (train step, AR + PromptLookup generate, cache specs,
  checkpoints across meshes, the trainer under a mesh) with 8 forced CPU devices (started
  early in the background: conftest.background_job)."""
  background_result(request, tmp_path)


# ---------------------------------------------------------------- the meshes users make

@pytest.mark.fast
def test_mesh_specs_take_library_names_or_axis_rules_and_refuse_others_in_one_line():
  assert MeshConfig.of({"data": 2, "tensor": 4}) == MeshConfig(2, 1, 4)
  named = MeshConfig.of({"data": 2, "model": 4}, axis_rules={"tensor": "model"})
  assert named == MeshConfig(2, 1, 4, axis_rules=(("tensor", "model"),))
  assert named.axis_names == ("data", "fsdp", "model")
  assert MeshConfig.of({"data": 2, "model": 4, "axis_rules": {"tensor": "model"}}) == named
  with pytest.raises(ValueError, match=r"unknown mesh axis 'model' .* axis_rules=\{'tensor': "
                                       r"'model'\}"):
    pf.make_mesh({"data": 2, "model": 4})
  with pytest.raises(ValueError, match="given twice"):
    MeshConfig.of({"tensor": 2, "model": 4}, axis_rules={"tensor": "model"})
  with pytest.raises(ValueError, match="two mesh axes one name"):
    MeshConfig(axis_rules={"tensor": "data"})
  with pytest.raises(ValueError, match="must map library axes"):
    MeshConfig(axis_rules={"model": "tensor"})
  with pytest.raises(ValueError, match="a mesh spec is"):
    MeshConfig.of(8)
  with pytest.raises(ValueError, match="ints >= 1"):
    MeshConfig(True, 1, 1)
  # one device: a renamed single-axis mesh from make_mesh, and the mesh it resolves to
  mesh = pf.make_mesh({"model": -1}, axis_rules={"tensor": "model"})
  assert mesh.axis_names == ("data", "fsdp", "model")
  assert pf.make_mesh(axis_rules={"data": "batch"}).axis_names == ("batch", "fsdp", "tensor")
  resolved = sharding.resolve_mesh(mesh, {"tensor": "model"})
  assert resolved.axis_names == sharding.AXES and resolved.are_all_axes_auto


@pytest.mark.fast
def test_train_config_takes_a_renamed_mesh_and_round_trips_it():
  cfg = load_config("micro_ar")
  spec = "{'data': 2, 'model': 4, 'axis_rules': {'tensor': 'model'}}"
  named = apply_overrides(cfg, {"mesh": spec})
  assert named.mesh == MeshConfig(2, 1, 4, axis_rules={"tensor": "model"})
  hash(named)
  assert TrainConfig.from_dict(json.loads(json.dumps(named.to_dict()))) == named
  assert config_differences(cfg, named) == []  # mesh fields, axis_rules included: run control
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    apply_overrides(cfg, {"mesh": "{'data': 2, 'model': 4}"})


@pytest.mark.fast
def test_resolve_mesh_refuses_what_it_cannot_use():
  assert sharding.resolve_mesh(None) is None  # no mesh, none enclosing: one device
  with pytest.raises(ValueError, match="axis_rules= needs a mesh"):
    sharding.resolve_mesh(None, {"tensor": "model"})
  with pytest.raises(ValueError, match="needs devices, got an AbstractMesh"):
    sharding.resolve_mesh(abstract((1, 1, 1)))
  one = jax.make_mesh((1, 1), ("data", "model"))  # Explicit, JAX's default
  with pytest.raises(ValueError, match=r"axis_rules key 'model' is not a library axis"):
    sharding.resolve_mesh(one, {"model": "tensor"})
  with pytest.raises(ValueError, match=r"maps 'tensor' to 'heads', which the mesh"):
    sharding.resolve_mesh(one, {"tensor": "heads"})
  with pytest.raises(ValueError, match=r"mesh axis 'data' plays two library axes"):
    sharding.resolve_mesh(one, {"fsdp": "data"})
  auto = sharding.resolve_mesh(one, {"tensor": "model"})
  assert auto.axis_names == sharding.AXES and auto.are_all_axes_auto
  assert list(auto.devices.flat) == list(one.devices.flat)


def _decoder_states():
  """(name, abstract state) of every decoder, greedy and sampled, built by eval_shape."""
  base = pf.ModelConfig(**{**MICRO, "mask_token_id": 4, "sep_token_id": 5})
  two = pf.ModelConfig(**{**MICRO, "two_stream": True})
  fwds = {}
  for key, cfg in (("base", base), ("two", two)):
    gd, params = nnx.split(nnx.eval_shape(lambda cfg=cfg: pf.Transformer(cfg, rngs=nnx.Rngs(0))))
    fwds[key] = Forward(graphdef=gd, cfg=cfg, params=params)
  hot = pf.Temperature(1.0)
  d = pf.decoders
  decoders = {
      "AR": [d.AR(), d.AR(hot)], "PromptLookup": [d.PromptLookup(2, 3)],
      "Jacobi": [d.Jacobi(3)], "JacobiMR": [d.JacobiMR(3, num_blocks=2, pool_size=2,
                                                        num_candidates=1)],
      "TiDAR": [d.TiDAR(3), d.TiDAR(3, sampler=hot)],
      "Speculative": [d.Speculative(2), d.Speculative(2, hot)], "DEER": [d.DEER(2, hot)],
      "ASSD": [d.ASSD(3), d.ASSD(3, sampler=hot)], "AnyOrder": [d.AnyOrder()]}
  assert set(decoders) == set(d.__all__), "add the new decoder here"
  prompts, lens = jnp.zeros((2, 8), jnp.int32), jnp.array([3, 8], jnp.int32)
  canvas = jnp.full((2, 8), pf.HOLE, jnp.int32).at[:, 0].set(1)
  for name, decs in decoders.items():
    for dec in decs:
      if isinstance(dec, d.InfillDecoder):
        state = jax.eval_shape(lambda f, c, dec=dec: dec.init(f, c, jax.random.key(0)),
                               fwds["two"], canvas)
      else:
        f = fwds["base"]
        draft = f if dec.uses_draft_model else None
        state = jax.eval_shape(lambda f, g, dec=dec: dec.init(
            f, g, prompts, lens, 4, jax.random.key(0), jnp.int32(-1)), f, draft)
        assert type(state) is dec.State, name
      yield f"{name}({dec})", state


@pytest.mark.fast
def test_every_decoder_state_declares_the_logical_axes_of_every_field():
  m222 = abstract((2, 2, 2))
  for name, state in _decoder_states():
    specs = sharding.state_specs(state, m222)  # TypeError for a field without a declaration
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(flat) == len(jax.tree.leaves(state)), name
    # batch-leading fields split over batch, the [steps, B] trace on its second dim, the
    # cache's kv heads over tensor, scalars and keys replicated
    if hasattr(state, "accepted"):
      assert specs.tokens == P("data", None), name
      assert specs.accepted == P(None, "data") and specs.step == P() and specs.rng == P(), name
    assert specs.cache.k == P(None, "data", None, "tensor", None), name


@pytest.mark.fast
def test_a_state_field_without_declared_axes_is_an_error_not_a_guess():
  @struct.dataclass
  class Forgot:
    tokens: jax.Array = sharding.axes("batch", None)
    lengths: jax.Array = None  # no declaration

  state = Forgot(tokens=jnp.zeros((2, 3)), lengths=jnp.zeros((2,)))
  with pytest.raises(TypeError, match=r"Forgot.lengths declares no logical axes"):
    sharding.state_specs(state, abstract((2, 2, 2)))
  with pytest.raises(TypeError, match=r"holds ArrayImpl where a dataclass"):
    sharding.state_specs(jnp.zeros((2,)), abstract((2, 2, 2)))
