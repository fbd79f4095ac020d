"""DESIGN invariant 7, checkpoints: every saved step carries checksums; a flipped bit or a
truncated file is named by `load_trained`, and resuming falls back to the newest intact step
and reaches the same result; unverified (older) checkpoints load with a warning until
`paraflax checksum` writes their manifest; a params-only checkpoint is refused on resume.

One real micro run (20 steps, checkpoints at 10 and 20) is copied and damaged per test."""

import asyncio
import dataclasses
import gc
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from paraflax import cli
from paraflax.training import load_config, load_trained, train
from paraflax.training.family import ship
from paraflax.training.run import optim
from paraflax.training.run.trainer import init_opt_state, init_params
from paraflax.training.workdirs.checkpoint import CheckpointReadError, Checkpoints, verify_step
from paraflax.training.workdirs.checksums import ChecksumError, ChecksumWarning

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(cfg, workdir, summary) of a finished 20-step micro run."""
  cfg = load_config("micro_ar")
  cache = str(tmp_path_factory.mktemp("data-cache"))
  cfg = dataclasses.replace(cfg, steps=20, eval_batches=1,
                            data=dataclasses.replace(cfg.data, cache_dir=cache, progress=False))
  workdir = tmp_path_factory.mktemp("run")
  return cfg, workdir, train(cfg, workdir, progress=False)


def _copy(workdir, dst):
  shutil.copytree(workdir, dst)
  return dst


def _largest(step_dir, item="params") -> Path:
  """The largest data file of an item of a step (the one holding most weights)."""
  files = [p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


def _flip_bit(file: Path) -> None:
  raw = bytearray(file.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  file.write_bytes(bytes(raw))


def _truncate(file: Path) -> None:
  file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


def _params(model) -> dict:
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.slow
def test_every_saved_step_has_checksums_that_verify(run):
  _, workdir, _ = run
  for step in (10, 20):
    step_dir = workdir / "checkpoints" / str(step)
    assert (step_dir / "checksums.process_0.json").is_file()
    assert verify_step(step_dir)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # verified: no warning
    load_trained(workdir)


@pytest.mark.slow
def test_a_flipped_bit_is_named_and_resume_falls_back_to_the_same_result(run, tmp_path):
  cfg, workdir, summary = run
  broken = _copy(workdir, tmp_path / "w")
  bad = _largest(broken / "checkpoints" / "20")
  _flip_bit(bad)
  with pytest.raises(ChecksumError, match=rf"{bad}: crc32 .* when saved"):
    load_trained(broken)
  with pytest.warns(ChecksumWarning, match=rf"step 20 is corrupt \({bad}.*resuming from step 10"):
    resumed = train(cfg, broken, progress=False)
  assert resumed["start_step"] == 10 and resumed["step"] == 20
  assert resumed["val_loss"] == summary["val_loss"]  # the same run, bit for bit
  assert (broken / "corrupt_checkpoints" / "20").is_dir()
  got, want = _params(load_trained(broken)[0]), _params(load_trained(workdir)[0])
  assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


@pytest.mark.slow
def test_a_truncated_file_is_named_and_resume_falls_back(run, tmp_path):
  cfg, workdir, _ = run
  graphdef, params = init_params(cfg.model, cfg.seed)
  opt_state = init_opt_state(optim.optimizer(cfg.optim, cfg.schedule_steps), params)
  broken = _copy(workdir, tmp_path / "w")
  bad = _largest(broken / "checkpoints" / "20")
  _truncate(bad)
  with pytest.raises(ChecksumError, match=rf"{bad}: \d+ bytes, \d+ when saved \(truncated"):
    load_trained(broken)
  ckpt = Checkpoints(broken)
  with pytest.warns(ChecksumWarning, match=r"step 20 is corrupt.*truncated.*resuming from step 10"):
    step, restored = ckpt.restore_latest(params, opt_state)
  ckpt.close()
  assert step == 10 and restored[2] is not None
  # a cut manifest makes its step suspect too
  cut = _copy(workdir, tmp_path / "cut")
  _truncate(cut / "checkpoints" / "20" / "checksums.process_0.json")
  ckpt = Checkpoints(cut)
  with pytest.warns(ChecksumWarning, match="step 20 is corrupt.*not a valid checksum manifest"):
    assert ckpt.restore_latest(params, opt_state)[0] == 10
  ckpt.close()
  # without checksums (an older run) the unreadable step is still skipped, in one line
  old = _copy(workdir, tmp_path / "old")
  for m in old.rglob("checksums.process_*.json"):
    m.unlink()
  _truncate(_largest(old / "checkpoints" / "20"))
  with pytest.warns(ChecksumWarning), pytest.raises(CheckpointReadError,
                                                    match=r"checkpoints/20 cannot be read"):
    load_trained(old)
  ckpt = Checkpoints(old)
  with pytest.warns(ChecksumWarning, match="step 20 is corrupt.*cannot be read"):
    assert ckpt.restore_latest(params, opt_state)[0] == 10
  ckpt.close()


@pytest.mark.fast
def test_a_failed_read_leaves_no_read_pending(tmp_path, monkeypatch):
  """Orbax reads concurrently on an event loop of its own and closes it once a read fails (a
  truncated file), the other reads still pending: `Checkpoints` ends them then, so none ends
  later as an unraisable exception (orbax's reads turn the GeneratorExit into an Exception)."""
  async def read():
    try:
      await asyncio.sleep(60)
    except BaseException as e:  # as orbax's reads do, GeneratorExit included
      raise Exception("a read cut short") from e

  async def truncated():
    raise ValueError("OUT_OF_RANGE: the file is shorter than its index says")

  async def reads():
    await asyncio.gather(read(), read(), truncated())

  def restore(step, args):  # as orbax runs a restore: a loop of its own, closed on the way out
    loop = asyncio.new_event_loop()
    try:
      return loop.run_until_complete(reads())
    finally:
      loop.close()

  ckpt = Checkpoints(_copy(ROOT / "checkpoints" / "ar_drafter", tmp_path / "w"), create=False)
  monkeypatch.setattr(ckpt._mngr, "restore", restore)
  with pytest.raises(CheckpointReadError, match="cannot be read .*OUT_OF_RANGE"):
    ckpt.restore_params(ckpt.all_steps()[-1], None)
  ckpt.close()
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  gc.collect()
  assert [u.exc_value for u in unraisable] == []


@pytest.mark.slow
def test_unverified_checkpoints_warn_and_the_command_writes_checksums(run, tmp_path, capsys,
                                                                      monkeypatch):
  _, workdir, _ = run
  monkeypatch.setattr(cli, "CACHE", tmp_path / "cache")
  old = _copy(workdir, tmp_path / "old")
  for m in old.rglob("checksums.process_*.json"):
    m.unlink()
  with pytest.warns(ChecksumWarning, match="no checksums.*paraflax checksum --workdir"):
    load_trained(old)
  assert cli.main(["checksum", "--workdir", str(old)]) == 0
  assert '"steps": {"10": "wrote", "20": "wrote"}' in capsys.readouterr().out
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    load_trained(old)
  assert cli.main(["checksum", "--workdir", str(old), "--step", "20"]) == 0
  assert '"20": "verified"' in capsys.readouterr().out
  bad = _largest(old / "checkpoints" / "20")
  _flip_bit(bad)  # the manifest the command wrote now catches a change
  assert cli.main(["checksum", "--workdir", str(old)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and str(bad) in err


@pytest.mark.slow
def test_resuming_a_params_only_checkpoint_is_a_clear_error(run, tmp_path, monkeypatch):
  cfg, workdir, _ = run
  shipped = tmp_path / "shipped"
  ship(workdir, shipped)  # what the repository's checkpoints/ hold: params, no optimizer
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # its checksums still verify what is there
    load_trained(shipped)
  opened, closed = [], []  # a refused load or resume leaves no checkpoint manager open
  init, close = Checkpoints.__init__, Checkpoints.close
  monkeypatch.setattr(Checkpoints, "__init__", lambda s, *a, **k: (opened.append(s),
                                                                   init(s, *a, **k))[1])
  monkeypatch.setattr(Checkpoints, "close", lambda s: (closed.append(s), close(s))[1])
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 1 \(saved: \[20\]\)"):
    load_trained(shipped, step=1)
  with pytest.raises(ValueError, match=rf"holds params only .*init_from={shipped}"):
    train(cfg, shipped, progress=False)
  assert len(opened) == 2 and closed == opened


@pytest.mark.fast
def test_the_shipped_checkpoints_verify():
  steps = sorted((ROOT / "checkpoints").glob("*/checkpoints/*"))
  assert len(steps) >= 6
  for step_dir in steps:
    assert verify_step(step_dir), f"{step_dir} has no checksums (paraflax checksum --workdir)"
