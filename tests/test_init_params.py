"""`init_params` builds a random model in a fixed number of compiled programs, whatever its
depth (XLA compiles one layer's samplers once), sharded on a mesh as `state_shardings` says."""

import contextlib
import dataclasses

import jax
import numpy as np
import pytest

import paraflax as pf
from paraflax.parallel import sharding
from paraflax.training.run.step import init_params

# one event per program lowered: each is then compiled (or loaded from the persistent cache)
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CFG = pf.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                     max_seq_len=16, qkv_bias=True, tie_embeddings=False)


@contextlib.contextmanager
def lowered_programs():
  """The names of the programs lowered inside the block."""
  names = []

  def listen(event, secs, **kwargs):
    if event == LOWERED:
      names.append(kwargs.get("fun_name"))
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.fast
def test_init_params_compiles_two_programs_whatever_the_depth():
  """The parameters outside the layers, then one layer's initialiser: not a program (or a
  sampler) per layer or per parameter."""
  init_params(CFG, 0)  # the seed's eager key ops: compiled once per process
  programs = {}
  for layers in (2, 5):
    with lowered_programs() as programs[layers]:
      jax.block_until_ready(init_params(dataclasses.replace(CFG, n_layers=layers), 0)[1])
  assert programs[2] == programs[5] and len(programs[5]) <= 2, programs


@pytest.mark.fast
def test_init_params_on_a_mesh_places_every_parameter_and_keeps_its_values():
  mesh = sharding.make_mesh((1, 1, 1))
  _, params = init_params(CFG, 3, mesh)
  _, alone = init_params(CFG, 3)
  want = jax.tree.leaves(sharding.state_shardings(params, mesh))
  for x, s in zip(jax.tree.leaves(params), want, strict=True):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(alone), strict=True):
    np.testing.assert_array_equal(x, y)
