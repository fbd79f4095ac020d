"""Training checkpoints: params, optimizer state, data position and step, saved together.

Layout of `<workdir>/checkpoints/<step>/`: `params` and `opt_state` (orbax pytrees), `data`
(the grain iterator's `get_state()` as JSON, captured at save time). After `step` training
steps the iterator has yielded exactly `step` batches, so restoring all three resumes with
the next unseen batch.

On disk the params and optimizer state keep one entry per layer (`layers.<i>....`) whatever
the layout in memory: a state stacked by layer (`training/run/layout.py`, what the trainer
keeps) is unstacked to save (a per-layer copy on the devices until orbax holds it on the host)
and stacked back on restore, placed like the tree it restores.

Saving is asynchronous: `save` returns once orbax holds host copies of the arrays (the device
to host transfer; on CPU a view that keeps the next step from reusing the donated buffers)
and the iterator state; orbax writes them to `<step>.orbax-checkpoint-tmp` in a background
thread and commits by renaming it to `<step>` (on object stores, by a `commit_success.txt`).
Orbax never lists an uncommitted step, so a run killed mid-save resumes from the previous one.
`wait` (called by the next `save`, by every read and by `close`) blocks until the last save is
committed and hashed. Locations are `etils.epath` paths (`paraflax.paths.as_path`), so a
workdir may be `gs://bucket/run`: orbax, the manifests and the readers use the same code.

Checksums: once orbax has committed a step, each process lists the size and crc32 of the
files it wrote (its `*process_<i>` shards; process 0 also everything shared) in
`<step>/checksums.process_<i>.json`, in the same background thread (one streaming pass, files
in parallel), so a manifest only ever describes a complete step. A step whose manifest was
never finished loads like an older checkpoint without one (a `ChecksumWarning`). Every reader
verifies the files it is about to read (all of them, on every process, so that all processes
reach the same decision) and names the first file that differs. `restore_latest` (the
trainer's resume) falls back to the newest intact step and moves the broken newer ones to
`<workdir>/corrupt_checkpoints/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
import threading
import traceback
import warnings

import jax
import orbax.checkpoint as ocp
from etils import epath

from paraflax.json_io import read_json, write_json
from paraflax.paths import as_path
from paraflax.training.run import layout
from paraflax.training.workdirs.checksums import (
  ALGORITHM,
  ChecksumError,
  ChecksumWarning,
  digest,
  files_under,
  verify,
)

CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt_checkpoints"  # where resume moves the steps it had to skip
MANIFEST = "checksums.process_{}.json"
FORMAT = "paraflax-checksums/1"
_MANIFEST_RE = re.compile(r"checksums\.process_(\d+)\.json")
_PROCESS_RE = re.compile(r"(?:ocdbt\.)?process_(\d+)")


class CheckpointReadError(ValueError):
  """Orbax could not read a step (`verified`: whether its checksums had matched)."""

  def __init__(self, message: str, verified: bool):
    self.verified = verified
    super().__init__(message)


def _owner(rel: str, process_count: int) -> int:
  """The process that wrote file `rel` of a step: orbax names per-process shards
  `ocdbt.process_<i>` / `process_<i>`; everything else is written by process 0."""
  if process_count > 1:
    for part in rel.split("/"):
      if m := _PROCESS_RE.fullmatch(part):
        return int(m.group(1))
  return 0


def write_manifest(step_dir: str | os.PathLike, process: int = 0,
                   process_count: int = 1) -> epath.Path:
  """Write `checksums.process_<process>.json` for the files of `step_dir` this process wrote."""
  step_dir = epath.Path(step_dir)
  rels = [r for r in files_under(step_dir) if not _MANIFEST_RE.fullmatch(r)
          and _owner(r, process_count) == process]
  path = step_dir / MANIFEST.format(process)
  write_json(path, {"format": FORMAT, "algorithm": ALGORITHM, "process": process,
                    "process_count": process_count, "files": digest(step_dir, rels)})
  return path


def _read_manifest(path: epath.Path) -> dict:
  """A step's manifest; one that cannot be read is a `ChecksumError` (the step is suspect)."""
  try:
    manifest = read_json(path)
    if manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict):
      return manifest
  except (ValueError, AttributeError):
    pass
  raise ChecksumError(path, "not a valid checksum manifest (truncated or corrupt)")


def verify_step(step_dir: str | os.PathLike, items: tuple[str, ...] | None = None) -> bool:
  """Check the files of `step_dir` against its manifests: top-level files and those of `items`
  (default: every item). Entries of an item whose directory is absent (the optimizer state of
  a params-only copy) are skipped: the caller decides which items it needs. Returns False when
  the step has no manifest; raises `ChecksumError` naming the first file that differs."""
  step_dir = epath.Path(step_dir)
  found = sorted(step_dir.glob("checksums.process_*.json"))
  if not found:
    return False
  count = _read_manifest(found[0])["process_count"]
  for i in range(count):
    if not (step_dir / MANIFEST.format(i)).is_file():
      raise ChecksumError(step_dir / MANIFEST.format(i),
                          f"missing (process {i} of {count} never finished hashing its files)")
  for i in range(count):
    manifest = step_dir / MANIFEST.format(i)
    files = {rel: d for rel, d in _read_manifest(manifest)["files"].items()
             if "/" not in rel or (step_dir / rel.split("/")[0]).is_dir()
             and (items is None or rel.split("/")[0] in items)}
    verify(step_dir, files, manifest.name)
  return True


