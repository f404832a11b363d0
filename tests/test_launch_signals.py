"""`shardlab launch` leaves no process behind: a SIGTERM to it is passed on (every process
saves and exits), and a launcher killed outright takes its processes with it."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_multihost import PY, ROOT, env, train_cmd


def launch(*cmd: str) -> subprocess.Popen:
  full = [PY, "-m", "shardlab.cli", "launch", "-n", "2", "--devices-per-process", "4", "--",
          *cmd]
  return subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env(), cwd=ROOT, start_new_session=True)


def read_until(proc: subprocess.Popen, prefix: str, timeout: float = 300) -> list[str]:
  seen, deadline = [], time.monotonic() + timeout
  for line in proc.stdout:
    seen.append(line)
    if line.startswith(prefix):
      return seen
    if time.monotonic() > deadline:
      break
  pytest.fail(f"no line starting {prefix!r} within {timeout} s:\n{''.join(seen)}")


def ranks_of(launcher: int) -> list[int]:
  return [int(c) for c in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]


def running(pid: int) -> bool:
  """Alive and not a zombie (an orphan's zombie waits for a reaper that may never come)."""
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError):
    return False


def kill_all(pids: list[int]) -> None:
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


@pytest.mark.slow
def test_sigterm_to_the_launcher_reaches_every_process_which_saves_and_exits(tmp_path):
  ckpt = tmp_path / "ckpt"
  proc = launch(*train_cmd(10_000, "--checkpoint-dir", str(ckpt)))
  ranks = []
  try:
    seen = read_until(proc, "[0] step")
    ranks = ranks_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=180)
  finally:
    proc.kill()
    kill_all(ranks)
  out = "".join(seen) + rest
  assert proc.returncode == 0, out
  assert ("[launch] received SIGTERM: passed it on to the 2 processes as SIGTERM; waiting for "
          "them to save and exit") in out
  step = re.search(r"^\[0\] received SIGTERM: stopped after step (\d+); checkpoint saved at "
                   r"step \1 in ", out, re.M)
  assert step, out
  assert (ckpt / step.group(1)).is_dir()
  assert len(ranks) == 2 and not any(running(r) for r in ranks)


def test_a_killed_launcher_takes_its_processes_with_it(tmp_path):
  proc = launch(*train_cmd(10_000, "--checkpoint-dir", str(tmp_path / "ckpt")))
  ranks = []
  try:
    deadline = time.monotonic() + 60
    while len(ranks) < 2 and time.monotonic() < deadline:
      ranks = ranks_of(proc.pid)
      time.sleep(0.1)
    assert len(ranks) == 2
    time.sleep(1)  # both are importing or starting jax.distributed by now
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(running(r) for r in ranks) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not [r for r in ranks if running(r)], "a process outlived its launcher"
  finally:
    proc.kill()
    kill_all(ranks)
