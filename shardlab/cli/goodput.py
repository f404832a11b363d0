"""`shardlab goodput RUN_DIR [--json]`: a run's wall time by phase and its goodput
(productive ÷ total), over every invocation since it started, restarts included; a running
run's as of its last update (docs/observability.md, "Goodput")."""

import argparse
import json
import time
from pathlib import Path

from shardlab.cli.args import run_command
from shardlab.errors import ConfigError
from shardlab.observe import goodput


def goodput_parser(prog: str = "shardlab goodput") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
  p.add_argument("run_dir", help="a run directory (train.py --run-dir): it holds goodput.jsonl")
  p.add_argument("--json", action="store_true", help="the numbers as JSON")
  return p


def render(summary: goodput.Summary, now: float | None = None) -> list[str]:
  """The phases as a table, then one line per invocation."""
  now = time.time() if now is None else now
  wall = summary.wall_s or 1.0
  lines = [f"goodput {summary.goodput:.1%}: {summary.seconds['productive']:.1f} s of "
           f"productive steps in {summary.wall_s:.1f} s of wall time"]
  lines += [f"  {goodput.LABELS[k]:<28} {v:>9.1f} s {v / wall:>6.1%}"
            for k, v in summary.seconds.items()]
  lines.append(f"{len(summary.invocations)} invocation(s):")
  for r in summary.invocations:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"]))
    status = r["status"]
    if status == "running":
      status = (f"running, or ended without a record (last update "
                f"{now - r['updated_at']:.0f} s ago)")
    lost = (f"; {r['lost_steps']} step(s) recomputed later ({r['lost_s']:.1f} s lost)"
            if r["lost_steps"] else "")
    lines.append(f"  {started}  steps {r['first_step']}..{r['last_step']}  "
                 f"{r['wall_s']:.1f} s  {status}{lost}")
  return lines


def _run(args) -> None:
  path = Path(args.run_dir)
  if not path.is_dir():
    raise ConfigError(f"run directory {args.run_dir!r} does not exist")
  records = goodput.read(path)
  if not records:
    raise ConfigError(f"{args.run_dir!r} holds no goodput record ({goodput.FILE}): a run "
                      f"writes one with --run-dir once its train step is compiled")
  summary = goodput.summarize(records)
  if args.json:
    print(json.dumps(summary.as_dict(), indent=2))
  else:
    print("\n".join(render(summary)))


def goodput_main(argv=None, prog: str = "shardlab goodput") -> int:
  return run_command(_run, goodput_parser(prog).parse_args(argv))
