"""Per-step time of a sharded vs an unsharded training step (a sanity ratio, not a benchmark).

  python scripts/shard_step_time.py [--config tiny_ar] [--devices 8]
                                    [--meshes 8,1,1 2,2,2 1,1,8] [--steps 10]

On CPU the "devices" are host threads forced by XLA_FLAGS (set here, before JAX starts), all
sharing the same cores: a ratio near or above 1 is expected and only says that sharding adds
no pathological cost (no full rematerialisation every step). Speedups need real devices.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="tiny_ar",
                 help="TrainConfig file or recipe name (model, optim, batch)")
  p.add_argument("--devices", type=int, default=8, help="forced CPU device count")
  p.add_argument("--meshes", nargs="+", default=["8,1,1", "2,2,2", "1,1,8"],
                 help="data,fsdp,tensor sizes (-1: the rest)")
  p.add_argument("--steps", type=int, default=10, help="timed steps per setting (after 2 warm-up)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if "jax" in sys.modules:
    raise SystemExit("run as a script: XLA_FLAGS must be set before JAX is imported")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import time

  import jax
  import numpy as np

  from paraflax.parallel import sharding
  from paraflax.training import load_config
  from paraflax.training.objectives.protocol import get_objective
  from paraflax.training.run import optim
  from paraflax.training.run.trainer import init_opt_state, init_params, jit_train_step

  cfg = load_config(args.config)
  tx = optim.optimizer(cfg.optim, cfg.schedule_steps)
  loss_fn = get_objective(cfg.objective, cfg.objective_args)
  b, l = cfg.data.batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, l), dtype=np.int32)
  rng = jax.random.key(0)

  def time_steps(mesh) -> tuple[float, float]:
    graphdef, params = init_params(cfg.model, cfg.seed, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    batch, key = {"tokens": tokens}, rng
    if mesh is not None:
      batch = sharding.shard_batch(batch, mesh)
      key = sharding.put(rng, sharding.replicated(mesh))
    step = jit_train_step(graphdef, loss_fn, tx, mesh, params, opt_state)
    t = time.perf_counter()
    compiled = step.lower(params, opt_state, batch, key).compile()
    compile_s = time.perf_counter() - t
    for _ in range(2):
      params, opt_state, m = compiled(params, opt_state, batch, key)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(args.steps):
      params, opt_state, m = compiled(params, opt_state, batch, key)
    jax.block_until_ready((params, m))
    return (time.perf_counter() - t) / args.steps, compile_s

  print(f"model: {cfg.model}\nbatch: {b} x {l} tokens, {jax.device_count()} CPU devices, "
        f"{os.cpu_count()} cores, jax {jax.__version__}")
  print(f"{'mesh (data,fsdp,tensor)':>24} {'ms/step':>9} {'ratio':>6} {'compile s':>10}")
  base, compile_s = time_steps(None)
  print(f"{'one device':>24} {base * 1e3:>9.1f} {1.0:>6.2f} {compile_s:>10.1f}")
  for spec in args.meshes:
    mesh = sharding.make_mesh(tuple(int(x) for x in spec.split(",")))
    sec, compile_s = time_steps(mesh)
    shape = "x".join(str(mesh.shape[a]) for a in sharding.AXES)
    print(f"{shape:>24} {sec * 1e3:>9.1f} {sec / base:>6.2f} {compile_s:>10.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
