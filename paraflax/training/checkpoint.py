"""Training checkpoints: params, optimizer state, data position and step, saved together.

Layout of `<workdir>/checkpoints/<step>/`: `params` and `opt_state` (orbax pytrees), `data`
(the grain iterator's `get_state()` as JSON, captured at save time). After `step` training
steps the iterator has yielded exactly `step` batches, so restoring all three resumes with
the next unseen batch. Orbax writes each step to a temporary directory and renames it when
complete, so a run killed mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import orbax.checkpoint as ocp

CHECKPOINTS = "checkpoints"


class Checkpoints:
  """A thin orbax `CheckpointManager` over `<workdir>/checkpoints`."""

  def __init__(self, workdir: str | os.PathLike, keep: int = 2, *, create: bool = True):
    directory = Path(workdir).absolute() / CHECKPOINTS
    # Synchronous saves: the step donates its input buffers, so an async writer could read
    # a buffer the next step has already reused.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=create)
    self.directory = directory
    self._mngr = ocp.CheckpointManager(directory, options=options)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def save(self, step: int, params, opt_state, data_state: dict) -> None:
    """Save step `step` (all three parts, or none of them)."""
    self._mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(copy.deepcopy(data_state))), force=True)

  def restore(self, step: int, params_like, opt_state_like) -> tuple:
    """(params, opt_state, data_state) of `step`, shaped like the given pytrees."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_like),
        opt_state=ocp.args.StandardRestore(opt_state_like),
        data=ocp.args.JsonRestore()))
    return out["params"], out["opt_state"], out["data"]

  def restore_params(self, step: int, params_like):
    """Only the params of `step` (for generation): no optimizer state is read."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_like)))
    return out["params"]

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()
