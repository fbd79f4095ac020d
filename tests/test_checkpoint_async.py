"""Asynchronous checkpoints: `save` returns before the step is committed and the loop goes on
(donating its buffers) while it is written; the manifest follows the commit and verifies; the
restored step is the state at `save` time; a run killed before the commit resumes from the
previous step, never from orbax's temporary directory."""

import asyncio
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.path import atomicity

from paraflax.training.workdirs.checkpoint import MANIFEST, Checkpoints, verify_step
from paraflax.training.workdirs.checksums import ChecksumWarning


def _state(value: float):
  params = {"w": jnp.full((256, 256), value), "b": jnp.full((256,), value)}
  return params, {"mu": jax.tree.map(jnp.zeros_like, params)}


@pytest.fixture
def held_commit(monkeypatch):
  """An Event that orbax's commit (the rename of the temporary directory) waits for."""
  gate, finalize = threading.Event(), atomicity.AtomicRenameTemporaryPath.finalize

  async def held(self):
    await asyncio.to_thread(gate.wait)
    await finalize(self)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held)
  yield gate
  gate.set()


def test_save_returns_before_the_commit_and_restores_the_state_at_save_time(tmp_path,
                                                                            held_commit):
  ckpt = Checkpoints(tmp_path)
  params, opt_state = _state(1.0)
  try:
    ckpt.save(1, params, opt_state, {"position": 1})
    assert ckpt.saving()
    assert not ckpt.step_dir(1).exists()  # still the temporary directory
    assert not (ckpt.step_dir(1) / MANIFEST.format(0)).exists()
    step = jax.jit(lambda p: jax.tree.map(lambda a: a + 1, p), donate_argnums=0)
    params = jax.block_until_ready(step(step(params)))  # the loop goes on meanwhile
  finally:
    held_commit.set()
  ckpt.wait()
  assert not ckpt.saving()
  assert verify_step(ckpt.step_dir(1))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ChecksumWarning)
    got, got_opt, data = ckpt.restore(1, *_state(0.0))
  ckpt.close()
  np.testing.assert_array_equal(got["w"], 1.0)  # not the 3.0 of the steps after the save
  np.testing.assert_array_equal(got_opt["mu"]["b"], 0.0)
  assert data == {"position": 1}


_KILLED = """
import os, asyncio, sys, jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from paraflax.training.workdirs.checkpoint import Checkpoints
ckpt = Checkpoints(sys.argv[1])
ckpt.save(1, {"w": jnp.full((64,), 1.0)}, {"m": jnp.zeros(1)}, {"position": 1})
ckpt.wait()
async def never(self):
  await asyncio.sleep(3600)
atomicity.AtomicRenameTemporaryPath.finalize = never
ckpt.save(2, {"w": jnp.full((64,), 2.0)}, {"m": jnp.ones(1)}, {"position": 2})
while not any(p.name.startswith("2.") for p in ckpt.directory.iterdir()):
  pass
os.kill(os.getpid(), 9)
"""


def test_a_run_killed_mid_save_resumes_from_the_previous_verified_step(tmp_path):
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED), str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == -9, done.stderr[-2000:]
  assert any(".orbax-checkpoint-tmp" in p.name for p in (tmp_path / "checkpoints").iterdir())
  ckpt = Checkpoints(tmp_path)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ChecksumWarning)
    step, (params, _, data) = ckpt.restore_latest({"w": jnp.zeros((64,))}, {"m": jnp.zeros(1)})
  ckpt.close()
  assert (step, data) == (1, {"position": 1})
  np.testing.assert_array_equal(params["w"], 1.0)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
