"""One process of the two-process test (`test_multihost.py` starts two of these).

Joins the run through `paraflax.parallel.distributed` (PARAFLAX_* environment), then on meshes that
span both processes runs a sharded training step and a sharded greedy `generate`. Process 0
then checks both against the same computations on its first device alone (process 1 skips
them: two cores are shared). Prints one line `RESULT {json}`.
"""

import json
import sys
from pathlib import Path

from paraflax.parallel import distributed

distributed.initialize(timeout_s=60)  # before any other JAX work

import functools
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import paraflax as pf
from paraflax.parallel import sharding
from paraflax.training.objectives.protocol import get_objective
from paraflax.training.run.trainer import init_opt_state, jit_train_step, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compiled_micro_model

PROMPTS = [[5, 9, 2], [7, 1, 1, 30, 4, 12, 40, 2, 8, 3], [11], [3, 3, 3, 3]]


def gather(tree):
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                      tree)


def main():
  t0 = time.perf_counter()
  checks = {"process_count": jax.process_count() == 2, "device_count": jax.device_count() == 4,
            "local_device_count": jax.local_device_count() == 2}
  model = compiled_micro_model(n_layers=1)

  # a training step on a (data=1, fsdp=2, tensor=2) mesh spanning both processes
  graphdef, params = nnx.split(model, nnx.Param)
  # SGD with momentum, not AdamW: Adam's first update lr * g / (|g| + eps) turns reduction-order
  # noise in a near-zero gradient into 1e-5-scale parameter differences (an lm_head entry
  # with g = -1.45e-7 sharded vs -1.48e-7 on one device moved 2.5e-5 apart) and hides
  # gradient-magnitude errors; this update is linear in the gradient and has a sharded state
  tx = optax.sgd(1e-2, momentum=0.9)
  loss_fn = get_objective("ar")
  batch = {"tokens": np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 48), np.int32)}
  rng = jax.random.key(2)
  mesh = sharding.make_mesh((1, 2, 2))
  sharded = sharding.shard_state(params, mesh)
  opt_state = init_opt_state(tx, sharded, mesh)
  step = jit_train_step(graphdef, loss_fn, tx, mesh, sharded, opt_state)
  new_params, _, metrics = step(sharded, opt_state, sharding.shard_batch(batch, mesh),
                                sharding.put(rng, sharding.replicated(mesh)))
  checks["params_span_processes"] = not new_params["embed"][...].is_fully_addressable
  new_params = gather(new_params)

  # greedy generate on a (data=2, fsdp=1, tensor=2) mesh: batch rows split across processes
  out = pf.generate(model, PROMPTS, max_new_tokens=8, mesh=sharding.make_mesh((2, 1, 2)))
  checks["outputs_replicated"] = out.tokens.sharding.is_fully_replicated
  tokens = np.asarray(out.tokens)
  result = {"process": jax.process_index(), "loss": float(metrics["loss"]),
            "tokens": tokens.tolist()}
  if jax.process_index() == 0:  # the single-device references
    ref_params, _, ref_metrics = jax.jit(functools.partial(
        train_step, graphdef, loss_fn=loss_fn, tx=tx))(params, tx.init(params), batch, rng)
    checks["loss"] = bool(np.isclose(result["loss"], float(ref_metrics["loss"]), rtol=1e-5))
    diff = max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in
               zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params)))
    checks["params"] = diff < 2e-5
    ref = pf.generate(model, PROMPTS, max_new_tokens=8)
    checks["tokens"] = bool(np.array_equal(tokens, np.asarray(ref.tokens)))
    result["max_param_diff"] = diff
  result.update(checks=checks, seconds=time.perf_counter() - t0)
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
