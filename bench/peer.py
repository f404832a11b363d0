"""shardlab against MaxText on the peer-reference config, alternating runs in one process.

  .venv/bin/python bench/peer.py [--rounds N] [--remat full none] [--steps N] [--warmup N]

Config (both sides): llama-style, vocab 32000, d_model 256, 4 layers, 4 heads × 64, MLP 1024,
seq 256, 8 sequences per step, AdamW, fp32 weights and bf16 compute, fsdp:8 on 8 simulated
CPU devices, plain dot-product attention, no checkpointing, synthetic tokens. Layers:
scanned at remat full on both sides (MaxText's default scan_layers=true); at remat none
MaxText runs them unscanned (its scan always rematerialises) and shardlab unrolls its scan
(train.scan_unroll = the layer count).
Precision: shardlab's matmuls take bf16 operands and accumulate in fp32; its attention
scores, softmax, logits and loss are fp32. MaxText (its defaults) computes the logits' dot
in bf16 and casts them to fp32 for the loss, and its attention scores and softmax in bf16.
MaxText runs through ../shared/peers/maxtext/run.sh (its own Python 3.12 venv; installed
with `bash ../shared/peers/maxtext/run.sh install`). Without that venv only shardlab's
figures are printed. Runs alternate (shardlab, MaxText, shardlab, ...) so that a machine
busy with something else slows both; compare the ratios, not the absolute times.
"1st step s" is the time to the first step, from making the train state to the first step's
result (the state's init, the step's trace and compile, and its first run): shardlab's
timed around its calls, MaxText's from its log's timestamps.
Both sides run with the same process environment: shardlab restarts itself with huge pages
for XLA:CPU's buffers (shardlab/runtime/host_memory.py), and MaxText's runs inherit that.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_SH = HERE.parents[1] / "shared" / "peers" / "maxtext" / "run.sh"
MT_VENV = Path(os.environ.get("MT_VENV", Path(os.environ.get(
    "XDG_CACHE_HOME", Path.home() / ".cache")) / "shardlab-peers" / "maxtext"))
# shardlab's remat -> MaxText's keys. MaxText wraps its scanned layers in jax.checkpoint
# whatever the policy ("none" there means "full"); only its unscanned path runs without.
REMAT = {"full": ["remat_policy=full"], "none": ["remat_policy=none", "scan_layers=false"]}
MiB = 2**20


def maxtext_available() -> bool:
  python = MT_VENV / "bin" / "python"
  return RUN_SH.exists() and python.exists() and subprocess.run(
      [str(python), "-c", "import maxtext"], capture_output=True).returncode == 0


def run_maxtext(remat: str, steps: int, warmup: int) -> dict:
  """MaxText's own pre-train loop; times the steps after `warmup` (its first step compiles)."""
  # run.sh times MaxText's steps from 5 on: warmup 4 lines the two sides up.
  proc = subprocess.run(["bash", str(RUN_SH), "train", *REMAT[remat],
                         f"steps={warmup + steps + 1}"], capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("PEER_RESULT ")]
  if proc.returncode or not lines:
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise RuntimeError(f"MaxText run failed (exit {proc.returncode}):\n{tail}")
  r = json.loads(lines[-1].removeprefix("PEER_RESULT "))
  first = _first_step_s(proc.stdout)
  total = r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
  return {"who": "MaxText", "remat": remat, "step_s": r["median_step_s"],
          "tokens_per_s": r["tokens_per_s"], "temp_mib": r["temp_bytes"] / MiB,
          "argument_mib": r["argument_bytes"] / MiB, "total_mib": total / MiB,
          "first_step_s": first}


def _first_step_s(log: str) -> float:
  """From MaxText's log timestamps: the restore check just before it makes its train state,
  to its step 0's line (the state made, the step compiled and run once); nan if absent."""
  stamps = {}
  for key, pattern in (("state", "No existing checkpoints found"),
                       ("step", "completed step: 0,")):
    line = next((l for l in log.splitlines() if pattern in l), None)
    found = line and re.match(r"I\d{4} (\d+):(\d+):([\d.]+)", line)
    if not found:
      return float("nan")
    h, m, sec = found.groups()
    stamps[key] = int(h) * 3600 + int(m) * 60 + float(sec)
  return (stamps["step"] - stamps["state"]) % 86400  # a run across midnight


