"""`shardlab launch -n N [--devices-per-process D] -- COMMAND ...`: N local processes of one
multi-controller run on 127.0.0.1 with CPU collectives, for tests and demos.

Output lines are prefixed by rank. If any process exits non-zero the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher exits non-zero: never a hang.

No process outlives the launcher: a SIGTERM or SIGHUP to it is passed on to every process
(as SIGTERM: each saves a checkpoint at the same step and exits) and waited for; Ctrl-C
stops them the same way; and on Linux each process is killed by the kernel if the launcher
dies without a word (SIGKILL, a crash: PR_SET_PDEATHSIG).
"""

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from shardlab.bounds import Int
from shardlab.runtime import distributed

GRACE_S = 10.0
# After a forwarded SIGTERM the processes finish a step and save: minutes at most.
FORWARDED_GRACE_S = 300.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# Gloo reports every peer connection at start-up: one line per device pair, no news.
GLOO_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
  for line in iter(stream.readline, ""):
    if GLOO_NOISE.match(line):
      continue
    with lock:
      out.write(f"[{rank}] {line}")
      out.flush()


def launch(n: int, devices_per_process: int, command: list[str], port: int | None = None,
           out=None, deadline_s: float | None = None, env: dict | None = None) -> int:
  """Runs `command` as n processes; returns 0 if all succeed, else the first failure's code
  (124 when `deadline_s` passes first)."""
  out = out or sys.stdout
  port = port or _free_port()
  lock, procs = threading.Lock(), []
  die_with_us = _die_with_parent()
  for rank in range(n):
    child_env = {**os.environ, **(env or {}),
                 distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                 distributed.ENV_NUM_PROCESSES: str(n), distributed.ENV_PROCESS_ID: str(rank),
                 "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                 "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"}
    # Its own session: a terminal's Ctrl-C reaches the launcher only, which stops them all.
    procs.append(subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, preexec_fn=die_with_us))
  # The pumps start after every fork: a preexec_fn is unsafe while other threads run.
  pumps = [threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
           for rank, p in enumerate(procs)]
  for pump in pumps:
    pump.start()
  with _Forwarding(procs) as forwarding:
    failed = _watch(procs, forwarding, deadline_s, out, lock)
  if failed is not None:
    rank, code = failed
    who = {-1: "interrupted", -2: f"the deadline of {deadline_s or 0:g} s passed",
           -3: f"the processes did not exit within {FORWARDED_GRACE_S:g} s of the signal"
           }.get(rank, f"process {rank} exited with code {code}")
    with lock:
      out.write(f"[launch] {who}; stopping the other processes\n")
    _stop(procs)
  for pump in pumps:
    pump.join(timeout=5)
  if failed is None:
    return 0
  return failed[1] if failed[1] > 0 else 1


def _watch(procs, forwarding: "_Forwarding", deadline_s, out, lock):
  """Waits for the processes; returns None when all exit 0, else (rank, code) of the first
  failure (rank -1: interrupted, -2: the deadline passed, -3: a forwarded signal was not
  obeyed in time)."""
  start, told = time.monotonic(), None
  try:
    while True:
      codes = [p.poll() for p in procs]  # poll every process: each poll reaps its exit
      failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
      if failed is not None or all(c == 0 for c in codes):
        return failed
      if forwarding.received and forwarding.received != told:
        told = forwarding.received
        with lock:
          out.write(f"[launch] received {told}: passed it on to the {len(procs)} processes "
                    f"as SIGTERM; waiting for them to save and exit\n")
          out.flush()
      if forwarding.since and time.monotonic() - forwarding.since > FORWARDED_GRACE_S:
        return -3, 124
      if deadline_s is not None and time.monotonic() - start > deadline_s:
        return -2, 124
      time.sleep(0.1)
  except KeyboardInterrupt:
    return -1, 130


class _Forwarding:
  """While active, a SIGTERM or SIGHUP to the launcher is sent on to every process's group
  as SIGTERM (SIGHUP would kill them unsaved: their preemption handling answers SIGTERM).
  The handler only signals: the watching loop reports it, so no lock is taken here."""

  SIGNALS = (signal.SIGTERM, signal.SIGHUP)

  def __init__(self, procs):
    self.procs, self.received, self.since, self._previous = procs, None, None, {}

  def _handle(self, signum, frame):
    self.received = signal.Signals(signum).name
    self.since = self.since or time.monotonic()
    for p in self.procs:
      if p.returncode is None:
        try:
          os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach only it
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    return False


def _die_with_parent():
  """A preexec_fn for each process: the kernel sends it SIGKILL when the launcher dies,
  however it dies; or None off Linux. (SIGKILL, not SIGTERM: with the launcher gone their
  output pipe is closed, so a process could not even report a save.)"""
  if not sys.platform.startswith("linux"):
    return None
  libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()  # loaded before the fork

  def preexec() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before prctl took effect
      os._exit(1)
  return preexec


def _stop(procs) -> None:
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + GRACE_S
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def launch_main(argv=None, prog: str = "shardlab launch") -> int:
  p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                              usage=f"{prog} -n N [--devices-per-process D] -- COMMAND ...",
                              epilog=f"On a SLURM cluster: {prog} --slurm --help")
  p.add_argument("-n", "--num-processes", type=Int(min=1), required=True,
                 help="processes to start (required; %(type)s)")
  p.add_argument("--devices-per-process", type=Int(min=1), default=1,
                 help="simulated CPU devices in each process (default %(default)s; %(type)s)")
  p.add_argument("--port", type=Int(min=0, max=65535, note="0: a free one"),
                 help="coordinator port on 127.0.0.1 (%(type)s; default: a free one)")
  p.add_argument("command", nargs=argparse.REMAINDER,
                 help="after --: the command each process runs, e.g. python train.py ...")
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("give the command to run after --, e.g. -- python train.py --mesh dcn.data:2,fsdp:4")
  if args.port and distributed.port_in_use(args.port):
    print(f"error: --port {args.port} is already in use on this host (another run's "
          f"coordinator, or another program); leave out --port to use a free one, or stop "
          f"what uses it", file=sys.stderr, flush=True)
    return 2
  return launch(args.num_processes, args.devices_per_process, command, args.port)
