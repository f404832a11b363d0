"""The planner's step time against published measured runs (shardlab/plan/training/
published.py): the held-out half, on which nothing was tuned, within ±15% of the measured
tokens/s per device. Figures from papers and docs, not our runs: not timing-dependent."""

import pytest

from shardlab.plan.training import published, step_time

FITTED, HELD = published.split()
# A known miss, kept with its cause: torchtitan's H100s ran at a 500 W power limit (700 W
# TDP) with HBM2e at 2.4 TB/s (its docs), which the h100-80g target does not describe; the
# prediction is 1.19× the measured figure, 1.17× with the target's bandwidth set to 2.4 TB/s
# (docs/planning.md): the power cap's clocks are the rest, with no published figure to model.
MISSES = {"torchtitan-llama3-8b-h100-80g-b2-save-matmul-outputs"}


def test_the_split_holds_at_least_ten_runs_half_held_out():
  assert len(published.RUNS) >= 10 and len(HELD) >= 5
  assert not {r.name for r in FITTED} & {r.name for r in HELD}
  assert len({r.source for r in HELD}) >= 2


@pytest.mark.parametrize("run", [
    pytest.param(r, marks=pytest.mark.xfail(strict=True, reason="500 W H100s"))
    if r.name in MISSES else r for r in HELD], ids=lambda r: r.name)
def test_held_out_run_within_15_percent(run):
  assert published.ratio(run) == pytest.approx(1.0, abs=0.15)


def test_one_constant_efficiency_misses_the_held_out_half(monkeypatch):
  """Without the matmul/attention/memory-bound split (every FLOP at the published
  efficiency, as the planner did before), the held-out half is not within 15%."""
  monkeypatch.setattr(step_time, "MATMUL_OVER_STEP", 1.0)
  monkeypatch.setattr(step_time, "ATTENTION_EFFICIENCY", {True: 1.0, False: 1.0})
  monkeypatch.setattr(step_time, "ELEMENTWISE", dict.fromkeys(step_time.ELEMENTWISE, 0))
  ratios = [published.ratio(r) for r in HELD if r.name not in MISSES]
  assert max(abs(x - 1) for x in ratios) > 0.15