def _root_cause(e: BaseException) -> str:
  """The first line of the innermost exception of a chain (tensorstore's, naming the key)."""
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:300]


def _end_abandoned_reads(error: BaseException) -> None:
  """End the reads a failed orbax restore left pending: orbax runs a restore's reads on an
  event loop of its own and closes it as soon as one read fails (a truncated file), the
  others still pending. Each would end at some later garbage collection as an unraisable
  exception (orbax turns the GeneratorExit that closes it into an Exception); closed here,
  they end now. `error` is what the restore raised: its frames hold that loop."""
  chain = [error]
  while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None:
    chain.append(cause)
  loops = {id(v): v for e in chain for frame, _ in traceback.walk_tb(e.__traceback__)
           for v in frame.f_locals.values()
           if isinstance(v, asyncio.AbstractEventLoop) and v.is_closed()}
  for loop in loops.values():
    for task in asyncio.all_tasks(loop):
      with contextlib.suppress(Exception):
        task.get_coro().close()


class _Commit(threading.Thread):
  """Waits for orbax to commit the save in flight, then `write_manifest`s the step, in the
  background; `join_or_raise` re-raises what either raised."""

  def __init__(self, mngr: ocp.CheckpointManager, *args):
    super().__init__(daemon=True, name="checkpoint-commit")
    self._mngr, self._args, self.error = mngr, args, None
    self.start()

  def run(self):
    try:
      self._mngr.wait_until_finished()
      write_manifest(*self._args)
    except BaseException as e:  # surfaced by join_or_raise in the training thread
      self.error = e

  def join_or_raise(self):
    self.join()
    if self.error is not None:
      raise self.error


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def _per_layer(params, opt_state) -> tuple:
  """(params, opt_state) as checkpoints hold them: one entry per layer (new arrays, each
  layer placed like its stack, when they are stacked)."""
  if not layout.is_stacked(params):
    return params, opt_state
  tree = (params, opt_state)
  return jax.jit(layout.unstack, out_shardings=_shardings(layout.unstacked_like(tree)))(tree)


def _stacked_like(tree, like):
  """`tree` (per layer, as read) stacked and placed like `like`."""
  return jax.jit(layout.stack, out_shardings=_shardings(like))(tree)


def checkpoint_dir(workdir: str | os.PathLike) -> epath.Path:
  """Where orbax keeps a workdir's steps: `<workdir>/checkpoints`, local or `gs://`."""
  return as_path(workdir) / CHECKPOINTS


