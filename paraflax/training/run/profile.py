"""`paraflax train --profile-steps A:B`: a `jax.profiler` trace of training steps A..B-1.

The window is a Python slice of the 0-based step index (`2:4` traces the third and fourth
steps, logged as steps 3 and 4). The trace goes to `<workdir>/profile/plugins/profile/<run>/`
(`*.xplane.pb` for XProf / TensorBoard, `*.trace.json.gz` for Perfetto); the device is synced
at both ends, so the trace holds exactly those steps. Steps a resumed run has already done are
not traced again.
"""

from __future__ import annotations

import jax

PROFILE_DIR = "profile"


def parse_steps(text: str) -> tuple[int, int]:
  """"A:B" -> (A, B) with 0 <= A < B; a one-line ValueError otherwise."""
  a, sep, b = text.partition(":")
  try:
    window = (int(a), int(b)) if sep else None
  except ValueError:
    window = None
  if window is None or not 0 <= window[0] < window[1]:
    raise ValueError(f"--profile-steps expects A:B with 0 <= A < B (steps A..B-1, 0-based), "
                     f"got {text!r}")
  return window


class StepTrace:
  """Starts a trace before step `window[0]` and stops it after step `window[1] - 1`."""

  def __init__(self, window: tuple[int, int] | None, directory):
    self.window, self.directory, self.active = window, directory, False

  def before(self, step: int, state) -> None:
    """Call before running step `step`; `state` is synced before the trace starts."""
    if self.window is not None and not self.active and self.window[0] <= step < self.window[1]:
      jax.block_until_ready(state)
      jax.profiler.start_trace(str(self.directory))
      self.active = True

  def after(self, step: int, state) -> None:
    """Call after dispatching step `step`; at the window's last step, sync and stop."""
    if self.active and step + 1 >= self.window[1]:
      self.stop(state)

  def stop(self, state=None) -> None:
    if self.active:
      if state is not None:
        jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False
