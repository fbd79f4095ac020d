"""`decoding/cost.py`: XLA's cost analysis of one decode step of the compiled loop, against
the floor of what a step must read (weights, filled cache)."""

import json

import jax
import pytest
from flax import nnx

import paraflax as pf
from paraflax.decoding.cost import step_cost
from conftest import MICRO

WIDE = {**MICRO, "d_model": 64, "d_ff": 256, "vocab_size": 256, "max_seq_len": 512}


def abstract(**overrides):
  cfg = pf.ModelConfig(**{**WIDE, **overrides})
  return nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0)))


def n_params(model) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.fast
def test_a_step_reads_every_weight_and_every_filled_cache_slot():
  model = abstract()
  base = step_cost(model, batch=1, cache_len=64)
  json.dumps(base)  # a JSON row
  params = n_params(model)
  assert base["weight_bytes"] == 4 * params
  assert base["cache_bytes"] == 2 * 2 * 64 * 2 * 16 * 4  # k, v x layers x slots x heads x dim
  assert base["bytes_accessed"] >= base["floor_bytes"]
  assert base["bytes_per_floor"] == base["bytes_accessed"] / base["floor_bytes"]
  assert base["flops"] >= 2 * (params - WIDE["vocab_size"] * WIDE["d_model"])  # every matmul
  assert base["ops"] == sum(base["ops_by_kind"].values()) > 0
  longer = step_cost(model, batch=1, cache_len=192)
  grown = longer["cache_bytes"] - base["cache_bytes"]
  assert longer["bytes_accessed"] - base["bytes_accessed"] >= grown  # every filled slot read


def test_a_drafter_loop_is_counted_once_per_trip():
  """Speculative's k-1 drafter forwards run in a `fori_loop`, which XLA's cost analysis counts
  once: `step_cost` counts every trip (each reads the drafter's weights)."""
  model, drafter = abstract(), abstract(n_layers=1)
  one, four = (step_cost(model, pf.decoders.Speculative(k), draft_model=drafter, cache_len=32)
               for k in (1, 4))
  drafter_weights = 4 * n_params(drafter)
  assert four["bytes_accessed"] - one["bytes_accessed"] >= 3 * drafter_weights
  assert four["ops"] > one["ops"]


@pytest.mark.fast
def test_bad_settings_are_clear_errors():
  model = abstract()
  with pytest.raises(ValueError, match="needs draft_model"):
    step_cost(model, pf.decoders.Speculative(2))
  with pytest.raises(ValueError, match="cache_len must be an int >= 1"):
    step_cost(model, cache_len=0)
  with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
    step_cost(model, cache_len=510)


@pytest.mark.fast
def test_figures_are_per_step_at_any_steps_per_iter():
  model = abstract()
  one, two = (step_cost(model, pf.decoders.Jacobi(4), cache_len=32, steps_per_iter=n)
              for n in (1, 2))
  assert (one["steps_per_iter"], two["steps_per_iter"]) == (1, 2)
  assert two["flops"] == pytest.approx(one["flops"], rel=0.05)
  assert two["bytes_accessed"] == pytest.approx(one["bytes_accessed"], rel=0.1)
