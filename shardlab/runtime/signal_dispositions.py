"""Keeping a library's start-up from leaving a signal ignored for the rest of the process.

libtpu, loaded to compile for a TPU topology from a CPU host (plan/compiled/aot.py), sets
SIGHUP and SIGPROF to ignored for the whole process. An ignored SIGHUP means a user's planner
session or notebook outlives its terminal's hang-up, and every process it starts afterwards
inherits the ignored SIGHUP, as under `nohup` (ignored dispositions survive exec; handlers do
not). SIGPROF has to stay ignored: libtpu runs a profiling timer that sends it, and at its
default action the process ends ("Profiling timer expired"; seen when it was restored).
"""

import contextlib
import signal
import sys

STATUS = "/proc/self/status"


def ignored() -> frozenset[int] | None:
  """The signals this process ignores (the kernel's view, whoever set them), or None where
  the kernel does not say (no /proc)."""
  try:
    with open(STATUS) as f:
      mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
  except (OSError, StopIteration, ValueError):
    return None
  return frozenset(n + 1 for n in range(mask.bit_length()) if mask >> n & 1)


@contextlib.contextmanager
def kept(signals: frozenset[int]):
  """On leaving, each of `signals` that the code inside set to ignored gets back the
  disposition Python knows for it (the default, unless this program set another)."""
  before = ignored()
  try:
    yield
  finally:
    after = ignored()
    if before is not None and after is not None:
      for number in sorted((after - before) & signals):
        _restore(number)


def _restore(number: int) -> None:
  previous = signal.getsignal(number)
  if previous is None:  # set outside Python before it started: nothing to go back to
    return
  try:
    signal.signal(number, previous)
  except (ValueError, OSError) as e:  # not the main thread, or a signal Python cannot set
    print(f"warning: {signal.Signals(number).name} stays ignored in this process: {e}",
          file=sys.stderr)
