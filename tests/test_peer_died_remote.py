"""A finished process whose peer on another host is killed exits within 5 s naming it, by
the peer's connection to process 0 closing (runtime/liveness.py), not after the 15 s
heartbeat. "Another host": each process is given its own host name, so the watchdog
cannot look the peer's process id up on its own host."""

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from test_quiet_output import kill_and_wait

ROOT = Path(__file__).resolve().parents[1]
_PROCESS = textwrap.dedent("""
  import socket, sys, time
  port, rank, finishing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  socket.gethostname = lambda: f"host-{rank}"  # the same-host path finds no peer here
  from shardlab.runtime import distributed
  distributed.initialize(f"127.0.0.1:{port}", 3, rank)
  print("finished" if rank == finishing else "working", flush=True)
  if rank != finishing:
    time.sleep(600)  # killed (or left) while the finishing one waits at its exit
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_a_finished_process_whose_remote_peer_dies_exits_within_5_s(tmp_path):
  """Process 2 is killed while process 1 has finished and waits for the others: process 0
  (still working) sees the connection close and says so in the coordination store."""
  port, finishing = _free_port(), 1
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  logs = [tmp_path / f"{rank}.log" for rank in range(3)]
  procs = []
  try:
    for rank in range(3):
      with open(logs[rank], "w") as out:
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _PROCESS, str(port), str(rank), str(finishing)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    deadline = time.monotonic() + 120
    while not all(("finished" if r == finishing else "working") in logs[r].read_text()
                  for r in range(3)):
      assert time.monotonic() < deadline and procs[finishing].poll() is None, \
          logs[finishing].read_text()
      time.sleep(0.1)
    time.sleep(2)  # every process has connected to process 0's listener by now
    code, waited = kill_and_wait(procs[2], procs[finishing])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  text = logs[finishing].read_text()
  print(f"process {finishing} exited {code} {waited:.1f} s after process 2 was killed")
  assert code == 4 and waited < 5, text
  assert (f"error: process 2 of 3 died (its connection to process 0 closed without it "
          f"finishing: it crashed or was killed); process {finishing} had finished its part "
          f"(exit 4)") in text, text
