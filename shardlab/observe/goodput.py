"""Goodput: the share of a run's wall time spent on steps that count.

A `Clock` charges every second of one invocation (one `train` call, one process start) to
exactly one phase: the innermost open `phase(...)`, else "other" (set-up, logging, the
end). The loop opens "productive" around its steps and, inside it, "data_wait",
"checkpoint" (the blocking part of a save), "eval"; "compile" and "restore" come before it.
So the phases add up to the invocation's wall time by construction.

A `Ledger` keeps the invocations of a run directory: goodput.live.json is rewritten while one
runs (so `shardlab goodput` reads a running run, and a crash leaves its last state), and its
record is appended to goodput.jsonl when it ends. Restarts are counted from that history
(`summarize`): steps an invocation computed beyond the step a later one resumed from were
computed twice, so their time (at that invocation's productive seconds per step) moves from
"productive" to "restarts". The time between invocations (a job waiting in a queue) is not
counted: the wall time is the invocations' own. As in MaxText's goodput, blocking checkpoint
time, compilation and recomputed steps are badput; an async save's background part is not.
"""

import contextlib
import dataclasses
import json
import os
import socket
import time
from pathlib import Path

FILE, LIVE = "goodput.jsonl", "goodput.live.json"
LIVE_EVERY_S = 10.0  # the live record is rewritten at most this often (at log steps)
PHASES = ("productive", "compile", "checkpoint", "restore", "data_wait", "eval", "restarts",
          "other")
CHARGED = tuple(p for p in PHASES if p != "restarts")  # restarts: found across invocations
LABELS = {"productive": "productive steps", "compile": "compilation",
          "checkpoint": "checkpoint saves (blocking)", "restore": "checkpoint restores",
          "data_wait": "data waits", "eval": "evaluation", "restarts": "lost to restarts",
          "other": "other (set-up, logging)"}


class Clock:
  """One invocation's wall time by phase (perf_counter seconds) and the steps it covered."""

  def __init__(self, first_step: int = 0):
    self.seconds = dict.fromkeys(CHARGED, 0.0)
    self.started_at = time.time()
    self._open, self._mark = ["other"], time.perf_counter()
    self.first_step = self.last_step = first_step

  def _charge(self) -> None:
    now = time.perf_counter()
    self.seconds[self._open[-1]] += now - self._mark
    self._mark = now

  @contextlib.contextmanager
  def phase(self, name: str):
    """Charges the time inside to `name` (nested phases take their own time out of it)."""
    if name not in CHARGED:
      raise ValueError(f"goodput phase {name!r}: valid phases are {', '.join(CHARGED)}")
    self._charge()
    self._open.append(name)
    try:
      yield
    finally:
      self._charge()
      self._open.pop()

  def elapsed(self) -> dict:
    """Seconds per phase so far; they add up to the wall time since the start."""
    self._charge()
    return dict(self.seconds)

  def record(self, status: str, new_run: bool) -> dict:
    seconds = self.elapsed()
    return {"id": f"{int(self.started_at * 1000)}-{os.getpid()}", "host": socket.gethostname(),
            "pid": os.getpid(), "started_at": self.started_at, "updated_at": time.time(),
            "status": status, "new_run": new_run, "first_step": self.first_step,
            "last_step": self.last_step, "wall_s": sum(seconds.values()), "seconds": seconds}


@dataclasses.dataclass(frozen=True)
class Summary:
  """A run's wall time by phase (PHASES) over its invocations since its last new start."""
  seconds: dict
  invocations: list

  @property
  def wall_s(self) -> float:
    return sum(self.seconds.values())

  @property
  def goodput(self) -> float:
    return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

  @property
  def lost_steps(self) -> int:
    return sum(r["lost_steps"] for r in self.invocations)

  def as_dict(self) -> dict:
    return {"goodput": self.goodput, "wall_s": self.wall_s, "seconds": self.seconds,
            "shares": {k: v / self.wall_s if self.wall_s else 0.0
                       for k, v in self.seconds.items()},
            "lost_steps": self.lost_steps, "invocations": self.invocations}

  def metrics(self) -> dict:
    """The metrics JSONL's fields (goodput, goodput_wall_s, goodput_<phase>_s)."""
    return {"goodput": self.goodput, "goodput_wall_s": self.wall_s,
            **{f"goodput_{k}_s": v for k, v in self.seconds.items()}}

  def scalars(self) -> dict:
    """TensorBoard's, under goodput/: fraction, wall_s, <phase>_s."""
    return {"fraction": self.goodput, "wall_s": self.wall_s,
            **{f"{k}_s": v for k, v in self.seconds.items()}}

  def line(self) -> str:
    n = len(self.invocations)
    parts = ", ".join(f"{LABELS[k].split(' (')[0]} {v:.1f} s" for k, v in self.seconds.items()
                      if v >= 0.05 or k == "productive")
    return (f"goodput {self.goodput:.1%} of {self.wall_s:.1f} s"
            f"{f' over {n} invocations' if n > 1 else ''}: {parts}")


