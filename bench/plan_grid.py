"""The planner's per-device memory against XLA's compiled memory analysis across the reference
grid (shardlab.plan.compiled.train_step.GRID: 125m, gpt2-124m and llama2-7b on 64 simulated
devices × fsdp, zero2, fsdp_tp × remat none, full × two sequence lengths; fp32 on CPU),
printed as the markdown table in docs/planning.md.

  .venv/bin/python bench/plan_grid.py [--only 125m ...] [--json PATH]

Each model's cases compile in one process with its device count (about 4 minutes in all on
2 cores).
"""

import os
import sys

if "--worker" not in sys.argv:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.plan.compiled import train_step as plan_compile  # noqa: E402

GiB = 2**30


def run_model(model: str) -> list[dict]:
  """All of one model's grid cases, compiled in this process (started with its devices)."""
  rows = []
  for case in plan_compile.GRID:
    if case[0] != model:
      continue
    start = time.perf_counter()
    c = plan_compile.compare_on_cpu(plan_compile.grid_request(*case))
    mem = c["analytic"]
    rows.append({"case": case, "compiled_gib": c["report"]["total_bytes"] / GiB,
                 "analytic_gib": mem["total_bytes"] / GiB, "ratio": c["ratio"]["total"],
                 "state_ratio": c["ratio"]["state"], "seconds": time.perf_counter() - start})
  return rows


def worker(model: str) -> list[dict]:
  """Runs run_model in a process with the model's simulated device count."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                        f"device_count={plan_compile.GRID_DEVICES[model]}").strip())
  proc = subprocess.run([sys.executable, __file__, "--worker", model], env=env,
                        capture_output=True, text=True, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> list[str]:
  """One line per model × strategy × remat; per sequence length, compiled and planner GiB
  per device and their ratio."""
  lines = ["| model | strategy | remat | seq | compiled | planner | ratio | seq | compiled | "
           "planner | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  by_row: dict[tuple, list[str]] = {}
  for r in rows:
    model, strategy, remat, seq = r["case"]
    by_row.setdefault((model, strategy, remat), []).append(
        f"{seq} | {r['compiled_gib']:.2f} | {r['analytic_gib']:.2f} | {r['ratio']:.3f}")
  for (model, strategy, remat), cells in by_row.items():
    lines.append(f"| {model} | {strategy} | {remat} | " + " | ".join(cells) + " |")
  return lines


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", nargs="*", choices=list(plan_compile.GRID_DEVICES))
  p.add_argument("--json", help="also write the rows here")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    print(json.dumps(run_model(args.worker)))
    return 0
  start = time.perf_counter()
  rows = [r for model in args.only or plan_compile.GRID_DEVICES for r in worker(model)]
  print("\n".join(table(rows)))
  ratios = [r["ratio"] for r in rows]
  print(f"\n{len(rows)} cases, ratio (planner / compiled) {min(ratios):.3f}-{max(ratios):.3f}, "
        f"{time.perf_counter() - start:.0f} s")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
