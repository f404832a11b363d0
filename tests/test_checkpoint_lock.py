"""One run per checkpoint directory: a second run is refused naming the first, a lock left
by a killed run is taken over with a warning, and readers need no lock."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shardlab.cli import train as train_cli
from shardlab.training import checkpoint, checkpoint_lock
from test_checkpoint import SMALL

ROOT = Path(__file__).resolve().parents[1]
RUN = [s for s in SMALL if not s.startswith("train.steps")] + ["checkpoint.every=2"]


def train(directory, steps: int) -> int:
  args = [a for s in RUN for a in ("--set", s)]
  return train_cli.train_main(args + ["--steps", str(steps), "--quiet", "--sample-tokens", "0",
                                      "--checkpoint-dir", str(directory)])


def hold(directory: Path) -> subprocess.Popen:
  """Another run's process 0 holding the lock (the lock a Checkpointer takes), asleep."""
  code = ("import sys, time; from shardlab.training import checkpoint_lock; "
          "checkpoint_lock.lock(sys.argv[1]); print('locked', flush=True); time.sleep(600)")
  proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, env={**os.environ,
                                                                  "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.readline() == "locked\n"
  return proc


def test_a_second_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  holder = hold(ckpt)
  try:
    assert train(ckpt, 2) == 2
    err = capsys.readouterr().err
    assert (f"error: --checkpoint-dir {str(ckpt)!r} is in use by another run (pid "
            f"{holder.pid} on host {socket.gethostname()}, started ") in err, err
    assert "command: " in err and "Wait for that run to finish or stop it" in err
    assert sorted(p.name for p in ckpt.iterdir()) == [".shardlab-lock"]  # nothing written

    # Readers take no lock: a finished step can be read while a run holds the directory.
    holder.send_signal(signal.SIGKILL)  # the holder dies without releasing: a stale file
    holder.wait()
    body = json.loads((ckpt / ".shardlab-lock").read_text())
    assert body["pid"] == holder.pid
    assert train(ckpt, 2) == 0
    err = capsys.readouterr().err
    assert (f"warning: taking over the lock of {ckpt} left by a run that ended without "
            f"releasing it (pid {holder.pid} on host {socket.gethostname()}") in err, err
    assert "that process is gone" in err
    assert sorted(p.name for p in ckpt.iterdir()) == ["2"]  # released: the lock file is gone
  finally:
    holder.kill()
    holder.wait()

  holder = hold(ckpt)
  try:
    assert checkpoint.saved_config(ckpt)["train"]["steps"] == 2
  finally:
    holder.kill()
    holder.wait()


def test_the_lock_excludes_other_processes_not_this_one(tmp_path):
  checkpoint_lock.lock(tmp_path)
  checkpoint_lock.lock(tmp_path)  # the same run again (prepare, then the Checkpointer)
  try:
    code = ("import sys; from shardlab.training import checkpoint_lock as l\n"
            "try:\n  l.lock(sys.argv[1])\nexcept l.CheckpointDirInUse as e:\n  print(e)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         timeout=120).stdout
    assert f"is in use by another run (pid {os.getpid()} on host" in out, out
  finally:
    checkpoint_lock.unlock(tmp_path)
  assert not (tmp_path / ".shardlab-lock").exists()
  started = time.monotonic()
  checkpoint_lock.lock(tmp_path)  # free again at once
  checkpoint_lock.unlock(tmp_path)
  assert time.monotonic() - started < 1
