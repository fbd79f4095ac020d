"""One process of the two-process collection test (`test_collect_mesh.py` starts two).

Joins the run through `paraflax.parallel.distributed`, then both processes fill one trajectory store
and one teacher store in `PARAFLAX_TEST_OUT` on a (data=2, fsdp=1, tensor=2) mesh: batch rows
0-3 are computed on process 0's devices, 4-7 on process 1's, and each process writes its own.
Process 0 then collects both stores again alone on one device and compares. Prints one line
`RESULT {json}`.
"""

import json
import os
import sys
from pathlib import Path

from paraflax.parallel import distributed

distributed.initialize(timeout_s=60)  # before any other JAX work

import time

import jax
import numpy as np

from paraflax.parallel import sharding
from paraflax.training.stores import teacher, trajectories
from paraflax.training.stores.shares import Share

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect_mesh_cases import TEACH, TOKENS, TRAJ
from conftest import StubTokenizer, compiled_micro_model


def same(a, b, names) -> bool:
  return a.meta == b.meta and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in names)


def main():
  t0 = time.perf_counter()
  out = Path(os.environ["PARAFLAX_TEST_OUT"])
  model = compiled_micro_model(n_layers=1)
  mesh = sharding.make_mesh((2, 1, 2))
  rows = Share(mesh, TRAJ.batch_size).rows(TRAJ.batch_size)
  t = trajectories.collect(model, StubTokenizer(), TOKENS, out / "t", TRAJ, progress=False,
                           mesh=mesh)
  a = teacher.collect(model, StubTokenizer(), TOKENS, out / "a", TEACH, progress=False,
                      mesh=mesh)
  checks = {"process_count": jax.process_count() == 2}
  if jax.process_index() == 0:  # the single-device references (process 1 is done)
    ref = out / f"ref{jax.process_index()}"
    checks["trajectories"] = same(trajectories.load(t), trajectories.load(trajectories.collect(
        model, StubTokenizer(), TOKENS, ref / "t", TRAJ, progress=False)), trajectories.ARRAYS)
    checks["teacher"] = same(teacher.load(a), teacher.load(teacher.collect(
        model, StubTokenizer(), TOKENS, ref / "a", TEACH, progress=False)), teacher.ARRAYS)
  result = {"process": jax.process_index(), "rows": rows, "checks": checks,
            "seconds": time.perf_counter() - t0}
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
