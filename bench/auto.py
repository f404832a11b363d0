"""How good is `--strategy auto --mesh auto`'s choice? On 8 simulated CPU devices: every
candidate the search considers is compiled (top K = all), trained for a few timed steps, and
set beside its predicted step time.

  .venv/bin/python bench/auto.py [--models tiny peer] [--steps 3] [--warmup 1] [--top 4]

Prints, per model: each candidate's predicted and measured step, the rank (by measured
time) of the choice the default search (--top) makes, and how often the prediction orders
a pair of candidates as the measurement does. The target is this host (`host-cpu`, fixed
assumed figures), so the predictions are roofline guesses for shared CPU cores.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import core  # noqa: E402  (simulates the 8 devices first)

from shardlab import config  # noqa: E402
from shardlab.models import registry  # noqa: E402
from shardlab.plan.auto import choice as auto  # noqa: E402
from shardlab.plan.auto import layout as auto_layout  # noqa: E402

MODELS = {"tiny": (registry.load("tiny"), 16, 128, "fp32"),
          "peer": (core.PEER_MODEL, 8, 256, "bf16")}


def default_choice(choice: auto.Choice, top: int) -> auto.Candidate:
  """What the default search picks: the fastest predicted of the first `top` that fit."""
  fitting = [c for c in choice.candidates if c.fits][:top]
  return min(fitting, key=lambda c: (round(c.predicted_s, 12), c.report.total_bytes))


def concordance(rows: list[dict]) -> tuple[float, int, int]:
  """(the share of the pairs the prediction orders that the measurement orders alike, pairs
  predicted equal, pairs)."""
  pairs = list(itertools.combinations(rows, 2))
  ordered = [(a, b) for a, b in pairs if a["predicted_s"] != b["predicted_s"]]
  same = sum((a["predicted_s"] - b["predicted_s"]) * (a["measured_s"] - b["measured_s"]) > 0
             for a, b in ordered)
  return (same / len(ordered) if ordered else float("nan")), len(pairs) - len(ordered), len(pairs)


def bench(name: str, args) -> dict:
  model, batch, seq, precision = MODELS[name]
  cfg = config.Config(model=model, mesh="auto", strategy="auto",
                      train=config.TrainConfig(global_batch=batch, seq_len=seq,
                                               precision=precision, remat="none"))
  choice = auto_layout.auto_layout(cfg, top_k=1000)
  picked = default_choice(choice, args.top)
  rows = []
  for c in (c for c in choice.candidates if c.fits):
    o = c.option
    r = core.run_train(model, o.mesh, o.strategy, batch, seq, precision, args.steps,
                       args.warmup, remat=o.remat)
    rows.append({"strategy": o.strategy, "mesh": o.mesh, "predicted_s": c.predicted_s,
                 "measured_s": r["step_s"], "chosen": c is picked})
  rows.sort(key=lambda r: r["measured_s"])
  rank = next(i for i, r in enumerate(rows) if r["chosen"]) + 1
  share, ties, pairs = concordance(rows)
  print(f"\n{name}: {batch} × {seq}, {precision}; {len(rows)} candidates fit, "
        f"the default search (top {args.top}) picks rank {rank} by measured step time; "
        f"the measurement orders {share:.0%} of the pairs the prediction orders alike "
        f"({ties} of {pairs} pairs predicted equal)")
  print(f"  {'strategy':8s} {'mesh':26s} {'predicted':>10s} {'measured':>10s}")
  for r in rows:
    print(f"  {r['strategy']:8s} {r['mesh']:26s} {auto.seconds_text(r['predicted_s']):>10s} "
          f"{r['measured_s'] * 1e3:8.1f} ms" + ("  <- chosen" if r["chosen"] else ""))
  return {"model": name, "rank": rank, "concordance": share, "tied_pairs": ties,
          "pairs": pairs, "rows": rows}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--top", type=int, default=4)
  args = p.parse_args()
  print(json.dumps([bench(name, args) for name in args.models]))


if __name__ == "__main__":
  main()
