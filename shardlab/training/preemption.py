"""Turns SIGTERM/SIGINT into a request to checkpoint and stop at a step boundary, the same
step on every process of a multi-process run."""

import os
import signal
import sys

import jax
from jax.experimental import multihost_utils

from shardlab.runtime import distributed


class StopRequest:
  """Context manager: while active, the first SIGTERM or SIGINT only asks the loop to stop;
  a second SIGINT interrupts at once (KeyboardInterrupt), for an impatient Ctrl-C.

  One process: `due(step)` says whether a signal came. Several processes: a signal may reach
  only one of them (a preempted host, a Ctrl-C in one terminal), and a process that stopped
  alone would leave the others waiting in the next step's collectives. So SIGTERM is left to
  JAX's preemption notifier (installed by jax.distributed.initialize), a SIGINT is passed on
  to it as SIGTERM, and `due(step)` asks JAX's preemption sync manager, which returns true
  on every process at the same step (a local check per step, ~20 µs; no collective)."""

  def __init__(self, coordinated: bool | None = None):
    self.coordinated = (distributed.coordinated_preemption() if coordinated is None
                        else coordinated)
    self.signal_name: str | None = None
    self._calls = 0  # due() calls in this run: the sync manager's counter (see due)
    self._interrupted = False
    self._previous = {}

  def _handle(self, signum, frame):
    if self._interrupted and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self._interrupted = True
    if self.coordinated:  # JAX's notifier tells every process; the sync point stops them
      os.kill(os.getpid(), signal.SIGTERM)
    else:
      self.signal_name = signal.Signals(signum).name

  def due(self, step: int) -> str | None:
    """The signal to stop for after `step`, or None. Call it after every step, on every
    process (the sync manager counts the calls)."""
    if not self.coordinated or self.signal_name is not None:
      return self.signal_name
    # The manager sets the sync point one past the largest counter any process last passed
    # (0 before the first call) and waits for that exact value. So the counter counts this
    # run's calls from 1: step numbers of a resumed run start past 1, and a notice before
    # its first step was never matched (the run went on, unsaved, until SIGKILL).
    self._calls += 1
    if multihost_utils.reached_preemption_sync_point(self._calls):
      self.signal_name = "SIGTERM"
      print(f"process {jax.process_index()}: a preemption notice (SIGTERM) reached "
            f"the run; every process stops and saves at step {step}", file=sys.stderr,
            flush=True)
    return self.signal_name

  def __enter__(self):
    signals = (signal.SIGINT,) if self.coordinated else (signal.SIGTERM, signal.SIGINT)
    for s in signals:
      self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    return False
