"""What the libraries under a run log through Python's `logging`, kept off the console.

Orbax logs through absl (the "absl" logger), JAX through "jax.*": a failed checkpoint save
alone prints hundreds of lines of their records and tracebacks before the run's own one-line
error. `LibraryLogs` sends those loggers' records (and what C++ library threads print
through Python) to a file, RUN_DIR/run.log once the run dir is known (a temporary file until
then, or without one; each made only when something is logged), and `summary` says in one
line what they said and where to read it. The run's own messages never go through
`logging`, so they stay on the console.
"""

import gc
import logging
import os
import secrets
import sys
import tempfile
import threading
from pathlib import Path

# The loggers libraries log through: absl (Orbax and other Google libraries), JAX, and the
# ones Orbax's dependencies use directly; asyncio's, where Orbax's failed write tasks are
# reported ("Task exception was never retrieved", with a traceback) when they are collected.
LOGGERS = ("absl", "orbax", "jax", "etils", "tensorstore", "asyncio")
# Kept on the file after the capture ends, for the rest of the process: Orbax's failed tasks
# that its event loop still holds are reported at interpreter shutdown, after our last word.
KEPT = ("asyncio",)
_FORMAT = "%(asctime)s %(levelname)s %(name)s %(pathname)s:%(lineno)d] %(message)s"


def _source(record: logging.LogRecord) -> str:
  """Which library spoke: the package its file is in (Orbax logs as "absl"), else the
  logger's top-level name."""
  parts = Path(record.pathname).parts
  if "site-packages" in parts and parts.index("site-packages") + 1 < len(parts):
    return parts[parts.index("site-packages") + 1].removesuffix(".py")
  return record.name.split(".")[0]


class _Counting(logging.FileHandler):
  """A file handler that also counts what it wrote: lines and errors per library, and the
  last error's first line."""

  def __init__(self, path: str):
    super().__init__(path, mode="a", delay=True)
    self.setFormatter(logging.Formatter(_FORMAT))
    self.lines: dict[str, int] = {}
    self.error_counts: dict[str, int] = {}  # (`errors` is the file's encoding errors)
    self.last_error = ""

  def emit(self, record: logging.LogRecord) -> None:
    try:  # never raise into the library that logs: Orbax's error would be lost
      source, text = _source(record), self.format(record)
      self.lines[source] = self.lines.get(source, 0) + len(text.splitlines())
      if record.levelno >= logging.ERROR:
        self.error_counts[source] = self.error_counts.get(source, 0) + 1
        message = record.getMessage().splitlines() or [""]
        self.last_error = f"{source}: {message[0][:200]}"
    except Exception:
      self.handleError(record)
    super().emit(record)

  def write_raw(self, source: str, text: str) -> None:
    """Text a library printed itself (not a record), appended as it came."""
    self.acquire()
    try:
      self.lines[source] = self.lines.get(source, 0) + text.count("\n")
      if self.stream is None:
        self.stream = self._open()
      self.stream.write(text)
      self.stream.flush()
    except Exception:
      pass  # never raise into the thread that prints
    finally:
      self.release()


class _ForeignThreadsToLog:
  """sys.stderr, except that what threads Python did not start write (C++ library threads
  calling back into Python: tensorstore's futures print "Event loop is closed" tracebacks
  after a failed Orbax save) goes to the log. Every thread Python started, ours and the
  main one, writes to the console as before."""

  SOURCE = "library threads"

  def __init__(self, stream, handler: _Counting):
    self._stream, self._handler = stream, handler

  def write(self, text: str) -> int:
    if isinstance(threading.current_thread(), threading._DummyThread):
      self._handler.write_raw(self.SOURCE, text)
      return len(text)
    return self._stream.write(text)

  def __getattr__(self, name):
    return getattr(self._stream, name)


class LibraryLogs:
  """While entered, the `LOGGERS`' records go to a file instead of the console (their own
  levels unchanged). `run_dir` may be set later (`keep_in`); the file then moves there."""

  def __init__(self, run_dir: str | None = None):
    # Made at the first record only: a run that logs nothing (or leaves through os._exit,
    # as a stopped multi-process run does) leaves no file.
    self.path = os.path.join(tempfile.gettempdir(),
                             f"shardlab-{os.getpid()}-{secrets.token_hex(4)}.log")
    self._handler = _Counting(self.path)
    self._saved: dict[str, bool] = {}
    self._stderr = None
    self._kept = False
    if run_dir:
      self.keep_in(run_dir)

  def __enter__(self) -> "LibraryLogs":
    for name in KEPT:  # an earlier capture's handler, left attached
      for handler in [h for h in logging.getLogger(name).handlers if isinstance(h, _Counting)]:
        logging.getLogger(name).removeHandler(handler)
    for name in LOGGERS:
      logger = logging.getLogger(name)
      self._saved[name] = logger.propagate
      logger.addHandler(self._handler)
      logger.propagate = False  # not on to the root logger's console handler
    self._stderr = sys.stderr
    sys.stderr = _ForeignThreadsToLog(sys.stderr, self._handler)
    return self

  def __exit__(self, *exc) -> bool:
    # Failed asyncio tasks nobody awaited are reported when collected: collect them now,
    # while their reports still go to the file, not at some later point on the console.
    gc.collect()
    if isinstance(sys.stderr, _ForeignThreadsToLog):
      sys.stderr = self._stderr
    for name, propagate in self._saved.items():
      if name in KEPT:  # left attached: see KEPT
        continue
      logger = logging.getLogger(name)
      logger.removeHandler(self._handler)
      logger.propagate = propagate
    self._handler.close()
    return False

  def keep_in(self, run_dir: str, name: str = "run.log") -> None:
    """From now on the log is RUN_DIR/`name` (what was logged so far moves there); if
    the run dir cannot be written, the log stays where it is (the run says why later)."""
    target = Path(run_dir) / name
    self._handler.acquire()
    try:
      self._handler.close()
      try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(self.path).exists():  # what was logged so far
          with open(target, "a") as out:
            out.write(Path(self.path).read_text(errors="replace"))
      except OSError:
        return
      if not self._kept:
        Path(self.path).unlink(missing_ok=True)
      self.path = self._handler.baseFilename = str(target)
      self._kept = True
    finally:
      self._handler.release()

  def summary(self) -> str | None:
    """One line on what the libraries logged, or None if nothing."""
    h = self._handler
    if not h.lines:
      return None
    said = ", ".join(
        f"{source} logged {n} line{'s' if n != 1 else ''}"
        + (f" ({h.error_counts[source]} error{'s' if h.error_counts[source] != 1 else ''})"
           if h.error_counts.get(source) else "")
        for source, n in sorted(h.lines.items(), key=lambda kv: -kv[1]))
    last = f"; last error: {h.last_error}" if h.last_error else ""
    return f"{said} — see {self.path}{last}"
