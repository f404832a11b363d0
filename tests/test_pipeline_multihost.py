"""A pipeline whose stages sit in different processes (the stage axis on DCN): 2 processes ×
4 devices train as 1 process × 8 devices does, with and without the pipeline."""

import pytest

import numpy as np

import test_multihost as MH

pytestmark = pytest.mark.slow


def cmd(tmp_path, name: str, mesh: str, microbatches: int = 4) -> list[str]:
  """3 steps of test_multihost's small model (2 layers: one per stage, 16 rows)."""
  full = MH.train_cmd(3, "--metrics-file", str(tmp_path / f"{name}.jsonl"))
  full[full.index("--mesh") + 1] = mesh
  return full + ["--set", f"train.microbatches={microbatches}"]


def test_stages_across_processes_match_one_process(tmp_path):
  out = MH.launched(cmd(tmp_path, "two", "dcn.stage:2,fsdp:4"))
  assert "pipeline gpipe: 2 stages" in out
  MH.single(cmd(tmp_path, "one", "dcn.stage:2,fsdp:4"))
  MH.single(cmd(tmp_path, "flat", "fsdp:8", microbatches=2))  # no pipeline
  two, one, flat = (MH.losses(tmp_path / f"{n}.jsonl") for n in ("two", "one", "flat"))
  assert len(two) == len(one) == len(flat) == 3
  np.testing.assert_allclose(two, one, rtol=1e-5)
  np.testing.assert_allclose(two, flat, rtol=1e-5)
