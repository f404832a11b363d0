"""Restart on another size: a run saved by 2 processes × 4 devices resumes on 1 × 8, on
4 × 2 and on 1 × 4 (another mesh), with the global batch unchanged, and its losses after the
restart are a straight run's. The loader position is global rows consumed (data/feed.py),
so each process count reads its own block of the same next global batches; the packed
corpus here has 36 rows per epoch, so the resumed steps also cross an epoch boundary.

Not bitwise: the state at the restart was reduced across 2 processes (gloo) and the resumed
steps reduce over another device layout, so fp32 sums round in another order (~1e-7
relative); a wrong row would move the loss by ~1e-2. Every run stops with --stop-after
under train.steps=100 (the same learning-rate schedule everywhere), so none compiles the
held-out evaluation."""

import json
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from shardlab.cli import train as train_cli
from shardlab.observe import goodput
from test_multihost import PY, ROOT, env

pytestmark = pytest.mark.slow

STOP, STEPS, BATCH = 3, 6, 8  # the 2 × 4 run saves at step 3; everyone compares steps 4..6
ROWS_PER_EPOCH = 36  # of the corpus below: steps 4..6 read rows 24..47, epoch 1 from row 36
SMALL = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
         "model.head_dim=16", "model.mlp_dim=64", "train.seq_len=16",
         f"train.global_batch={BATCH}", "train.log_every=1", "train.precision='fp32'",
         "train.steps=100", "data.held_out_fraction=0.1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
  """40 short documents as JSONL: packed byte rows (the loader whose position is rows)."""
  text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
  path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": text[i * 16:(i + 1) * 16]}) + "\n"
                          for i in range(40)))
  return path


def args(corpus: Path, mesh: str, metrics: Path, *extra: str) -> list[str]:
  sets = [a for s in SMALL + [f"data.corpus={corpus}"] for a in ("--set", s)]
  return ["--mesh", mesh, "--strategy", "fsdp", *sets, "--metrics-file", str(metrics),
          "--sample-tokens", "0", "--quiet", *extra]


def run(processes: int, devices: int, argv: list[str]) -> None:
  """train.py in `processes` processes × `devices` simulated devices (`shardlab launch`)."""
  train = [PY, str(ROOT / "train.py"), *argv]
  cmd = ([PY, "-m", "shardlab.cli", "launch", "-n", str(processes), "--devices-per-process",
          str(devices), "--", *train] if processes > 1
         else train + ["--simulate-devices", str(devices)])
  out = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=400)
  assert out.returncode == 0, out.stdout + out.stderr


def losses(metrics: Path) -> dict[int, float]:
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> dict[int, float]:
  """The reference: 1 process × 8 devices (this one), steps 1..6 without a restart."""
  metrics = tmp_path_factory.mktemp("straight") / "metrics.jsonl"
  argv = args(corpus, "dcn.data:2,fsdp:4", metrics, "--stop-after", str(STEPS))
  assert train_cli.train_main(argv) == 0
  return losses(metrics)


@pytest.fixture(scope="module")
def saved(corpus, straight, tmp_path_factory) -> Path:
  """A checkpoint at step 3 of a 2 processes × 4 devices run."""
  root = tmp_path_factory.mktemp("two")
  run(2, 4, args(corpus, "dcn.data:2,fsdp:4", root / "metrics.jsonl",
                 "--checkpoint-dir", str(root / "ckpt"), "--stop-after", str(STOP),
                 "--run-dir", str(root / "run")))
  # Process 0 alone keeps the goodput history: one record of this invocation.
  records = goodput.read(root / "run")
  assert [(r["status"], r["first_step"], r["last_step"]) for r in records] == \
      [("stopped", 0, STOP)]
  two = losses(root / "metrics.jsonl")
  assert list(two) == [1, 2, 3]
  np.testing.assert_allclose([two[s] for s in two], [straight[s] for s in two], rtol=1e-5)
  progress = json.loads((root / "ckpt" / str(STOP) / "progress" / "metadata").read_text())
  assert progress["data"] == {"kind": "packed", "rows_consumed": STOP * BATCH,
                              "rows_per_epoch": ROWS_PER_EPOCH, "epoch": 0}
  return root / "ckpt"


@pytest.mark.parametrize("processes, devices, mesh", [
    (1, 8, "dcn.data:2,fsdp:4"),  # one process holds both data shards
    (4, 2, "dcn.data:4,fsdp:2"),  # four processes: each reads 2 rows of every batch
    (1, 4, "fsdp:4"),             # half the devices, another mesh: the same global batch
], ids=["1x8", "4x2", "1x4-fsdp4"])
def test_a_2x4_checkpoint_resumes_on_another_size_with_the_same_losses(
    saved, straight, corpus, tmp_path, processes, devices, mesh):
  ckpt = tmp_path / "ckpt"
  shutil.copytree(saved, ckpt)
  metrics = tmp_path / "metrics.jsonl"
  argv = args(corpus, mesh, metrics, "--checkpoint-dir", str(ckpt), "--stop-after",
              str(STEPS - STOP))
  if processes == 1 and devices == 8:
    assert train_cli.train_main(argv) == 0  # this process's 8 devices: no start-up
  else:
    run(processes, devices, argv)
  resumed = losses(metrics)
  assert list(resumed) == list(range(STOP + 1, STEPS + 1))
  expected = [straight[s] for s in resumed]
  np.testing.assert_allclose(list(resumed.values()), expected, rtol=1e-4)
  progress = json.loads((ckpt / str(STEPS) / "progress" / "metadata").read_text())
  assert progress["data"] == {"kind": "packed", "rows_consumed": STEPS * BATCH,
                              "rows_per_epoch": ROWS_PER_EPOCH, "epoch": 1}
