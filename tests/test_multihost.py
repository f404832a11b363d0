"""Multi-controller runs as real processes on 127.0.0.1 (gloo CPU collectives)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardlab.testing import fast_compile

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "model.mlp_dim=128", "train.seq_len=32", "train.global_batch=16",
         "train.log_every=1", "train.eval_batches=1", "train.precision='fp32'",
         "data.max_bytes=400000"]
MESH = "dcn.data:2,fsdp:4"  # data across the two processes, fsdp inside each

pytestmark = pytest.mark.slow


def train_cmd(steps: int, *extra: str) -> list[str]:
  sets = [a for s in SMALL + [f"train.steps={steps}"] for a in ("--set", s)]
  return [PY, str(ROOT / "train.py"), "--mesh", MESH, "--strategy", "fsdp", *sets, *extra]


def env() -> dict:
  clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLAB_")}
  return {**clean, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast_compile.only(os.environ)}


def launched(cmd: list[str], timeout: float = 400) -> str:
  full = [PY, "-m", "shardlab.cli", "launch", "-n", "2", "--devices-per-process", "4", "--", *cmd]
  out = subprocess.run(full, capture_output=True, text=True, env=env(), cwd=ROOT,
                       timeout=timeout)
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


def single(cmd: list[str], timeout: float = 400) -> str:
  out = subprocess.run(cmd + ["--simulate-devices", "8"], capture_output=True, text=True,
                       env=env(), cwd=ROOT, timeout=timeout)
  assert out.returncode == 0, out.stdout + out.stderr
  # XLA's involuntary-rematerialisation screenfuls never reach the console (the run says
  # them in one line: observe/xla_log.py).
  assert "Involuntary" not in out.stdout + out.stderr
  return out.stdout


def losses(path: Path) -> list[float]:
  records = [json.loads(line) for line in path.read_text().splitlines()]
  return [r["loss"] for r in records if "loss" in r]  # the step records, not eval_loss's


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  """One 4-step run on two processes and one on a single process, each with its metrics and
  its checkpoint: the two tests below check both (one run each, not one per test)."""
  d = tmp_path_factory.mktemp("four_steps")
  out = launched(train_cmd(4, "--metrics-file", str(d / "two.jsonl"),
                           "--checkpoint-dir", str(d / "from_two")))
  one = single(train_cmd(4, "--metrics-file", str(d / "one.jsonl"),
                         "--checkpoint-dir", str(d / "from_one")))
  # This layout's 2-layer stack split 8 ways makes the partitioner gather one tensor whole.
  assert ("warning: under tiny fsdp on dcn.data:2,fsdp:4 XLA's SPMD partitioner reshards 1 "
          "tensor(s)") in one
  return d, out


def test_two_processes_match_one_process(four_steps):
  d, out = four_steps
  assert "[0] step 4/4" in out and "[1] step" not in out  # process 0 reports alone
  two, one = losses(d / "two.jsonl"), losses(d / "one.jsonl")
  assert len(two) == len(one) == 4
  np.testing.assert_allclose(two, one, rtol=1e-5)


def test_checkpoints_cross_process_counts(four_steps):
  d, _ = four_steps
  out = single(train_cmd(5, "--checkpoint-dir", str(d / "from_two")))
  assert "resuming from the checkpoint at step 4" in out and "step 5/5" in out

  out = launched(train_cmd(5, "--checkpoint-dir", str(d / "from_one")))
  assert "[0] resuming from the checkpoint at step 4" in out and "[0] step 5/5" in out


def _children(pid: int) -> list[int]:
  text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
  return [int(c) for c in text.split()]


def test_a_killed_process_stops_the_run(tmp_path):
  full = [PY, "-m", "shardlab.cli", "launch", "-n", "2", "--devices-per-process", "4", "--",
          *train_cmd(10_000)]
  proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env(), cwd=ROOT)
  deadline = time.monotonic() + 300
  for line in proc.stdout:
    if line.startswith("[0] step") or time.monotonic() > deadline:
      break
  victim = _children(proc.pid)[1]
  os.kill(victim, signal.SIGKILL)
  killed_at = time.monotonic()
  try:
    rest, _ = proc.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail("the launcher did not exit within 60 s of a process being killed")
  assert time.monotonic() - killed_at < 60
  assert proc.returncode != 0
  assert "[launch] process 1 exited with code -9; stopping the other processes" in rest