def run_shardlab(remat: str, steps: int, warmup: int) -> dict:
  import core  # bench/core.py: starts 8 simulated devices on import

  # Both sides loop over the layers alike: scanned at full, unscanned (unrolled) at none.
  unroll = core.PEER_MODEL.n_layers if remat == "none" else 1
  r = core.run_train(core.PEER_MODEL, "fsdp:8", "fsdp", 8, 256, "bf16", steps, warmup,
                     remat=remat, scan_unroll=unroll)
  m = r["memory"]
  return {"who": "shardlab", "remat": remat, "scan_unroll": unroll, "step_s": r["step_s"],
          "tokens_per_s": r["tokens_per_s"], "temp_mib": m["temp"] / MiB,
          "argument_mib": m["argument"] / MiB, "total_mib": m["total"] / MiB,
          "first_step_s": r["first_step_s"]}


def compare(rounds: int, remats, steps: int, warmup: int) -> list[dict]:
  """Alternating runs; one row per (remat, side) with the median over rounds."""
  have_peer = maxtext_available()
  if not have_peer:
    print(f"MaxText venv not found at {MT_VENV}: printing shardlab only "
          f"(install it with `bash {RUN_SH} install`)")
  runs = []
  for i in range(rounds):
    for remat in remats:
      for side in ((run_shardlab, run_maxtext) if have_peer else (run_shardlab,)):
        runs.append(side(remat, steps, warmup))
        r = runs[-1]
        print(f"  round {i + 1}: {r['who']:8s} remat={remat:4s} {r['step_s'] * 1e3:7.1f} ms/step "
              f"{r['tokens_per_s']:7.0f} tokens/s  {r['total_mib']:6.1f} MiB/device", flush=True)
  rows = []
  for remat in remats:
    for who in ("shardlab", "MaxText"):
      mine = [r for r in runs if r["who"] == who and r["remat"] == remat]
      if mine:
        med = sorted(mine, key=lambda r: r["step_s"])[len(mine) // 2]
        rows.append(dict(med, rounds=len(mine)))
  for remat in remats:
    pair = {r["who"]: r for r in rows if r["remat"] == remat}
    if len(pair) == 2:
      pair["shardlab"]["speed_vs_maxtext"] = (pair["shardlab"]["tokens_per_s"] /
                                              pair["MaxText"]["tokens_per_s"])
      pair["shardlab"]["memory_vs_maxtext"] = (pair["shardlab"]["total_mib"] /
                                               pair["MaxText"]["total_mib"])
  return rows


def print_table(rows: list[dict]) -> None:
  from shardlab.parallel import dot
  print(f"shardlab's XLA:CPU dots asked for: {dot.cpu_result()} (shardlab/parallel/dot.py)")
  print(f"{'':9s} {'remat':5s} {'ms/step':>8s} {'tokens/s':>9s} {'arg MiB':>8s} "
        f"{'temp MiB':>9s} {'total MiB':>10s} {'1st step s':>10s} {'speed ×MT':>10s} "
        f"{'mem ×MT':>8s}")
  for r in rows:
    speed = f"{r['speed_vs_maxtext']:.2f}" if "speed_vs_maxtext" in r else ""
    mem = f"{r['memory_vs_maxtext']:.2f}" if "memory_vs_maxtext" in r else ""
    print(f"{r['who']:9s} {r['remat']:5s} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} "
          f"{r['argument_mib']:8.1f} {r['temp_mib']:9.1f} {r['total_mib']:10.1f} "
          f"{r['first_step_s']:10.1f} {speed:>10s} {mem:>8s}")


def main():
  import argparse

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--remat", nargs="+", choices=list(REMAT), default=list(REMAT))
  p.add_argument("--steps", type=int, default=15, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=4, help="untimed steps after compiling")
  args = p.parse_args()
  from shardlab.runtime import cpu_info, host_memory
  host_memory.reexec_with_huge_pages()  # as train.py does; MaxText's runs inherit it
  print(cpu_info.describe())
  print(host_memory.describe() + ", MaxText's runs inherit it")
  rows = compare(args.rounds, args.remat, args.steps, args.warmup)
  print_table(rows)
  print(json.dumps(rows))


if __name__ == "__main__":
  sys.path.insert(0, str(HERE))
  main()
