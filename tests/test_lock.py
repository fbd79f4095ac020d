"""DESIGN invariant 7, one writer per workdir: while another process holds a training workdir
or a store, `paraflax train`, `teacher-data` and `collect-trajectories` there are refused with
one line naming the holder (pid, host) and touch nothing; a holder killed with SIGKILL
leaves no lock behind."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paraflax import cli
from paraflax.training.stores import teacher, trajectories
from paraflax.training.workdirs.lock import LOCK, DirLock, LockedError
from conftest import StubTokenizer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "micro_ar"

# Another process taking the lock on each argv directory, the library's own code (the module
# loaded by path: no jax import); it says "held" and waits for stdin to close.
HOLDER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("lock", {str(ROOT / "paraflax/training/workdirs/lock.py")!r})
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
held = [lock.DirLock(d, what="test").acquire() for d in sys.argv[1:]]
print("held", flush=True)
sys.stdin.read()
"""


def _holder(*dirs):
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, dirs)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc



@pytest.mark.fast
def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_blocks_nothing(
    model, tmp_path, monkeypatch, capsys):
  run, traj, tch = tmp_path / "run", tmp_path / "traj", tmp_path / "teacher"
  run.mkdir()
  log = run / "metrics.jsonl"  # the first run's log: a refused run must not cut it
  log.write_text("".join(f'{{"step": {i}, "loss": 1.0}}\n' for i in range(1, 662)))
  proc = _holder(run, traj, tch)
  try:
    who = rf"in use by another run \(pid {proc.pid} on host {socket.gethostname()}, since "
    monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
    assert cli.main(["train", "--config", CONFIG, "--workdir", str(run),
                     "--set", f"data.cache_dir={tmp_path / 'data'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("paraflax train: error: training workdir")
    assert re.search(who, err), err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", LOCK]
    assert len(log.read_text().splitlines()) == 661
    stream = np.arange(4, 200, dtype=np.int32) % 48
    with pytest.raises(LockedError, match="teacher store .*" + who):
      teacher.collect(model, StubTokenizer(), stream, tch, teacher.TeacherConfig(
          examples=4, answer_len=2, min_prompt_len=2, max_prompt_len=4, batch_size=4),
          progress=False)
    with pytest.raises(LockedError, match="trajectory store .*" + who):
      trajectories.collect(model, StubTokenizer(), stream, traj, trajectories.CollectConfig(
          block_size=2, num_blocks=1, examples=4, min_prompt_len=2, max_prompt_len=4,
          batch_size=4), progress=False)
    assert not (tch / "meta.json").exists() and not (traj / "meta.json").exists()
  finally:
    proc.send_signal(signal.SIGKILL)  # no cleanup: the kernel drops the lock
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert str(proc.pid) in (run / LOCK).read_text()  # the dead holder's note is still there
  with DirLock(run, what="training workdir") as lock:  # ... and blocks nothing
    assert f'"pid": {os.getpid()}' in lock.path.read_text()
    with pytest.raises(LockedError, match="training workdir"):  # not even this process twice
      DirLock(run, what="training workdir").acquire()
  assert (run / LOCK).read_text() == ""  # released: no note of a holder left
