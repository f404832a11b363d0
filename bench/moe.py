"""Mixture-of-experts throughput on 8 simulated CPU devices.

  .venv/bin/python bench/moe.py [--steps N] [--warmup N] [--batch B] [--seq L] [--json PATH]

moe-tiny (8 experts of width 192, 2 per token) with expert parallelism (dp on expert:8:
each device holds one expert of every layer, tokens travel by all-to-all) against ep = 1
(fsdp on fsdp:8: every expert on every device, weights gathered as for a dense model), in
both dispatch modes (dropless: sort + ragged_dot; capacity 1.25: fixed E×C buffers), and
the dense `tiny` preset with the same active MLP width (384) on fsdp:8. fp32, no remat.
The last line printed is the results as JSON.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import core  # noqa: E402  (simulates the 8 devices before the backend starts)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402

from shardlab.models import registry  # noqa: E402

CASES = [  # (label, model, dispatch, strategy, mesh)
    ("moe ep=8 dropless", "moe-tiny", "dropless", "dp", "expert:8"),
    ("moe ep=1 dropless", "moe-tiny", "dropless", "fsdp", "fsdp:8"),
    ("moe ep=8 capacity", "moe-tiny", "capacity", "dp", "expert:8"),
    ("moe ep=1 capacity", "moe-tiny", "capacity", "fsdp", "fsdp:8"),
    ("dense, same active", "tiny", None, "fsdp", "fsdp:8"),
]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--json", type=str, default=None)
  args = p.parse_args()
  rows = []
  for label, name, dispatch, strategy, mesh in CASES:
    model = registry.load(name)
    if dispatch:
      model = dataclasses.replace(model, dispatch=dispatch)
    r = core.run_train(model, mesh, strategy, args.batch, args.seq, "fp32", args.steps,
                       args.warmup)
    r["case"] = label
    r["memory_mib"] = r["memory"]["total"] / core.MiB
    rows.append(r)
    print(f"{label}: {r['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
  print(core.table(rows, [("case", "case", ""), ("mesh", "mesh", ""),
                          ("tokens/s", "tokens_per_s", ".0f"), ("step s", "step_s", ".3f"),
                          ("compile s", "compile_s", ".1f"), ("MiB/device", "memory_mib", ".1f"),
                          ("loss", "loss", ".3f")]))
  out = [{k: v for k, v in r.items() if k != "memory"} for r in rows]
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
