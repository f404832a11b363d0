"""The planner's step time against published measured runs (shardlab/plan/training/
published.py): the held-out half, on which nothing was tuned, within ±15% of the measured
tokens/s per device. Figures from papers and docs, not our runs: not timing-dependent."""

import dataclasses
from unittest import mock

import pytest

from shardlab.plan.training import published, step_time
from shardlab.runtime import hardware

FITTED, HELD = published.split()


def test_the_split_holds_at_least_ten_runs_half_held_out():
  assert len(published.RUNS) >= 10 and len(HELD) >= 5
  assert not {r.name for r in FITTED} & {r.name for r in HELD}
  assert len({r.source for r in HELD}) >= 2


@pytest.mark.parametrize("run", HELD, ids=lambda r: r.name)
def test_held_out_run_within_15_percent(run):
  assert published.ratio(run) == pytest.approx(1.0, abs=0.15)


def test_one_constant_efficiency_misses_the_held_out_half(monkeypatch):
  """Without the matmul/attention/memory-bound split (every FLOP at the published
  efficiency, as the planner did before), the held-out half is not within 15%."""
  monkeypatch.setattr(step_time, "MATMUL_OVER_STEP", 1.0)
  monkeypatch.setattr(step_time, "ATTENTION_EFFICIENCY", {True: 1.0, False: 1.0})
  monkeypatch.setattr(step_time, "ELEMENTWISE", dict.fromkeys(step_time.ELEMENTWISE, 0))
  ratios = [published.ratio(r) for r in HELD]
  assert max(abs(x - 1) for x in ratios) > 0.15


def test_torchtitans_h100_run_is_planned_on_the_gpus_it_ran_on():
  """torchtitan's H100s (500 W, HBM2e) have a peak published only as lying between the H100
  NVL's 835 and the SXM's 989 TFLOP/s; the target takes the midpoint. From the NVL bound up
  to the midpoint the prediction is within 15% of the measured figure (1.00 and 1.09; 1.17
  at the SXM bound); planned as a 700 W DGX H100 (`h100-80g`) the run is a miss."""
  run, = [r for r in published.RUNS if r.target == "h100-96g-500w"]
  acc = hardware.get(run.target)
  with mock.patch.dict(hardware.ACCELERATORS,
                       {run.target: dataclasses.replace(acc, peak_flops=835e12)}):
    at_nvl = published.ratio(run)
  assert abs(at_nvl - 1) <= 0.15 and abs(published.ratio(run) - 1) <= 0.15, at_nvl
  assert published.ratio(dataclasses.replace(run, target="h100-80g")) > 1.15
