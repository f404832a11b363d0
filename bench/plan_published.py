"""The planner's step time against published measured training runs: predicted / measured
tokens/s per device for the fitted and the held-out half (shardlab/plan/training/published.py
says how they were split), each run's source cited. No devices needed.

  .venv/bin/python bench/plan_published.py
"""

import argparse

from shardlab.plan.training import published


def main():
  argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
  fitted, held = published.split()
  sources = []
  w_run = max(len(r.name) for r in published.RUNS)
  w_target = max(len(r.target) for r in published.RUNS)
  for title, runs in (("fitted", fitted), ("held out", held)):
    print(f"== {title} ==")
    print(f"{'run':{w_run}s} {'target':{w_target}s} {'predicted':>9s} {'measured':>9s} "
          f"{'ratio':>6s}  src")
    worst = 0.0
    for r in runs:
      e = published.predict(r)
      predicted = e.tokens_per_s / e.n_devices
      if r.source not in sources:
        sources.append(r.source)
      x = predicted / r.tokens_per_s
      worst = max(worst, abs(x - 1))
      print(f"{r.name:{w_run}s} {r.target:{w_target}s} {predicted:9.0f} "
            f"{r.tokens_per_s:9.0f} {x:6.2f}  [{sources.index(r.source) + 1}]")
    print(f"worst |ratio - 1|: {worst:.1%}\n")
  for i, s in enumerate(sources):
    print(f"[{i + 1}] {s}")


if __name__ == "__main__":
  main()
