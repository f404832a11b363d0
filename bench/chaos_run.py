"""One chaos run: start a scenario, SIGKILL it at each moment given (each later moment on the
resumed command), resume it to the end, compare with the straight run (bench/chaos.py).

Lost: the resume finished but started before the newest checkpoint committed when it was
killed, or before the last step it logged less two (a step is logged before its save starts,
and a save waits for the one in flight: so up to two logged steps may be unsaved), or it
ends other than the straight run bit for bit, or it failed.
"""

import dataclasses
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

from chaos_compare import prepare_difference, train_difference
from chaos_kill import Proc, committed, last_step_logged, resumed_from, wait_for_moment
from chaos_scenarios import Scenario

TIMEOUT_S = 300  # for a command run to its end


@dataclasses.dataclass
class Result:
  scenario: str
  moments: list[str]
  kills: int = 0
  killed: int = 0  # kills that found the command still running
  resumed: bool = False  # the resume ran to the end (exit 0)
  identical: bool = False
  lost: bool = False
  notes: list[str] = dataclasses.field(default_factory=list)
  seconds: float = 0.0
  resume_s: float = 0.0  # the last resume, start to end: a warm run's length, about


def straight(scenario: Scenario, work: Path) -> float:
  """The scenario run without a kill, once (kept in `work`: a later call reads its time)."""
  done = work / "straight.json"
  if done.exists():
    return json.loads(done.read_text())["seconds"]
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  proc = Proc(scenario.argv(work), work / "log.txt")
  code = proc.finish(TIMEOUT_S)
  if code != 0:
    raise RuntimeError(f"the straight {scenario.name} run exited {code}:\n{proc.text()}")
  seconds = time.monotonic() - proc.started
  done.write_text(json.dumps({"seconds": seconds}))
  return seconds


def _ranks(pid: int) -> list[int]:
  try:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
  except OSError:
    return []


def _kill(proc: Proc, scenario: Scenario, rng: random.Random) -> tuple[bool, str]:
  """SIGKILL to everything, or under the launcher, half the time, to one rank only (the
  launcher then stops the other)."""
  ranks = _ranks(proc.proc.pid) if scenario.launched and rng.random() < 0.5 else []
  if not ranks or not proc.alive():
    return proc.kill(), "all"
  os.kill(ranks[-1], signal.SIGKILL)
  proc.finish(60)
  return proc.kill() or True, "rank 1"


def chaos_run(scenario: Scenario, moments: list[str], work: Path, straight_dir: Path,
              run_s: float, rng: random.Random) -> Result:
  """Kills `scenario` at each of `moments` in turn (a random one within `run_s`, about
  how long a run lasts), resumes it, compares it."""
  start, result = time.monotonic(), Result(scenario.name, list(moments))
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  floor = 0  # the earliest step a resume may start from and lose nothing
  for i, moment in enumerate(moments):
    proc = Proc(scenario.argv(work, resume=i > 0), work / f"killed-{i}.txt")
    when = wait_for_moment(proc, moment, scenario, work, rng, run_s, scenario.steps)
    landed, whom = _kill(proc, scenario, rng)
    result.kills += 1
    result.killed += landed
    if scenario.kind == "train":
      on_disk = committed(work / "ckpt")
      floor = max(floor, *on_disk[-1:], last_step_logged(proc.text()) - 2)
      when += f", step {last_step_logged(proc.text())} logged, {on_disk[-1:] or 'none'} saved"
    result.notes.append(f"{moment} ({when}){'' if landed else ': had ended'}" +
                        (f", killed {whom}" if whom != "all" else ""))
  final = Proc(scenario.argv(work, resume=True), work / "resumed.txt")
  code = final.finish(TIMEOUT_S)
  result.resume_s = time.monotonic() - final.started
  result.resumed = code == 0
  if not result.resumed:
    result.notes.append(f"the resume exited {code}: see {final.log}")
  elif scenario.kind == "train":
    begun = resumed_from(final.text())
    result.lost = begun < floor
    result.notes.append(f"resumed from step {begun}" +
                        (f", below step {floor}: LOST" if result.lost else ""))
  compare = train_difference if scenario.kind == "train" else prepare_difference
  diff = compare(straight_dir, work) if result.resumed else "not resumed"
  result.identical = not diff
  if diff and result.resumed:
    result.notes.append(f"DIFFERS: {diff}")
  result.lost = result.lost or not result.identical
  result.seconds = time.monotonic() - start
  return result
