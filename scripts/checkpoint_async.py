"""How long `Checkpoints.save` blocks the training loop against the whole save (written,
committed, hashed), for a 384 MiB float32 state (params + two Adam moments), in one run, while a
jitted step that donates its buffers keeps running.

  python scripts/checkpoint_async.py [--mib 128] [--workdir /tmp/paraflax-ckpt-bench]
"""

import argparse
import shutil
import statistics
import time

import jax

from paraflax.training.workdirs.checkpoint import Checkpoints


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=128, help="params size; the state is 3x that")
  ap.add_argument("--workdir", default="/tmp/paraflax-ckpt-bench")
  ap.add_argument("--saves", type=int, default=5)
  args = ap.parse_args()
  shutil.rmtree(args.workdir, ignore_errors=True)
  n = args.mib << 18  # float32 values
  keys = iter(jax.random.split(jax.random.key(0), 24))  # random values: orbax compresses
  part = lambda: {f"w{i}": jax.random.normal(next(keys), (n // 8,)) for i in range(8)}
  params, opt_state = part(), {"mu": part(), "nu": part()}
  step = jax.jit(lambda p: jax.tree.map(lambda a: a * 1.0001, p), donate_argnums=0)
  params = jax.block_until_ready(step(params))
  ckpt = Checkpoints(args.workdir, keep=2)
  blocked, full, steps = [], [], []
  for s in range(1, args.saves + 1):
    t0 = time.perf_counter()
    ckpt.save(s, params, opt_state, {"step": s})
    blocked.append(time.perf_counter() - t0)
    k = 0
    while ckpt.saving():  # the loop goes on while orbax writes and the manifest is hashed
      params = jax.block_until_ready(step(params))
      k += 1
    ckpt.wait()
    full.append(time.perf_counter() - t0)
    steps.append(k)
  ckpt.close()
  mib = 3 * sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
  print(f"state {mib:.0f} MiB, {args.saves} saves, {jax.devices()[0].platform}")
  print(f"save() blocks the loop: median {statistics.median(blocked) * 1e3:.0f} ms "
        f"(all: {', '.join(f'{b * 1e3:.0f}' for b in blocked)})")
  print(f"whole save (written, committed, hashed): median {statistics.median(full):.2f} s "
        f"(all: {', '.join(f'{f:.2f}' for f in full)}); steps run meanwhile: {steps}")


if __name__ == "__main__":
  main()
