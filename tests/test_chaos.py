"""The chaos harness (bench/chaos.py), short: a run SIGKILLed in the middle of a save, its
resume SIGKILLed while restoring, resumed again, ends as the straight run does, bit for bit,
from the newest committed checkpoint (nothing lost)."""

import dataclasses
import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from chaos_run import chaos_run, straight  # noqa: E402
from chaos_scenarios import SCENARIOS  # noqa: E402

pytestmark = pytest.mark.slow


def test_killed_mid_save_and_mid_restore_resumes_bit_identical(tmp_path):
  scenario = dataclasses.replace(SCENARIOS["dp"], mesh="data:2", devices=2, steps=4)
  seconds = straight(scenario, tmp_path / "straight")
  r = chaos_run(scenario, ["mid-save", "mid-restore"], tmp_path / "run",
                tmp_path / "straight", seconds, random.Random(0))
  logs = {p.name: p.read_text() for p in (tmp_path / "run").glob("*.txt")}
  assert (r.kills, r.killed, r.resumed, r.identical, r.lost) == (2, 2, True, True, False), \
      (r.notes, logs)
  assert re.match(r"mid-save \(in a save after \d committed, step \d logged, \[\d\] saved\)",
                  r.notes[0]), r.notes
  # The second kill found the resumed command before its first step; the last resume
  # started from a checkpoint.
  assert not re.search(r"^step ", logs["killed-1.txt"], re.M), logs["killed-1.txt"]
  begun = int(re.search(r"resumed from step (\d+)", r.notes[-1]).group(1))
  assert begun >= 1 and f"resuming from the checkpoint at step {begun}" in logs["resumed.txt"]
