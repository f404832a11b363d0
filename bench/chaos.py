"""Chaos at scale: kill -9 runs at random moments, resume each, compare it bit for bit.

  .venv/bin/python bench/chaos.py [--runs 50] [--seed 0] [--out DIR] [--scenarios a,b]

Each run takes the next scenario (each in turn, in a random order; bench/chaos_scenarios.py:
dp, fsdp, tp, a pipeline over a stage axis, a mixture of experts over an expert axis, 2
processes under `shardlab launch`, a `shardlab data prepare`) and a moment: a random delay,
mid-step (just after a step is logged), mid-save (an Orbax temporary checkpoint directory is
there), mid-restore (a kill mid-save, then the resumed command killed while it restores) or
mid-prepare. It kills the command's whole process session with SIGKILL (under the launcher,
half the time one rank only), runs the same command again to the end, and compares its
metrics and final checkpoint (or prepared files) with the scenario's straight run, made once
and kept in --out. Every process shares one persistent JAX compilation cache in --out, so
only the first run of a scenario compiles. A line per run, then the table: runs tried,
killed (the kill found the command running), resumed, bit-identical, lost (expected 0:
chaos_run.py). Exit status 1 if any run was lost. On a 2-core host a run takes 20-60 s.
"""

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from chaos_run import chaos_run, straight  # noqa: E402
from chaos_scenarios import SCENARIOS  # noqa: E402

from shardlab.runtime import cpu_info  # noqa: E402
from shardlab.testing import cache  # noqa: E402


def moments_for(scenario, rng: random.Random) -> list[str]:
  moment = rng.choice(scenario.moments)
  # A restore needs a committed checkpoint: the first kill lands in a save after one.
  return ["mid-save", moment] if moment == "mid-restore" else [moment]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--runs", type=int, default=50, help="runs to try (default 50)")
  p.add_argument("--seed", type=int, default=0,
                 help="picks the scenarios, moments and delays (default 0)")
  p.add_argument("--out", default=None,
                 help="the runs, the straight runs and the JAX cache (default: a new "
                      "temporary directory, kept)")
  p.add_argument("--scenarios", default=",".join(SCENARIOS),
                 help=f"comma-separated, from {', '.join(SCENARIOS)} (default all)")
  args = p.parse_args(argv)
  names = [n for n in args.scenarios.split(",") if n]
  unknown = [n for n in names if n not in SCENARIOS]
  if args.runs < 1 or not names or unknown:
    p.error(f"--runs must be >= 1 (got {args.runs}) and --scenarios from "
            f"{', '.join(SCENARIOS)} (got {args.scenarios!r})")
  out = Path(args.out or tempfile.mkdtemp(prefix="shardlab-chaos-")).resolve()
  cache.enable(str(out / "jax-cache"))
  rng, begun, results = random.Random(args.seed), time.monotonic(), []
  print(f"chaos: {args.runs} runs, seed {args.seed}, in {out}; {cpu_info.describe()}",
        flush=True)
  order = []  # every scenario once, in a random order, then again
  run_s = {}  # how long a run of each scenario lasts with its compile cached
  for i in range(args.runs):
    order = order or rng.sample(names, len(names))
    scenario = SCENARIOS[order.pop()]
    reference = out / "straight" / scenario.name
    try:
      straight_s = straight(scenario, reference)
    except RuntimeError as e:  # a scenario that cannot run at all is no chaos finding
      print(f"skipping {scenario.name}: {e}", flush=True)
      names.remove(scenario.name)
      if not names:
        return 2
      continue
    r = chaos_run(scenario, moments_for(scenario, rng), out / "runs" / f"{i:03d}", reference,
                  run_s.get(scenario.name, straight_s), rng)
    if r.resumed:  # a resume is a run with its compile cached, less a few cheap steps
      run_s[scenario.name] = max(run_s.get(scenario.name, 0), r.resume_s)
    verdict = "LOST" if r.lost else "bit-identical"
    print(f"run {i + 1}/{args.runs}  {r.scenario:<9} {verdict:<14} {r.seconds:5.1f} s  "
          f"{'; '.join(r.notes)}", flush=True)
    results.append(r)
  print_table(results, time.monotonic() - begun)
  return 1 if any(r.lost for r in results) else 0


def print_table(results: list, seconds: float) -> None:
  rows = [("runs tried", len(results)), ("kills", sum(r.kills for r in results)),
          ("killed", sum(r.killed for r in results)),
          ("resumed", sum(r.resumed for r in results)),
          ("bit-identical", sum(r.identical for r in results)),
          ("lost", sum(r.lost for r in results))]
  print(f"\nhost           {cpu_info.model()}, {os.cpu_count()} cores")
  for name, n in rows:
    print(f"{name:<14} {n}")
  by = {}
  for r in results:
    by.setdefault(r.scenario, []).append(r)
  print("by scenario    " + ", ".join(f"{name} {sum(r.identical for r in rs)}/{len(rs)}"
                                      for name, rs in sorted(by.items())))
  print(f"wall time      {seconds:.0f} s")


if __name__ == "__main__":
  sys.exit(main())
