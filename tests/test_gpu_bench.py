"""bench/gpu.sh's checks, the parts that run without a GPU (CI has none): the attention
comparison on CPU (the fused path is the blockwise one there), its band, and the script's
shell syntax. On a GPU the same code compares cuDNN (docs/performance.md, "On a GPU")."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_checks  # noqa: E402


@pytest.mark.parametrize("case", gpu_checks.QUICK_CASES, ids=["gqa", "mqa-window"])
def test_the_fused_path_is_as_close_to_fp32_as_the_plain_one(case):
  row = gpu_checks.attention_case(case, "cpu")
  assert not row["cudnn_in_program"]  # the CPU has no cuDNN: blockwise ran
  for name in ("out", "dq", "dk", "dv"):
    plain, fused = row[f"{name}_plain_bf16"], row[f"{name}_fused_bf16"]
    # bf16 is a few 1e-3 from fp32 here; an error 10× that would mean a wrong path.
    assert 0 < plain < 2e-2 and 0 < fused < 2e-2, (name, plain, fused)
    assert fused <= max(2 * plain, 1e-2), (name, plain, fused)


def test_the_comparison_catches_a_wrong_kernel(monkeypatch):
  # Dropping the window from the fused path (attending to every earlier key) must fail.
  from shardlab.parallel import flash
  real = flash.causal
  monkeypatch.setattr(flash, "causal", lambda q, k, v, platform=None, window=None:
                      real(q, k, v, platform=platform))
  row = gpu_checks.attention_case(gpu_checks.QUICK_CASES[1], "cpu")
  assert row["out_fused_bf16"] > max(2 * row["out_plain_bf16"], 1e-2)


def test_the_script_parses():
  subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], check=True)


def test_the_planner_check_sets_the_planners_figures_beside_the_run(monkeypatch):
  # On a GPU, `gpu_checks.py planner` prints these rows for the machine's own target; here
  # the run is on one CPU device and the target is named, so only the plumbing is checked:
  # the planned figures are the planner's for the very run that was timed.
  import jax

  from shardlab.plan.training import planner as plan

  monkeypatch.setenv("SHARDLAB_BENCH_DEVICES", "native")  # restored after the test
  row = gpu_checks.planner_row("tiny", 4, 128, "none", "h200", steps=1, warmup=0,
                               devices=jax.devices())
  est = plan.plan(plan.Request.of(model="tiny", precision="bf16", global_batch=4, seq_len=128,
                                  remat="none", strategy="dp", devices=1,
                                  target="h200")).estimate
  assert row["planned_tokens_per_s"] == est.tokens_per_s
  assert row["planned_mib"] == est.memory.total / 2**20
  assert row["measured_tokens_per_s"] > 0 and row["measured_mib"] > 0
