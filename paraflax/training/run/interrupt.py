"""Ctrl-C (SIGINT) as a request to stop at the next safe point, not a traceback.

The training loop checks `requested` between steps, saves a checkpoint there and raises
`Interrupted`; a second Ctrl-C interrupts at once (a plain `KeyboardInterrupt`). Commands turn
any `KeyboardInterrupt` into one line (its message) and exit code 130 (128 + SIGINT).
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(KeyboardInterrupt):
  """Stopped by Ctrl-C at a safe point; the message says what was kept."""


class _Request:
  requested = False


@contextlib.contextmanager
def deferred_sigint(enabled: bool = True):
  """Within the block, the first SIGINT only sets `.requested` on the yielded object (the
  second raises KeyboardInterrupt). A no-op off the main thread, where SIGINT is ignored, or
  when not `enabled`."""
  req = _Request()
  previous = signal.getsignal(signal.SIGINT)
  if (not enabled or threading.current_thread() is not threading.main_thread()
      or previous == signal.SIG_IGN):  # e.g. a background job: Ctrl-C is not for it
    yield req
    return

  def handler(signum, frame):
    req.requested = True
    signal.signal(signal.SIGINT, previous)  # a second Ctrl-C interrupts at once

  previous = signal.default_int_handler if previous is None else previous  # set outside Python
  signal.signal(signal.SIGINT, handler)
  try:
    yield req
  finally:
    signal.signal(signal.SIGINT, previous)