class Checkpoints:
  """A thin orbax `CheckpointManager` over `<workdir>/checkpoints`, with checksums."""

  def __init__(self, workdir: str | os.PathLike, keep: int = 2, *, create: bool = True):
    directory = checkpoint_dir(workdir)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=True,
                                           cleanup_tmp_directories=create)
    self.directory = directory
    self._mngr = ocp.CheckpointManager(directory, options=options)
    self._commit: _Commit | None = None

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def latest_step(self) -> int | None:
    """The newest committed step (after `wait`)."""
    self.wait()
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    """The committed steps (after `wait`), oldest first."""
    self.wait()
    return sorted(self._mngr.all_steps())

  def save(self, step: int, params, opt_state, data_state: dict) -> None:
    """Start saving step `step` (all three parts, or none of them); returns once the arrays
    are copied to the host: writing, committing and hashing follow in the background."""
    self.wait()  # the previous step is committed and hashed before orbax may delete it
    params, opt_state = _per_layer(params, opt_state)
    self._mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(copy.deepcopy(data_state))), force=True)
    self._commit = _Commit(self._mngr, self.step_dir(step), jax.process_index(),
                           jax.process_count())

  def saving(self) -> bool:
    """Whether a save is still being written, committed or hashed."""
    return self._commit is not None and self._commit.is_alive()

  def wait(self) -> None:
    """Until the last save is committed and its checksums are written."""
    if self._commit is not None:
      commit, self._commit = self._commit, None
      commit.join_or_raise()

  def _read(self, step: int, items: tuple[str, ...], args) -> dict:
    """Verify the files of `items` (a `ChecksumWarning` when the step has none), then read."""
    self.wait()
    step_dir = self.step_dir(step)
    verified = verify_step(step_dir, items)
    if not verified:
      warnings.warn(f"checkpoint {step_dir} has no checksums (saved before paraflax wrote "
                    "them, or stopped while hashing): loading it unverified; `paraflax checksum "
                    f"--workdir {self.directory.parent}` writes them", ChecksumWarning,
                    stacklevel=3)
    try:
      return self._mngr.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:  # orbax/tensorstore raise many kinds: one line, naming the step
      _end_abandoned_reads(e)
      raise CheckpointReadError(f"checkpoint {step_dir} cannot be read ({_root_cause(e)})",
                                verified) from None

  def restore(self, step: int, params_like, opt_state_like) -> tuple:
    """(params, opt_state, data_state) of `step`, shaped and placed like the given pytrees
    (per layer or stacked by layer: `layout.py`), verified.

    A params-only step (a shipped model, a `paraflax convert` output) is refused with a clear
    message: it cannot resume the run exactly, and `init_from` trains on from its weights.
    """
    self.wait()
    if not (self.step_dir(step) / "opt_state").is_dir():
      workdir = self.directory.parent
      raise ValueError(f"checkpoint {self.step_dir(step)} holds params only (no optimizer "
                       "state: a shipped or converted model), so training cannot resume from "
                       f"it; train on from its weights in a fresh workdir with --set "
                       f"init_from={workdir}")
    like = (params_like, opt_state_like)
    stacked = layout.is_stacked(params_like)
    target = layout.unstacked_like(like) if stacked else like
    out = self._read(step, ("params", "opt_state", "data"), dict(
        params=ocp.args.StandardRestore(target[0]),
        opt_state=ocp.args.StandardRestore(target[1]),
        data=ocp.args.JsonRestore()))
    state = (out["params"], out["opt_state"])
    return *(_stacked_like(state, like) if stacked else state), out["data"]

  def restore_latest(self, params_like, opt_state_like) -> tuple[int, tuple | None]:
    """(step, `restore(step, ...)`) of the newest intact step; (0, None) when none is saved.

    A newer step whose checksums fail (or that cannot be read and has none) is skipped with a
    warning and moved to `<workdir>/corrupt_checkpoints/` once an older one has been read, so
    training goes on from there and saves that step anew. When no step is intact, the newest
    step's error is raised.
    """
    skipped = []
    for step in reversed(self.all_steps()):
      try:
        out = self.restore(step, params_like, opt_state_like)
      except (ChecksumError, CheckpointReadError) as e:
        if isinstance(e, CheckpointReadError) and e.verified:
          raise  # intact files orbax cannot read: not corruption, and older steps won't help
        skipped.append((step, e))
        continue
      for bad, e in skipped:
        warnings.warn(f"checkpoint step {bad} is corrupt ({e}); resuming from step {step}",
                      ChecksumWarning, stacklevel=2)
      self._set_aside([bad for bad, _ in skipped])
      return step, out
    if skipped:
      raise CheckpointReadError(f"no checkpoint in {self.directory} is intact; the newest: "
                                f"{skipped[0][1]}", verified=False) from None
    return 0, None

  def _set_aside(self, steps: list[int]) -> None:
    """Move `steps` out of the manager's directory (process 0, between barriers)."""
    if not steps:
      return
    many = jax.process_count() > 1
    if many:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("paraflax-set-aside-start")
    if jax.process_index() == 0:
      dest = self.directory.parent / CORRUPT
      dest.mkdir(exist_ok=True)
      for step in steps:
        target, n = dest / str(step), 1
        while target.exists():
          target, n = dest / f"{step}.{n}", n + 1
        self.step_dir(step).rename(target)
    if many:
      multihost_utils.sync_global_devices("paraflax-set-aside-end")
    self._mngr.reload()

  def restore_params(self, step: int, params_like):
    """Only the params of `step` (for generation), verified: no optimizer state is read."""
    return self._read(step, ("params",), dict(
        params=ocp.args.StandardRestore(params_like)))["params"]

  def checksum(self, step: int) -> str:
    """Verify `step` against its manifest ("verified"), or write one if it has none
    ("wrote": an older checkpoint, hashed as it is now, by this process alone)."""
    if verify_step(self.step_dir(step)):
      return "verified"
    write_manifest(self.step_dir(step))
    return "wrote"

  def close(self) -> None:
    """`wait` for the last save, then release orbax's threads."""
    try:
      self.wait()
    finally:
      self._mngr.close()


def checksum_workdir(workdir: str | os.PathLike, step: int | None = None) -> dict:
  """Verify each saved step (or `step`) of a workdir against its checksums, writing them for a
  step that has none (an older run, a shipped model). Returns {"workdir", "steps": {step:
  "verified" | "wrote"}}; a file that differs is a `ChecksumError` naming it."""
  workdir = as_path(workdir)
  if not (workdir / CHECKPOINTS).is_dir():
    raise FileNotFoundError(f"no {CHECKPOINTS}/ in {str(workdir)!r}: not a training workdir")
  ckpt = Checkpoints(workdir, create=False)
  try:
    steps = ckpt.all_steps()
    if step is not None and step not in steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in {str(ckpt.directory)!r} "
                              f"(saved: {steps})")
    return {"workdir": str(workdir),
            "steps": {s: ckpt.checksum(s) for s in (steps if step is None else [step])}}
  finally:
    ckpt.close()
