"""Context parallelism on 8 simulated CPU devices (issue 13): tokens/s and compiled memory per
device of the tiny model's train step at long sequences, as the `context` axis grows.

  .venv/bin/python bench/long_context.py [--seqs 512 2048 8192] [--contexts 1 2 4 8]
                                         [--exchanges all-gather ring] [--steps 3] [--warmup 1]

Setup: the tiny preset with max_seq_len raised to the sequence, bf16, remat none,
model.attention=flash, strategy dp on the mesh `context:C` over C of the 8 devices, for both
model.kv_exchange modes (context 1 exchanges nothing: one row). The global batch is fixed per
sequence length — 8 × 512, 2 × 2048, 1 × 8192 (4096, 4096 and 8192 tokens a step: one row is
the least at 8192) — and the same for every C, so each row does the same work and the memory
column shows what one device holds of it.

Why `context:C` and not `data:8/C,context:C` (all 8 devices busy): at a fixed global batch,
data × context = 8 gives every device B·L/8 tokens whatever C is, so memory per device would
not move with the context degree; and 1 × 8192 cannot be split over a data axis at all. The
price: the C = 1 row runs on one device thread (one core of this machine), C >= 2 on both
cores, so step time is not a scaling curve for real hardware (simulated devices share the
host's cores: adding devices adds no compute). `cpu s` (process CPU time a step, all threads)
is the total work, and shows what context parallelism costs on top of the attention itself.

Memory per device is XLA's compiled memory analysis of the step (bench/core.py's `memory`:
arguments + temporaries + outputs not aliased to the donated state). Every timed step runs
after the compile and `--warmup` untimed steps, each waited for with block_until_ready. The last line printed is the results as JSON.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import core  # noqa: E402  (simulates the 8 devices first)

import jax  # noqa: E402

from shardlab.models import registry  # noqa: E402

TOKENS_PER_STEP = 4096  # global batch = max(1, this // seq)
MiB = 2**20


def run_case(seq: int, context: int, exchange: str, steps: int, warmup: int) -> dict:
  """Compiles and times one train step of tiny on `context:C` (bench/core.py's run_train)."""
  batch = max(1, TOKENS_PER_STEP // seq)
  model = dataclasses.replace(registry.load("tiny"), max_seq_len=seq, attention="flash",
                              kv_exchange=exchange)
  r = core.run_train(model, f"context:{context}", "dp", batch, seq, "bf16", steps, warmup,
                     devices=jax.devices()[:context])
  mem = r["memory"]
  return {**{k: r[k] for k in ("seq", "batch", "mesh", "step_s", "cpu_s", "tokens_per_s",
                               "compile_s", "loss")},
          "context": context, "exchange": exchange if context > 1 else "-",
          "argument_bytes": mem["argument"], "temp_bytes": mem["temp"],
          "memory_bytes": mem["total"]}


def add_ratios(rows: list[dict]) -> None:
  """Step time and memory against context 1 at the same sequence length."""
  base = {r["seq"]: r for r in rows if r["context"] == 1}
  for r in rows:
    b = base.get(r["seq"])
    r["step_x"] = r["step_s"] / b["step_s"] if b else float("nan")
    r["mem_x"] = r["memory_bytes"] / b["memory_bytes"] if b else float("nan")
    r["step_ms"], r["arg_mib"] = r["step_s"] * 1e3, r["argument_bytes"] / MiB
    r["temp_mib"], r["mem_mib"] = r["temp_bytes"] / MiB, r["memory_bytes"] / MiB


def scaling_note(rows: list[dict]) -> str:
  """How step time and memory moved from the smallest to the largest context degree."""
  lines = []
  for seq in sorted({r["seq"] for r in rows}):
    at = [r for r in rows if r["seq"] == seq]
    first = min(at, key=lambda r: r["context"])
    for exchange in sorted({r["exchange"] for r in at if r["context"] > 1}):
      last = max((r for r in at if r["exchange"] == exchange), key=lambda r: r["context"])
      lines.append(f"seq {seq}, {exchange}: context {first['context']} -> {last['context']}: "
                   f"step {last['step_s'] / first['step_s']:.2f}x, cpu "
                   f"{last['cpu_s'] / first['cpu_s']:.2f}x, memory/device "
                   f"{last['memory_bytes'] / first['memory_bytes']:.2f}x")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
  p.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--exchanges", nargs="+", default=["all-gather", "ring"],
                 choices=["all-gather", "ring"])
  p.add_argument("--steps", type=int, default=3, help="timed steps per case")
  p.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
  args = p.parse_args()
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  for c in args.contexts:
    if c < 1 or c > core.N_DEVICES:
      p.error(f"--contexts: {c} is not between 1 and {core.N_DEVICES} (the simulated devices)")
    for seq in args.seqs:
      if seq % (2 * c):
        p.error(f"--seqs: {seq} is not divisible by 2 × context {c} (the zig-zag layout)")

  rows = []
  for seq in args.seqs:
    for c in args.contexts:
      for exchange in args.exchanges[:1] if c == 1 else args.exchanges:
        rows.append(run_case(seq, c, exchange, args.steps, args.warmup))
        r = rows[-1]
        print(f"  seq {seq} context {c} {r['exchange']}: {r['step_s'] * 1e3:.0f} ms/step, "
              f"{r['memory_bytes'] / MiB:.1f} MiB/device", flush=True)
  add_ratios(rows)
  print(f"\n== tiny, bf16, flash, remat none, dp on context:C; median of steps "
        f"{args.warmup + 1}-{args.warmup + args.steps} ==")
  print(core.table(rows, [
      ("seq", "seq", "d"), ("batch", "batch", "d"), ("context", "context", "d"),
      ("kv exchange", "exchange", "s"), ("step ms", "step_ms", ".0f"),
      ("× ctx 1", "step_x", ".2f"), ("cpu s", "cpu_s", ".2f"),
      ("tokens/s", "tokens_per_s", ",.0f"), ("arg MiB", "arg_mib", ".1f"),
      ("temp MiB", "temp_mib", ".1f"), ("mem/dev MiB", "mem_mib", ".1f"),
      ("mem × ctx 1", "mem_x", ".2f"), ("compile s", "compile_s", ".1f")]))
  print("\n" + scaling_note(rows))
  print("\n" + json.dumps({"backend": jax.default_backend(), "devices": jax.device_count(),
                           "steps": args.steps, "warmup": args.warmup, "rows": rows}))


if __name__ == "__main__":
  main()