def summarize(records: list[dict]) -> Summary:
  """The run's phases from its invocation records (oldest first), from the last one that
  started the run anew: each invocation's steps at or past the first step of a later one
  were recomputed there, and their time is lost to restarts."""
  start = max((i for i, r in enumerate(records) if r.get("new_run")), default=0)
  records, seconds, rows = records[start:], dict.fromkeys(PHASES, 0.0), []
  for i, r in enumerate(records):
    for phase in CHARGED:
      seconds[phase] += r["seconds"].get(phase, 0.0)
    first, last = r["first_step"], r["last_step"]
    resumed = min((later["first_step"] for later in records[i + 1:]), default=last)
    lost = max(0, last - max(first, resumed))
    lost_s = lost * r["seconds"]["productive"] / max(1, last - first)
    seconds["productive"] -= lost_s
    seconds["restarts"] += lost_s
    rows.append({"status": r["status"], "started_at": r["started_at"],
                 "updated_at": r["updated_at"], "first_step": first, "last_step": last,
                 "wall_s": r["wall_s"], "lost_steps": lost, "lost_s": lost_s})
  return Summary(seconds, rows)


def read(run_dir: str | Path) -> list[dict]:
  """The run directory's invocation records, oldest first, a running (or crashed) one's
  live record last."""
  records = read_file(Path(run_dir))
  live = _live(Path(run_dir))
  if live is not None and live["id"] not in {r["id"] for r in records}:
    records.append(live)
  return sorted(records, key=lambda r: r["started_at"])


def read_file(run_dir: Path) -> list[dict]:
  """goodput.jsonl's records alone; a line cut short by a kill is skipped."""
  records = []
  with contextlib.suppress(FileNotFoundError):
    for line in (run_dir / FILE).read_text().splitlines():
      with contextlib.suppress(json.JSONDecodeError):
        records.append(json.loads(line))
  return records


def _live(path: Path) -> dict | None:
  try:
    return json.loads((path / LIVE).read_text())
  except (OSError, json.JSONDecodeError):
    return None


class Ledger:
  """This invocation's records in `run_dir` (None, or a process other than the leader:
  nothing is written, and the summary covers this invocation alone)."""

  def __init__(self, run_dir: str | None, clock: Clock, new_run: bool):
    self.dir, self.clock, self.new_run = Path(run_dir) if run_dir else None, clock, new_run
    self._written = 0.0
    if self.dir is not None:
      self.dir.mkdir(parents=True, exist_ok=True)
      self._adopt()

  def _adopt(self) -> None:
    """A live record no end was written for (a crash, a kill) joins the history as it was."""
    live = _live(self.dir)
    if live is not None and live["id"] not in {r["id"] for r in read_file(self.dir)}:
      self._append({**live, "status": "ended without a record"})

  def _append(self, record: dict) -> None:
    with open(self.dir / FILE, "a") as f:
      f.write(json.dumps(record) + "\n")

  def update(self, force: bool = False) -> None:
    """Rewrites the live record (at most every LIVE_EVERY_S unless forced)."""
    if self.dir is None or (not force and time.monotonic() - self._written < LIVE_EVERY_S):
      return
    self._written = time.monotonic()
    tmp = self.dir / f"{LIVE}.tmp"
    tmp.write_text(json.dumps(self.clock.record("running", self.new_run)))
    os.replace(tmp, self.dir / LIVE)

  def end(self, status: str) -> Summary:
    """Closes this invocation's record; the run's summary, restarts included."""
    record = self.clock.record(status, self.new_run)
    if self.dir is None:
      return summarize([record])
    self._append(record)
    with contextlib.suppress(FileNotFoundError):
      (self.dir / LIVE).unlink()
    return summarize(read(self.dir))

