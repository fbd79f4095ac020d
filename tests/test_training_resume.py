"""DESIGN invariant 6: a training process killed with SIGKILL, or stopped with Ctrl-C (SIGINT),
resumes exactly.

Run A trains uninterrupted to N steps. Run B is the same command, SIGKILLed a few steps after
a checkpoint (or sent SIGINT, which saves the step it stopped at), then started again. B's
metrics log must equal A's: same step count, the same loss at every step after the resume
point, and the same batch at every step (fingerprints), which are the first N batches of the
data iterator, each exactly once.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paraflax.data.pipeline import prepare_stdlib, train_iterator
from paraflax.training import batch_fingerprint, load_config, read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS, CHECKPOINT_EVERY, KILL_AFTER = 300, 25, 50
SIGINT_AFTER = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  cache = tmp_path_factory.mktemp("data-cache")
  cfg = load_config("micro_ar")
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(cache),
                                                          progress=False))
  data = prepare_stdlib(cfg.data)  # warm the data cache before any subprocess
  env = dict(os.environ,
             JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache")),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return cfg, data, env


def _command(cfg, workdir):
  return [sys.executable, "-m", "paraflax.training", "--config", "micro_ar", "--workdir",
          str(workdir), "--steps", str(STEPS), "--no-progress",
          "--set", f"data.cache_dir={cfg.data.cache_dir}",
          "--set", f"checkpoint_every={CHECKPOINT_EVERY}", "--set", "eval_every=100"]


def _run(cfg, env, workdir) -> dict:
  proc = subprocess.run(_command(cfg, workdir), env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _saved_steps(workdir) -> list[int]:
  d = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _logged_step(workdir) -> int:
  return max((e["step"] for e in read_metrics(workdir) if "loss" in e), default=0)


def _train_log(workdir):
  return [(e["step"], e["loss"], e["batch_fingerprint"]) for e in read_metrics(workdir)
          if "loss" in e]


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
  """Run A: the workdir of the same command run to the end without interruption."""
  cfg, _, env = setup
  workdir = tmp_path_factory.mktemp("uninterrupted") / "a"
  a = _run(cfg, env, workdir)
  assert a["step"] == STEPS and a["start_step"] == 0
  return workdir


def test_sigkill_then_resume_equals_an_uninterrupted_run(setup, uninterrupted, tmp_path):
  cfg, data, env = setup
  a_dir = uninterrupted

  b_dir = tmp_path / "b"
  proc = subprocess.Popen(_command(cfg, b_dir), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  try:
    while True:  # kill a few steps past a checkpoint, before the next one
      saved = _saved_steps(b_dir)
      if saved and saved[-1] >= KILL_AFTER and _logged_step(b_dir) >= saved[-1] + 3:
        break
      assert proc.poll() is None, f"run B ended before it could be killed:\n{proc.stderr.read()}"
      assert time.monotonic() < deadline, "run B made no progress"
      time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait()
  assert proc.returncode == -signal.SIGKILL, "run B finished before the kill landed"
  logged_at_kill = _logged_step(b_dir)

  b = _run(cfg, env, b_dir)
  resumed_from = b["start_step"]
  assert resumed_from % CHECKPOINT_EVERY == 0 and KILL_AFTER <= resumed_from < logged_at_kill
  assert b["step"] == STEPS  # as run A's (the fixture checks it)

  log_a, log_b = _train_log(a_dir), _train_log(b_dir)
  assert [s for s, _, _ in log_b] == list(range(1, STEPS + 1))  # every step once
  # bit-identical losses after the resume point (the killed steps were redone identically)
  assert log_b[resumed_from:] == log_a[resumed_from:]
  assert log_b == log_a
  val = lambda d: [(e["step"], e["val_loss"]) for e in read_metrics(d) if "val_loss" in e]
  assert val(b_dir) == val(a_dir)

  # the batches are the iterator's first STEPS batches: none lost, none repeated
  it = train_iterator(data.train_tokens, cfg.data)
  expected = [batch_fingerprint(next(it)["tokens"]) for _ in range(STEPS)]
  assert [fp for _, _, fp in log_b] == expected


def test_sigint_saves_the_current_step_says_where_and_resumes_exactly(setup, uninterrupted,
                                                                      tmp_path, ctrl_c):
  """Ctrl-C during `paraflax train`: exit 130 with one line naming the checkpoint of the step
  it stopped at (periodic checkpoints are off, so that save is the only one), and the
  resumed run equals the uninterrupted one bit for bit."""
  cfg, _, env = setup
  b_dir = tmp_path / "b"
  (tmp_path / "cache").mkdir()  # the command's compilation cache: run A's
  (tmp_path / "cache" / "jax").symlink_to(env["JAX_COMPILATION_CACHE_DIR"])
  env = dict(env, PARAFLAX_CACHE=str(tmp_path / "cache"))
  argv = _command(cfg, b_dir)[3:]  # the same run through the `paraflax train` command
  argv = [a for a in argv if a != "--no-progress"] + ["--set", f"checkpoint_every={10 * STEPS}"]
  stderr = tmp_path / "stderr.txt"
  with open(stderr, "w") as f:  # a file, not a pipe: progress bars cannot fill it and block
    proc = subprocess.Popen([sys.executable, "-m", "paraflax.cli", "train", *argv], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True)
  deadline = time.monotonic() + 240
  try:
    while _logged_step(b_dir) < SIGINT_AFTER:
      assert proc.poll() is None, f"run B ended before the SIGINT:\n{stderr.read_text()}"
      assert time.monotonic() < deadline, "run B made no progress"
      time.sleep(0.005)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  err = stderr.read_text()
  assert proc.returncode == 130, err[-3000:]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
  saved = _saved_steps(b_dir)
  assert len(saved) == 1 and SIGINT_AFTER <= saved[0] < STEPS - 10
  stopped = saved[0]
  last = err.strip().splitlines()[-1]
  assert last == (f"paraflax train: interrupted at step {stopped}: saved "
                  f"{b_dir.absolute() / 'checkpoints' / str(stopped)}; run the same command "
                  "again to resume")
  assert _logged_step(b_dir) == stopped and out == ""

  # resume for a few steps (`--max-steps` keeps the schedule of `--steps`)
  until = stopped + 10
  proc = subprocess.run([sys.executable, "-m", "paraflax.training", *argv, "--max-steps",
                         str(until)], env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  b = json.loads(proc.stdout.strip().splitlines()[-1])
  assert b["start_step"] == stopped and b["step"] == until
  # every step once, and bit-identical to the uninterrupted run (losses and batches)
  assert _train_log(b_dir) == _train_log(uninterrupted)[:until]
