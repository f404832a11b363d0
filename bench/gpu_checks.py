"""The checks bench/gpu.sh runs on an NVIDIA GPU (each also runs on CPU, as CI does):

  python bench/gpu_checks.py attention [--platform P] [--quick]
      the fused attention path (`flash.causal`: cuDNN on gpu, blockwise on cpu) against the
      plain one (model.attention = "xla"), values and gradients, each measured against the
      plain path in fp32; on gpu it also checks that the compiled program calls cuDNN.
  python bench/gpu_checks.py step [--other-platform P] [--steps N]
      a bundled model (tiny) trained for N steps here and, in a subprocess, on
      --other-platform (default cpu): losses compared step by step, in fp32 (matmuls at
      full fp32 precision on both: TF32 would differ by design) and in bf16.
  python bench/gpu_checks.py peer [--steps N] [--warmup N] [--rounds N]
      bench/peer.py's config on this machine's first device (mesh fsdp:1, 8 sequences of
      256 a step) at remat full and none: tokens/s and compiled memory; MaxText's on the
      same device alongside when it can be imported (see `maxtext_python`), the two
      alternating over --rounds (medians printed).
  python bench/gpu_checks.py planner [--target T] [--steps N] [--warmup N] [--quick]
      bundled models (1B, GPT-2 1.5B, 125M) trained on one device, their tokens/s and compiled
      memory beside the planner's for the same run on this GPU's target (from its name, or
      --target): a report of how far the planner is from one real device.

Each prints a table and ends with a line `GPU_CHECK {json}`; the exit status is 1 when a
comparison is outside its band.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# Several processes share the GPU here (a train.py run per side, MaxText beside shardlab):
# none may take most of its memory up front, as JAX does by default.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Attention cases: (batch, length, heads, kv heads, head_dim, window). Long enough that the
# fused kernel tiles the sequence; GQA and a sliding window shorter than the sequence.
CASES = [(2, 1024, 8, 2, 128, None), (2, 1024, 8, 8, 64, None), (1, 2048, 16, 4, 128, 256)]
QUICK_CASES = [(1, 256, 4, 2, 32, None), (1, 256, 4, 1, 32, 64)]


def _rel(a, b) -> float:
  import numpy as np
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def attention_case(case, platform: str) -> dict:
  import jax
  import jax.numpy as jnp

  from shardlab.parallel import attention, flash

  b, l, h, kv, e, window = case
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(keys[i], (b, l, n, e), jnp.float32) for i, n in
             enumerate((h, kv, kv)))
  cot = jax.random.normal(keys[3], (b, l, h, e), jnp.float32)
  bf = lambda *xs: [x.astype(jnp.bfloat16) for x in xs]

  def value_and_grads(f, *args):
    out, vjp = jax.vjp(f, *args)
    return (out, *vjp(cot.astype(out.dtype)))

  plain = lambda q, k, v: attention(q, k, v, impl="xla", window=window)
  fused = lambda q, k, v: flash.causal(q, k, v, platform=platform, window=window)
  ref = jax.jit(lambda *a: value_and_grads(plain, *a))(q, k, v)
  plain16 = jax.jit(lambda *a: value_and_grads(plain, *a))(*bf(q, k, v))
  fused_fn = jax.jit(lambda *a: value_and_grads(fused, *a))
  fused16 = fused_fn(*bf(q, k, v))
  hlo = fused_fn.lower(*bf(q, k, v)).compile().as_text()
  names = ("out", "dq", "dk", "dv")
  row = {"case": f"B{b} L{l} H{h} K{kv} E{e} window {window}",
         "cudnn_in_program": "__cudnn$fmha" in hlo}
  for name, r, p, f in zip(names, ref, plain16, fused16):
    row[f"{name}_plain_bf16"] = _rel(p, r)
    row[f"{name}_fused_bf16"] = _rel(f, r)
  return row


def check_attention(args) -> bool:
  import jax

  platform = args.platform or jax.default_backend()
  print(f"attention on {platform} ({jax.devices()[0].device_kind}): max |x - fp32 plain| / "
        f"max |fp32 plain|, bf16 inputs")
  rows, ok = [], True
  for case in (QUICK_CASES if args.quick else CASES):
    row = attention_case(case, platform)
    rows.append(row)
    print(f"  {row['case']}" + ("  [cuDNN kernel in the program]" if row["cudnn_in_program"]
                                else ""))
    for name in ("out", "dq", "dk", "dv"):
      p, f = row[f"{name}_plain_bf16"], row[f"{name}_fused_bf16"]
      # The fused kernel may round differently from XLA's plain bf16 path, but not be worse
      # than twice its error (or 1% of the largest value, bf16's few-ulp scale).
      good = f <= max(2 * p, 1e-2)
      ok &= good
      print(f"    {name:3s}  plain bf16 {p:.2e}  fused bf16 {f:.2e}  {'ok' if good else 'FAIL'}")
    if platform == "gpu" and not row["cudnn_in_program"]:
      ok = False
      print("    FAIL: the fused path's compiled program has no cuDNN attention call")
  print("GPU_CHECK " + json.dumps({"check": "attention", "platform": platform, "ok": ok,
                                   "rows": rows}))
  return ok


def train_losses(platform: str, precision: str, steps: int) -> list[float]:
  """Per-step losses of `train.py --model tiny` on one device of `platform` ("cpu", or the
  accelerator JAX picks by default), read from its metrics file."""
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
  extra = []
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    extra = ["--simulate-devices", "1"]
  with tempfile.TemporaryDirectory() as tmp:
    metrics = Path(tmp) / "metrics.jsonl"
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", "tiny", "--mesh", "data:1",
           "--strategy", "dp", "--steps", str(steps), "--precision", precision,
           "--sample-tokens", "0", "--quiet", "--metrics-file", str(metrics),
           "--set", "train.log_every=1", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
      raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
  return [r["loss"] for r in records if "step" in r and "loss" in r]


def check_step(args) -> bool:
  from shardlab.runtime import devices

  # Named without starting a backend here: the two runs are subprocesses, each with the
  # device to itself.
  here = "accelerator" if devices.accelerator_present() else "cpu"
  # fp32 with full-precision matmuls on both sides: only the order of the sums differs.
  # bf16: the roundings of bf16 activations differ by kernel, so a looser band.
  bands = {"fp32": 1e-4, "bf16": 2e-2}
  print(f"tiny model, {args.steps} steps, one device: {here} against {args.other_platform}")
  ok, rows = True, []
  for precision, band in bands.items():
    a = train_losses(here, precision, args.steps)
    b = train_losses(args.other_platform, precision, args.steps)
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    good = len(a) == len(b) == args.steps and worst <= band
    ok &= good
    rows.append({"precision": precision, "here": a, "other": b, "worst_rel": worst})
    print(f"  {precision}: losses {here} {[round(x, 5) for x in a]}")
    print(f"  {' ' * len(precision)}         {args.other_platform} "
          f"{[round(x, 5) for x in b]}  worst relative {worst:.1e} (band {band:g}) "
          f"{'ok' if good else 'FAIL'}")
  print("GPU_CHECK " + json.dumps({"check": "step", "platform": here, "ok": ok, "rows": rows}))
  return ok


def maxtext_python() -> list[str] | None:
  """The Python that imports MaxText: $MT_VENV's (bench/peer.py's venv), else this one with
  $MAXTEXT_PYTHONPATH in front (MaxText's wheels unpacked there), else None."""
  venv = Path(os.environ.get("MT_VENV", Path.home() / ".cache" / "shardlab-peers" / "maxtext"))
  for python in (venv / "bin" / "python", Path(sys.executable)):
    env = dict(os.environ, PYTHONPATH=os.environ.get("MAXTEXT_PYTHONPATH", ""))
    if python.exists() and subprocess.run([str(python), "-c", "import maxtext"], env=env,
                                          capture_output=True).returncode == 0:
      return [str(python)]
  return None


# MaxText's keys for bench/peer.py's config on one device (8 sequences a step, as there).
MAXTEXT_PEER = ["attention=dot_product", "base_emb_dim=256", "base_num_query_heads=4",
                "base_num_kv_heads=4", "base_mlp_dim=1024", "base_num_decoder_layers=4",
                "head_dim=64", "vocab_size=32000", "max_target_length=256",
                "per_device_batch_size=8", "dtype=bfloat16", "dataset_type=synthetic",
                "enable_checkpointing=false", "skip_jax_distributed_system=true",
                "jax_cache_dir=", "enable_goodput_recording=false", "monitor_goodput=false",
                "enable_tensorboard=false"]


def run_maxtext(python: list[str], remat: str, steps: int, warmup: int) -> dict:
  import peer  # bench/peer.py: MaxText's remat keys for the peer config

  # MaxText's own train entry, with its compiled-memory printout patched to log raw bytes
  # (it rounds to 0.1 GB), as ../shared/peers/maxtext/run.sh does on CPU.
  code = ("import os, sys, maxtext\nfrom absl import app\n"
          "from maxtext.utils import max_utils, max_logging\n"
          "from maxtext.trainers.pre_train import train\n"
          "orig = max_utils.print_compiled_memory_stats\n"
          "def patched(stats, prefix=''):\n"
          "  orig(stats, prefix)\n"
          "  if stats is not None:\n"
          "    max_logging.log(f'RAW_MEMORY {stats.argument_size_in_bytes} "
          "{stats.output_size_in_bytes} {stats.temp_size_in_bytes} {stats.alias_size_in_bytes}')\n"
          "max_utils.print_compiled_memory_stats = patched\n"
          "cfg = os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml')\n"
          "app.run(train.main, argv=[sys.argv[0], cfg] + sys.argv[1:])\n")
  with tempfile.TemporaryDirectory() as out:
    cmd = [*python, "-c", code, "run_name=peer", f"base_output_directory={out}", "hardware=gpu",
           *MAXTEXT_PEER, *peer.REMAT[remat], f"steps={warmup + steps + 1}"]
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE",
               PYTHONPATH=os.environ.get("MAXTEXT_PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  text = proc.stdout + proc.stderr
  found = {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(
      r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: [\d.]+, "
      r"Tokens/s/device: ([\d.]+)", text)}
  timed = [v for s, v in found.items() if s > warmup]
  if proc.returncode or not timed:
    tail = "\n".join(text.strip().splitlines()[-15:])
    raise RuntimeError(f"MaxText run failed (exit {proc.returncode}):\n{tail}")
  # Step time from MaxText's tokens/s: its printed seconds have 3 decimals (ms-long steps).
  tokens_per_s = statistics.median(t for _, t in timed)
  row = {"who": "MaxText", "remat": remat, "step_s": 8 * 256 / tokens_per_s,
         "tokens_per_s": tokens_per_s}
  mem = re.search(r"RAW_MEMORY (\d+) (\d+) (\d+) (\d+)", text)
  if mem:
    argument, output, temp, alias = map(int, mem.groups())
    row["total_mib"] = (argument + output - alias + temp) / 2**20
  return row


def median_row(runs: list[dict]) -> dict:
  """One side's runs at one remat: the median of each figure over the rounds."""
  row = dict(runs[0], rounds=len(runs))
  for key in ("step_s", "tokens_per_s", "compile_s", "total_mib"):
    if key in row:
      row[key] = statistics.median(r[key] for r in runs)
  return row


def check_peer(args) -> bool:
  os.environ["SHARDLAB_BENCH_DEVICES"] = "native"  # bench/core.py: this machine's devices
  import core

  import jax

  print(f"peer config on one {jax.default_backend()} device ({jax.devices()[0].device_kind}), "
        f"8 × 256 tokens a step, bf16")
  mt = maxtext_python()
  runs = []
  for _ in range(args.rounds):  # alternating, so a busy machine slows both sides alike
    for remat in ("full", "none"):
      unroll = core.PEER_MODEL.n_layers if remat == "none" else 1
      r = core.run_train(core.PEER_MODEL, "fsdp:1", "fsdp", 8, 256, "bf16", args.steps,
                         args.warmup, remat=remat, scan_unroll=unroll)
      runs.append({"who": "shardlab", "remat": remat, "step_s": r["step_s"],
                   "tokens_per_s": r["tokens_per_s"], "compile_s": r["compile_s"],
                   "total_mib": r["memory"]["total"] / 2**20})
      if mt:
        try:
          runs.append(run_maxtext(mt, remat, args.steps, args.warmup))
        except RuntimeError as e:
          print(f"  MaxText at remat {remat}: {e}")
  rows = [median_row([r for r in runs if (r["who"], r["remat"]) == key])
          for key in dict.fromkeys((r["who"], r["remat"]) for r in runs)]
  if not mt:
    print("  MaxText is not importable here (set MT_VENV or MAXTEXT_PYTHONPATH): "
          "shardlab only")
  for row in rows:
    mem = f"{row['total_mib']:8.1f} MiB" if "total_mib" in row else " " * 12
    print(f"  {row['who']:8s} remat {row['remat']:4s}  {row['step_s'] * 1e3:8.2f} ms/step  "
          f"{row['tokens_per_s']:10.0f} tokens/s  {mem}")
  print("GPU_CHECK " + json.dumps({"check": "peer", "ok": True, "rows": rows}))
  return True


# One-device runs the planner predicts: (preset, sequences, tokens each, remat). A 1B model
# at 16k tokens a step keeps the GPU busy with matmuls, as the planner's published runs do;
# GPT-2 1.5B is another architecture; 125M is small enough to be bound by memory and launch.
PLANNER_CASES = [("1b", 8, 2048, "full"), ("1b", 8, 2048, "none"),
                 ("gpt2-1.5b", 8, 1024, "none"), ("125m", 16, 1024, "none")]
QUICK_PLANNER_CASES = [("tiny", 4, 128, "none")]


def planner_row(name: str, batch: int, seq: int, remat: str, target: str, steps: int,
                warmup: int, devices=None) -> dict:
  """One run of preset `name` on one device (the first of `devices`, default JAX's) against
  the planner's figures for the same run on `target`."""
  os.environ["SHARDLAB_BENCH_DEVICES"] = "native"  # bench/core.py: this machine's devices
  import core

  from shardlab import config
  from shardlab.models import registry
  from shardlab.plan.training import planner as plan
  from shardlab.runtime import hardware

  model = registry.load(name)
  r = core.run_train(model, "data:1", "dp", batch, seq, "bf16", steps, warmup, remat=remat,
                     devices=devices[:1] if devices else None)
  train = config.TrainConfig(global_batch=batch, seq_len=seq, precision="bf16", remat=remat)
  req = plan.Request.from_config(config.Config(model=model, mesh="data:1", strategy="dp",
                                               train=train), target=target, devices=1)
  # The estimate alone: `plan.plan` would also search device counts and other strategies.
  acc = hardware.get(target)
  est = plan.estimate(req, model, acc, plan.resolve_mesh(req, model, acc))
  return {"model": name, "batch": batch, "seq": seq, "remat": remat,
          "measured_tokens_per_s": r["tokens_per_s"], "planned_tokens_per_s": est.tokens_per_s,
          "measured_mib": r["memory"]["total"] / 2**20, "planned_mib": est.memory.total / 2**20,
          "planned_mfu": est.mfu}


def check_planner(args) -> bool:
  """The planner's tokens/s and memory for one device of this machine against measured
  runs. A report, not a pass/fail check: the planner's GPU efficiency comes from published
  multi-GPU runs, and this shows how far one GPU's step is from it."""
  import jax

  from shardlab.observe import throughput
  from shardlab.runtime import hardware

  kind = jax.devices()[0].device_kind
  # The device's entry as train.py's MFU reads it.
  acc = throughput.accelerator_for(kind)
  target = args.target or (acc.name if acc else None)
  if target is None:
    raise SystemExit(f"no planner target for a {kind!r} device: pass --target (one of "
                     f"{', '.join(sorted(hardware.ACCELERATORS))})")
  print(f"planner ({target}) against measured runs on one {kind}, bf16, "
        f"medians of {args.steps} steps after {args.warmup}")
  rows = []
  for case in (QUICK_PLANNER_CASES if args.quick else PLANNER_CASES):
    row = planner_row(*case, target, args.steps, args.warmup)
    rows.append(row)
    tokens = row["planned_tokens_per_s"] / row["measured_tokens_per_s"]
    print(f"  {row['model']:10s} {row['batch']:3d} x {row['seq']:5d} remat {row['remat']:4s}  "
          f"tokens/s measured {row['measured_tokens_per_s']:9.0f} planned "
          f"{row['planned_tokens_per_s']:9.0f} (x{tokens:.2f}; planned MFU "
          f"{row['planned_mfu']:.1%})  memory measured {row['measured_mib']:8.0f} MiB planned "
          f"{row['planned_mib']:8.0f} (x{row['planned_mib'] / row['measured_mib']:.2f})",
          flush=True)
  print("GPU_CHECK " + json.dumps({"check": "planner", "target": target, "ok": True,
                                   "rows": rows}))
  return True


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="check", required=True)
  a = sub.add_parser("attention")
  a.add_argument("--platform", help="the fused path's platform (default: JAX's backend)")
  a.add_argument("--quick", action="store_true", help="small shapes (CI, on CPU)")
  s = sub.add_parser("step")
  s.add_argument("--other-platform", default="cpu")
  s.add_argument("--steps", type=int, default=5)
  p = sub.add_parser("peer")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--rounds", type=int, default=3)
  q = sub.add_parser("planner")
  q.add_argument("--target", help="the planner's hardware target (default: from the "
                                  "device's name)")
  q.add_argument("--steps", type=int, default=10)
  q.add_argument("--warmup", type=int, default=3)
  q.add_argument("--quick", action="store_true", help="the tiny model only")
  args = parser.parse_args()
  run = {"attention": check_attention, "step": check_step, "peer": check_peer,
         "planner": check_planner}[args.check]
  sys.exit(0 if run(args) else 1)


if __name__ == "__main__":
  main()
