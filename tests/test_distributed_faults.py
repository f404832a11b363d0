"""Multi-process faults as real processes on 127.0.0.1, started one by one with
--coordinator (no launcher to stop the rest): nothing waits without a deadline, every exit
is non-zero with a message naming the process or the coordinator, and a SIGTERM to one
process stops all of them at the same step. Each test enforces its own deadline."""

import os
import re
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from shardlab.testing import fast_compile

from test_multihost import PY, ROOT, env, launched, train_cmd


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Rank:
  """One process of a 2-process run of train.py, its output in a file."""

  def __init__(self, rank: int, port: int, log: Path, *extra: str):
    self.rank, self.log = rank, log
    cmd = train_cmd(10_000, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                    "--process-id", str(rank), *extra)
    child_env = {**env(), "PYTHONUNBUFFERED": "1",
                 "XLA_FLAGS": "--xla_force_host_platform_device_count=4 " +
                 fast_compile.only(os.environ)}
    with open(log, "w") as out:
      self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env,
                                   cwd=ROOT, start_new_session=True)

  def text(self) -> str:
    return self.log.read_text()

  def wait_for(self, pattern: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and self.proc.poll() is None:
      if re.search(pattern, self.text(), re.M):
        return
      time.sleep(0.2)
    pytest.fail(f"rank {self.rank}: no {pattern!r} within {timeout} s:\n{self.text()}")

  def exit_code(self, timeout: float) -> int:
    try:
      return self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      pytest.fail(f"rank {self.rank} did not exit within {timeout} s:\n{self.text()}")

  def kill(self) -> None:
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()


@pytest.fixture
def ranks():
  started = []
  yield started
  for r in started:  # never leave a process behind, whatever failed
    r.kill()


def test_a_coordinator_nobody_answers_at_times_out_naming_it(tmp_path, ranks):
  alone_1, alone_0 = free_port(), free_port()
  ranks += [Rank(1, alone_1, tmp_path / "1.log", "--init-timeout", "3"),
            Rank(0, alone_0, tmp_path / "0.log", "--init-timeout", "3")]
  codes = [r.exit_code(timeout=90) for r in ranks]
  assert codes == [4, 4], [r.text() for r in ranks]
  assert (f"error: jax.distributed did not start: process 1 could not reach the coordinator "
          f"at 127.0.0.1:{alone_1} within 3 s (nothing answers there)") in ranks[0].text()
  assert (f"error: jax.distributed did not start: process 0 hosts the coordinator at "
          f"127.0.0.1:{alone_0}, but not all 2 processes joined within 3 s") in ranks[1].text()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["peer-killed", "coordinator-killed"])
def test_a_killed_process_stops_the_other_within_60_s_naming_it(tmp_path, ranks, victim):
  port = free_port()
  ranks += [Rank(r, port, tmp_path / f"{r}.log") for r in (0, 1)]
  ranks[0].wait_for(r"^step ")
  ranks[victim].kill()
  killed_at = time.monotonic()
  survivor = ranks[1 - victim]
  code = survivor.exit_code(timeout=60)
  seconds = time.monotonic() - killed_at
  print(f"rank {survivor.rank} exited {code} {seconds:.1f} s after rank {victim} was killed")
  assert code != 0 and seconds < 60
  if victim == 1:
    assert code == 4, survivor.text()
    assert re.search(r"^error: process 1 of 2 sent no heartbeat for \d+ s \(--heartbeat-timeout "
                     r"15\): it died, was killed, or hangs; stopping process 0 too \(exit 4\)",
                     survivor.text(), re.M), survivor.text()
  else:  # ours, or JAX's own abort when its connection to the coordinator drops first
    assert (f"lost the coordinator (process 0 at 127.0.0.1:{port})" in survivor.text() or
            "Either the leader task was preempted/died" in survivor.text()), survivor.text()


def test_an_error_on_one_process_stops_the_other_naming_it(tmp_path, ranks):
  port = free_port()
  ranks += [Rank(0, port, tmp_path / "0.log"),
            Rank(1, port, tmp_path / "1.log", "--checkpoint-dir", "/proc/nowhere/ckpt")]
  assert ranks[1].exit_code(timeout=300) == 2, ranks[1].text()
  assert ranks[0].exit_code(timeout=60) == 4, ranks[0].text()
  assert ("error: process 1 of 2 failed (error: --checkpoint-dir '/proc/nowhere/ckpt' cannot "
          "be created") in ranks[0].text()


# Process 1 is told of process 0's failure while its step compiles: fd 2 then points at the
# file that reads XLA's log (xla_log.captured), and the watchdog's message must still reach
# the console before os._exit (the run above lost it when process 0 was compiling).
_TOLD_WHILE_COMPILING = textwrap.dedent("""
  import time
  from shardlab.observe import xla_log
  from shardlab.runtime import watchdog

  class Store:  # the coordination service's key-value store, process 0's failure in it
    kv = {watchdog.PREFIX + "failed/0": "error: disk full"}
    def key_value_set(self, key, value, allow_overwrite=False):
      self.kv[key] = value
    def key_value_dir_get(self, prefix):
      return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

  dog = watchdog.Watchdog(Store(), 1, 2, "127.0.0.1:1", timeout_s=30)
  with xla_log.captured([], echo=False):
    dog.start()
    time.sleep(60)
""")


def test_a_peer_failure_during_a_compile_is_still_said():
  done = subprocess.run([PY, "-c", _TOLD_WHILE_COMPILING], capture_output=True, text=True,
                        env=env(), cwd=ROOT, timeout=60)
  assert done.returncode == 4, done.stderr
  assert "error: process 0 of 2 failed (error: disk full); stopping process 1 too" in \
      done.stderr, done.stderr


def _children(pid: int) -> list[int]:
  return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
  ckpt = tmp_path / "ckpt"
  full = [PY, "-m", "shardlab.cli", "launch", "-n", "2", "--devices-per-process", "4", "--",
          *train_cmd(10_000, "--checkpoint-dir", str(ckpt))]
  proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env(), cwd=ROOT)
  try:
    seen, deadline = [], time.monotonic() + 300
    for line in proc.stdout:
      seen.append(line)
      if line.startswith("[0] step") or time.monotonic() > deadline:
        break
    os.kill(_children(proc.pid)[1], signal.SIGTERM)  # rank 1 only
    rest, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  out = "".join(seen) + rest
  assert proc.returncode == 0, out
  stops = dict(re.findall(r"^\[(\d)\] process \1: a preemption notice \(SIGTERM\) reached the "
                          r"run; every process stops and saves at step (\d+)$", out, re.M))
  assert sorted(stops) == ["0", "1"] and stops["0"] == stops["1"], out
  step = int(stops["0"])
  assert (f"[0] received SIGTERM: stopped after step {step}; checkpoint saved at step {step} "
          f"in {ckpt}") in out
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [step]

  out = launched(train_cmd(step + 1, "--checkpoint-dir", str(ckpt)))
  assert f"[0] resuming from the checkpoint at step {step} in {ckpt}" in out
  assert f"[0] step {step + 1}/{step + 1}" in out
