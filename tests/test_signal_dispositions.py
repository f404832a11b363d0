"""runtime.signal_dispositions: a library's start-up (libtpu's, loaded to compile for a TPU
topology) does not leave SIGHUP ignored in the user's process and in every process it starts."""

import ctypes
import json
import signal
import subprocess
import sys

import pytest

from shardlab.plan.compiled import aot
from shardlab.runtime import signal_dispositions

SIG_IGN = ctypes.c_void_p(1)  # <signal.h>'s SIG_IGN, for a C library's own signal() call


def _ignore_in_c(number: int) -> None:
  """What a C library does: ignored at the kernel, unseen by Python's signal module."""
  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal(ctypes.c_int(number), SIG_IGN)


@pytest.mark.skipif(signal_dispositions.ignored() is None, reason="no /proc/self/status")
def test_only_the_named_signals_are_put_back():
  kept, other = signal.SIGUSR1, signal.SIGUSR2
  assert signal.getsignal(kept) == signal.getsignal(other) == signal.SIG_DFL
  try:
    with signal_dispositions.kept(frozenset({kept})):
      _ignore_in_c(kept)
      _ignore_in_c(other)
      assert {kept, other} <= signal_dispositions.ignored()
    ignored = signal_dispositions.ignored()
    assert kept not in ignored and other in ignored
  finally:
    signal.signal(kept, signal.SIG_DFL)
    signal.signal(other, signal.SIG_DFL)


LOAD = """
import contextlib, json, signal, sys
from shardlab.plan.compiled import aot
from shardlab.runtime import signal_dispositions as sd
assert signal.SIGHUP not in sd.ignored()
if sys.argv[1] == "raw":  # libtpu's own effect: the same load with nothing put back
  sd.kept = lambda signals: contextlib.nullcontext()
aot.tpu_devices("v5e", 4)
print(json.dumps(sorted(sd.ignored())))
"""


def _ignored_after_loading(how: str) -> list[int]:
  out = subprocess.run([sys.executable, "-c", LOAD, how], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
@pytest.mark.skipif(signal_dispositions.ignored() is None, reason="no /proc/self/status")
def test_loading_libtpu_for_a_tpu_compile_leaves_sighup_at_its_default():
  # libtpu on its own ignores SIGHUP (and SIGPROF, which its profiling timer needs ignored).
  assert {signal.SIGHUP, signal.SIGPROF} <= set(_ignored_after_loading("raw"))
  ignored = _ignored_after_loading("shardlab")
  assert signal.SIGHUP not in ignored and signal.SIGPROF in ignored
