"""One writer per directory: an exclusive OS advisory lock on `<dir>/paraflax.lock`.

`train` holds it on its workdir for the whole run, `collect-trajectories` and `teacher-data`
on the store they fill (on multi-host runs, process 0 holds it). A second writer, in another
process or this one, gets `LockedError`: one line naming the holder's pid and host.

The lock is `fcntl.flock` on the file, so the kernel drops it when the holder exits however
it exits (kill -9 included): a stale lock file never blocks a later run. The file's content,
`{"pid", "host", "since"}` of the holder, only serves the refusal message. A holder that
fails before writing anything else there removes the lock file it made (and the directory,
if it made that too): a refused run leaves nothing behind. Readers
(`load_trained`, reading a finished store) take no lock. On a filesystem without locks (some
FUSE mounts) the run goes on with a warning instead.

Object stores (`gs://...`) have no locks that a killed holder releases: a marker object would
block every later run after a kill -9 until someone deletes it. So a remote directory is not
locked: the run goes on with a `RemoteLockWarning` (one writer per workdir is then the user's
job, as with orbax itself) and nothing is written there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings

from etils import epath

LOCK = "paraflax.lock"


class LockedError(ValueError):
  """The directory is being written by another run (a ValueError: a user error, one line)."""


class RemoteLockWarning(UserWarning):
  """A directory on an object store, which cannot be locked: a second writer is not detected."""


class DirLock:
  """Exclusive lock on `directory` (created if missing); a context manager."""

  def __init__(self, directory: str | os.PathLike, *, what: str = "directory"):
    self.directory = epath.Path(directory)
    self.path = self.directory / LOCK
    self.what = what
    self._fd: int | None = None
    self._made: tuple[bool, bool] = (False, False)  # (the directory, the lock file) made here

  def acquire(self) -> DirLock:
    if self._fd is not None:
      raise RuntimeError(f"{self.path} is already held by this DirLock")
    if "://" in os.fspath(self.directory):  # `paths.is_remote`, inline: lock.py stands alone
      warnings.warn(f"{self.what} {str(self.directory)!r} is on an object store, which has no "
                    "locks: a second run writing there would not be detected", RemoteLockWarning,
                    stacklevel=2)
      return self
    made = (not self.directory.exists(), not self.path.exists())
    self.directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncate the holder's note
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      note = _read(fd)
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise LockedError(f"{self.what} {str(self.directory)!r} is in use by another run "
                          f"({_describe(note)}); wait for it to end or use another "
                          "directory") from None
      warnings.warn(f"could not lock {str(self.path)!r} ({e}): a second run on this "
                    f"{self.what} would not be detected", stacklevel=2)
      return self
    note = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
    self._fd, self._made = fd, made
    return self

  def _remove_if_alone(self) -> None:
    """Remove the lock file this holder made, and the directory it made, when nothing else was
    written there (still holding the lock, so no other run takes it meanwhile)."""
    made_dir, made_file = self._made
    if made_file and [p.name for p in self.directory.iterdir()] == [LOCK]:
      self.path.unlink()
      if made_dir:
        self.directory.rmdir()

  def release(self) -> None:
    if self._fd is not None:
      os.ftruncate(self._fd, 0)  # no misleading note once nobody holds it
      os.close(self._fd)  # closing the descriptor drops the lock
      self._fd = None

  def __enter__(self) -> DirLock:
    return self.acquire()

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is not None and self._fd is not None:
      self._remove_if_alone()
    self.release()


def hold(directory: str | os.PathLike, *, what: str):
  """`DirLock(directory)` on process 0, nothing on the other processes of a multi-host run."""
  import jax
  if jax.process_index() != 0:
    return contextlib.nullcontext()
  return DirLock(directory, what=what)


def _read(fd: int) -> dict:
  try:
    return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
  except (OSError, ValueError):
    return {}


def _describe(note: dict) -> str:
  if "pid" not in note:
    return "its pid is not recorded yet"
  return f"pid {note['pid']} on host {note.get('host', '?')}, since {note.get('since', '?')}"
