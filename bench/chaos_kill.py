"""Processes of the chaos harness and the moments they are killed at (bench/chaos.py).

Each command runs in a session of its own, its output in a log file; a kill is SIGKILL to
that whole session (a launcher and its ranks, a prepare and its worker), as when a machine
dies, and the next command starts only once all of it is gone.
"""

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

from chaos_scenarios import ROOT, Scenario, env
from shardlab.training.checkpoint_disk import saved_steps as committed  # Orbax's committed steps

POLL_S = 0.01
# No restart of each command for huge pages (runtime/host_memory.py): it imports everything
# twice, 2 s of CPU a command here, and changes nothing a resume depends on.
ENV = {"PYTHONUNBUFFERED": "1", "SHARDLAB_HUGE_PAGES": "0"}
TMP = "orbax-checkpoint-tmp"


class Proc:
  """One command of a run, started now, its output appended to `log`."""

  def __init__(self, argv: list[str], log: Path):
    self.log = log
    with open(log, "ab") as out:
      self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**env(), **ENV}, start_new_session=True)
    self.started = time.monotonic()

  def text(self) -> str:
    return self.log.read_text(errors="replace")

  def alive(self) -> bool:
    return self.proc.poll() is None

  def kill(self) -> bool:
    """SIGKILL to the session; True if the command was still running. Returns once no
    process of the session is left (at most 10 s)."""
    running = self.alive()
    self._signal_group()
    self.proc.wait()
    deadline = time.monotonic() + 10
    while self._signal_group(0) and time.monotonic() < deadline:
      self._signal_group()
      time.sleep(POLL_S)
    return running

  def _signal_group(self, signum: int = signal.SIGKILL) -> bool:
    try:
      os.killpg(self.proc.pid, signum)
      return True
    except ProcessLookupError:
      return False

  def finish(self, timeout_s: float) -> int:
    """The exit code; killed (and -9) after `timeout_s`."""
    try:
      return self.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      self.kill()
      return -9


def wait_until(proc: Proc, ready, timeout_s: float = 300) -> bool:
  """Polls `ready()` until it holds (True) or the command ends or the deadline passes."""
  deadline = time.monotonic() + timeout_s
  while proc.alive() and time.monotonic() < deadline:
    if ready():
      return True
    time.sleep(POLL_S)
  return False


def logged(proc: Proc, pattern: str):
  """A test that `pattern` begins a line of the log (of rank 0's, under the launcher)."""
  regex = re.compile(rf"^(\[0\] )?{pattern}", re.M)
  return lambda: bool(regex.search(proc.text()))


def saving(ckpt: Path, after: int):
  """A test for: a save in flight (its temporary directory there) with more than `after`
  steps committed before it."""
  def ready():
    names = [p.name for p in ckpt.iterdir()] if ckpt.is_dir() else []
    return any(TMP in n for n in names) and len(committed(ckpt)) > after
  return ready


def wait_for_moment(proc: Proc, moment: str, scenario: Scenario, work: Path,
                    rng: random.Random, run_s: float, steps: int) -> str:
  """Waits for `moment` in `proc`'s life; returns what it waited for, in words."""
  if moment == "random":
    delay = rng.uniform(0, run_s)
    wait_until(proc, lambda: time.monotonic() - proc.started > delay)
    return f"after {delay:.1f} s"
  if moment == "mid-step":
    step = rng.randint(2, steps - 1)  # a checkpoint is committed by then, usually
    wait_until(proc, logged(proc, f"step {step}/"))
    delay = rng.uniform(0, 0.3)
    time.sleep(delay)
    return f"{delay:.2f} s after step {step}"
  if moment == "mid-save":
    after = rng.randint(0, 2)
    found = wait_until(proc, saving(work / "ckpt", after))
    return f"in a save after {after} committed" if found else "no save seen"
  if moment == "mid-restore":  # the restore follows the run's description (data line)
    wait_until(proc, logged(proc, "data "))
    delay = rng.uniform(0, 0.15)  # a restore of these runs takes 0.2-0.5 s
    time.sleep(delay)
    return f"{delay:.2f} s into the restore"
  if moment == "mid-prepare":  # once the first shard is written
    wait_until(proc, lambda: (work / "out" / "train-00000.npy").exists())
    delay = rng.uniform(0, 0.5)
    time.sleep(delay)
    return f"{delay:.2f} s after the first shard"
  raise ValueError(f"moment {moment!r} is none of {scenario.moments}")


def last_step_logged(text: str) -> int:
  steps = re.findall(r"^(?:\[0\] )?step (\d+)/", text, re.M)
  return int(steps[-1]) if steps else 0


def resumed_from(text: str) -> int:
  found = re.findall(r"^(?:\[0\] )?resuming from the checkpoint at step (\d+)", text, re.M)
  return int(found[-1]) if found else 0
