"""Preemption with real processes: SIGTERM checkpoints and exits 0; SIGKILL mid-save leaves
the previous complete checkpoint as the one restored."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.testing import fast_compile
from shardlab.training import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "model.mlp_dim=128", "train.seq_len=32", "train.global_batch=16",
         "train.log_every=1", "train.eval_batches=1", "data.max_bytes=400000"]


def start(directory: Path, steps: int, *extra: str) -> subprocess.Popen:
  sets = [a for s in SMALL + [f"train.steps={steps}"] for a in ("--set", s)]
  cmd = [sys.executable, str(ROOT / "train.py"), "--simulate-devices", "8",
         "--checkpoint-dir", str(directory), *sets, *extra]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast_compile.only(os.environ)}
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=ROOT)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 240) -> list[str]:
  seen, deadline = [], time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    seen.append(line)
    if line.startswith(prefix):
      return seen
  proc.kill()
  pytest.fail(f"no line starting {prefix!r} within {timeout} s:\n{''.join(seen)}")


def complete_steps(directory: Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_sigterm_saves_at_the_next_step_and_exits_0(tmp_path):
  proc = start(tmp_path / "ckpt", 10_000)
  wait_for_line(proc, "step ")
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  assert "received SIGTERM: stopped after step" in out
  saved = complete_steps(tmp_path / "ckpt")
  assert saved and f"checkpoint saved at step {saved[-1]}" in out


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
  directory = tmp_path / "ckpt"
  for attempt in range(5):  # the kill must land inside a save; retry if it landed between
    proc = start(directory, 10_000, "--set", "checkpoint.every=1", "--set", "checkpoint.keep=50")
    wait_for_line(proc, "step ")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      partial = [p for p in directory.iterdir() if "tmp" in p.name]
      if partial and complete_steps(directory):
        proc.send_signal(signal.SIGKILL)
        break
      time.sleep(0.002)
    proc.communicate(timeout=60)
    partial = [p for p in directory.iterdir() if "tmp" in p.name]
    if partial:
      break
  assert partial, "could not kill the process while a save was in flight"
  newest_complete = complete_steps(directory)[-1]

  resumed = start(directory, newest_complete + 1)
  out, _ = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, out
  assert f"resuming from the checkpoint at step {newest_complete} in" in out
  assert not [p for p in directory.iterdir() if "tmp" in p.name]  # the leftover is removed
  assert checkpoint.saved_config(directory)["train"]["steps"] == newest_complete + 1
