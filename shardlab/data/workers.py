"""The tokenizing processes of `data prepare` (and of text tokenized at a run's start).

Spawned, not forked: the caller may be a multithreaded JAX process. Only a few chunks are
in flight at a time, so the source is streamed, never held whole in pending work. No
worker outlives its parent: the kernel kills each one when the parent dies however it
dies (SIGKILL, a crash: PR_SET_PDEATHSIG, as runtime/launch.py does for ranks), an
exception or Ctrl-C in the parent kills them at once, and they ignore the terminal's
SIGINT (it reaches the whole process group; the parent decides).
"""

import collections
import contextlib
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from typing import Callable, Iterable, Iterator

from shardlab.errors import ConfigError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
IN_FLIGHT_PER_WORKER = 2
# Tests only: seconds each chunk sleeps in its worker, to interrupt a prepare mid-way.
DELAY_ENV = "SHARDLAB_TEST_WORKER_DELAY_S"
_delay_s = 0.0


def _start(parent: int, initializer: Callable, initargs: tuple) -> None:
  global _delay_s
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
      os._exit(1)
  _delay_s = float(os.environ.get(DELAY_ENV) or 0)
  initializer(*initargs)


def _call(fn: Callable, item):
  if _delay_s:
    time.sleep(_delay_s)
  return fn(item)


@contextlib.contextmanager
def _main_not_rerun():
  """A spawned process first re-runs the parent's __main__ (its file, or its module under
  `python -m`): for the `shardlab` command that is the whole CLI and JAX, seconds and
  hundreds of MB per worker, none of which a worker uses. Hidden while workers start."""
  main = sys.modules.get("__main__")
  saved = {k: main.__dict__[k] for k in ("__file__", "__spec__")
           if main is not None and k in main.__dict__}
  if main is not None:
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
  try:
    yield
  finally:
    if main is not None:
      main.__dict__.update(saved)


class Pool:
  """`with Pool(n, init, args) as pool: for out in pool.map(fn, items)`: results in order.
  Leaving the block by an exception (KeyboardInterrupt included) kills the workers."""

  def __init__(self, workers: int, initializer: Callable, initargs: tuple = ()):
    self.workers = workers
    self.pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
        initargs=(os.getpid(), initializer, initargs))

  def map(self, fn: Callable, items: Iterable) -> Iterator:
    pending = collections.deque()
    for item in items:
      with _main_not_rerun():  # a submit may start a worker
        pending.append(self.pool.submit(_call, fn, item))
      if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
        yield self._result(pending.popleft())
    while pending:
      yield self._result(pending.popleft())

  @staticmethod
  def _result(future):
    try:
      return future.result()
    except concurrent.futures.process.BrokenProcessPool:
      raise ConfigError("a tokenizing worker process died (killed, or out of memory?); "
                        "try fewer --workers") from None

  def __enter__(self) -> "Pool":
    return self

  def __exit__(self, kind, *_) -> bool:
    if kind is None:
      self.pool.shutdown(wait=True)
    else:
      self.kill()
    return False

  def kill(self) -> None:
    # ProcessPoolExecutor has no public kill before Python 3.14 (terminate_workers).
    procs = list((getattr(self.pool, "_processes", None) or {}).values())
    manager = getattr(self.pool, "_executor_manager_thread", None)
    # The workers first: nothing after this (the executor's lock, which an interrupt may
    # have caught half-taken, or its manager thread) can then keep one running.
    for p in procs:
      if p.is_alive():
        p.kill()
    # The queue's feeder thread may be stuck writing a chunk into the pipe of a worker that
    # is gone (a chunk larger than the pipe's buffer): the manager thread would wait for it
    # on shutdown, and concurrent.futures' exit hook for the manager, without a timeout
    # (seen once: the command printed its "interrupted" line and never exited).
    call_queue = getattr(self.pool, "_call_queue", None)
    if call_queue is not None:
      call_queue.cancel_join_thread()
    self.pool.shutdown(wait=False, cancel_futures=True)
    # The pool's manager thread sees its workers gone and closes its wake-up pipe. Joined
    # here, it cannot be closing that pipe while concurrent.futures' exit hook writes to it
    # (without a lock): a race that, on a loaded machine, printed an EBADF traceback after
    # the command's one-line "interrupted" message.
    if manager is not None:
      manager.join(timeout=30)
    for p in procs:
      p.join(timeout=5)
