"""One run per checkpoint directory: a run holds DIR/.shardlab-lock for its lifetime.

The lock is an `fcntl.flock` on that file, so the kernel releases it when the holder dies,
however it dies: a lock file whose flock is free is stale by definition and is taken over
(with a warning naming the run that left it). The file's JSON body names the holder (host,
pid, start time, command) only for the message a refused run prints. A clean release
removes the file, so a finished run leaves nothing behind.

Several processes of ONE run write one directory together: only process 0 takes the lock
(the others would refuse each other); a second run's process 0 is refused, and its other
processes are stopped by the multi-process watchdog with that error. Readers (`generate`,
`convert to-hf`, `--init-from`) take no lock: a finished step never changes under them.
"""

import atexit
import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
from pathlib import Path

import jax

from shardlab.errors import ConfigError

LOCK_NAME = ".shardlab-lock"
_held: dict[Path, "DirectoryLock"] = {}  # resolved directory -> this process's lock on it


class CheckpointDirInUse(ConfigError):
  """Another live run holds the checkpoint directory."""


def _holder_text(body: dict) -> str:
  return (f"pid {body.get('pid', '?')} on host {body.get('host', '?')}, started "
          f"{body.get('started', '?')}, command: {body.get('command', '?')}")


def _read_body(fd: int) -> dict:
  try:
    raw = os.pread(fd, 65536, 0)
    body = json.loads(raw) if raw.strip() else {}
    return body if isinstance(body, dict) else {}
  except (OSError, ValueError):  # being written just now, or not ours: no holder to name
    return {}


class DirectoryLock:
  """The flock of one run on `directory` (created if missing)."""

  def __init__(self, directory: str | Path, flag: str = "--checkpoint-dir",
               warn=None):
    self.directory = Path(directory).absolute()
    self.path = self.directory / LOCK_NAME
    self.directory.mkdir(parents=True, exist_ok=True)
    self.fd = self._acquire(flag, warn or (lambda text: print(text, file=sys.stderr,
                                                                 flush=True)))
    body = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv) or sys.executable}
    os.ftruncate(self.fd, 0)
    os.pwrite(self.fd, json.dumps(body).encode(), 0)

  def _acquire(self, flag: str, warn) -> int:
    # Retried when the file was removed between our open and our flock (its holder released
    # it cleanly): a lock on an unlinked file would exclude nobody.
    for _ in range(100):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        body = _read_body(fd)
        os.close(fd)
        raise CheckpointDirInUse(
            f"{flag} {str(self.directory)!r} is in use by another run ({_holder_text(body)}); "
            f"two runs saving into one directory would overwrite each other's steps. Wait "
            f"for that run to finish or stop it, or choose another {flag}") from None
      except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
          raise ConfigError(f"{flag} {str(self.directory)!r} cannot be locked ({e.strerror}): "
                            f"this filesystem does not support file locks; choose a "
                            f"directory on one that does") from None
        raise
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        self._warn_if_stale(_read_body(fd), warn)
        return fd
      os.close(fd)
    raise ConfigError(f"{flag} {str(self.directory)!r}: could not take its lock file "
                      f"{self.path} (it keeps being replaced)")

  def _warn_if_stale(self, body: dict, warn) -> None:
    """A body without a held flock: its run ended without releasing (killed, or crashed)."""
    if not body:
      return
    if body.get("host") == socket.gethostname() and _alive(body.get("pid")):
      gone = "holds no lock any more (it is another process now, or it released it)"
    else:
      gone = "is gone"
    warn(f"warning: taking over the lock of {self.directory} left by a run that ended "
         f"without releasing it ({_holder_text(body)}); that process {gone}")

  def release(self) -> None:
    if self.fd is None:
      return
    try:  # removed while still held, so no other run can be holding this very file
      os.unlink(self.path)
    except OSError:
      pass
    os.close(self.fd)  # closing the last descriptor releases the flock
    self.fd = None


def _alive(pid) -> bool:
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process: alive
    return True
  return True


def lock(directory: str | Path, flag: str = "--checkpoint-dir", warn=None) -> None:
  """Takes the run's lock on `directory` (process 0 of a run only; a no-op if this process
  holds it already). Raises CheckpointDirInUse naming the holder."""
  if jax.process_index() != 0:
    return
  key = Path(directory).absolute()
  if key not in _held:
    _held[key] = DirectoryLock(key, flag, warn)


def unlock(directory: str | Path) -> None:
  """Releases this process's lock on `directory`, if it holds one."""
  held = _held.pop(Path(directory).absolute(), None)
  if held is not None:
    held.release()


def holds(directory: str | Path) -> bool:
  return Path(directory).absolute() in _held


@atexit.register
def release_all() -> None:
  """Every lock this process holds (a run that failed before closing its checkpointer, or
  one leaving through os._exit)."""
  for key in list(_held):
    unlock(key)
