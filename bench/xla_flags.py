"""Which of the XLA flags that trainers set for collective/compute overlap change shardlab's
compiled TPU train step, compiled for a TPU topology (libtpu; no TPU needed).

  .venv/bin/python bench/xla_flags.py [--layers 2] [--target tpu-v5e] [--chips 256]

Each flag is compiled alone, in its own process (libtpu reads LIBTPU_INIT_ARGS once, when
it loads), against a baseline with none: llama2-7b, FSDP over every chip, one sequence of
2048 a chip, full remat (bench/plan_tpu.py's setup, `--layers` of them). For each it prints
whether the program changed (its instructions, names and metadata aside), the async
collectives in it, the compiler's compute estimate (observe/hlo_cycles.py) and the memory
per chip. A flag that changes nothing is already the default in this libtpu, or has no
collective to act on here. docs/performance.md#xla-flags has the table and what shardlab
sets.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The flags MaxText's TPU recipes set for overlapping collectives with compute.
TPU_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
    "--xla_tpu_enable_ag_backward_pipelining=true",
)
# A control the other way: if switching the async collective fusion off changes nothing
# either, the compile-only client ignores LIBTPU_INIT_ARGS and nothing above means anything.
CONTROL = "--xla_tpu_enable_async_collective_fusion=false"

_NAME = re.compile(r"%[\w.\-]+")
_NOISE = re.compile(r", metadata=\{[^}]*\}|, frontend_attributes=\{[^}]*\}|"
                    r'"estimated_cycles":"\d+"')
# Collectives run asynchronously: start/done pairs, and the TPU compiler's async collective
# fusions (a fusion with an "async_collective_fusion_config").
_ASYNC = re.compile(r" ((?:all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
                    r"-start)\(|\"(async_collective_fusion)_config\"")


def _compile(target: str, chips: int, layers: int) -> dict:
  """This process's compile (LIBTPU_INIT_ARGS as set): the program's fingerprint, its async
  collectives, cycles and bytes per chip."""
  from shardlab import config
  from shardlab.observe import step_report
  from shardlab.plan.compiled import aot
  from shardlab.plan.compiled import train_step as plan_compile
  from shardlab.plan.training import planner as plan
  req = plan.Request.of(model="llama2-7b", precision="bf16", global_batch=chips, seq_len=2048,
                        remat="full", strategy="fsdp", devices=chips, target=target)
  cfg = config.apply_overrides(plan_compile.run_config(req, plan_compile._spec(req)),
                               [f"model.n_layers={layers}"])
  devices, _ = aot.tpu_devices(plan.hardware.get(target).topology, chips)
  compiled, mesh, _ = aot.compiled_step(cfg, devices)
  report = step_report.report(compiled, mesh, flops=True)
  text = compiled.as_text()
  body = "\n".join(_NAME.sub("%", _NOISE.sub("", line)) for line in text.splitlines()
                   if not line.startswith("HloModule"))
  return {"fingerprint": hashlib.sha256(body.encode()).hexdigest()[:12],
          "async": dict(collections.Counter(a or b for a, b in _ASYNC.findall(text))),
          "cycles": report.cycles, "bytes": report.total_bytes}


def _in_process(flag: str, args) -> dict:
  env = dict(os.environ, LIBTPU_INIT_ARGS=flag)
  done = subprocess.run([sys.executable, __file__, "--one", "--layers", str(args.layers),
                         "--target", args.target, "--chips", str(args.chips)],
                        capture_output=True, text=True, env=env, cwd=ROOT)
  lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
  if done.returncode or not lines:
    raise RuntimeError(f"compile with {flag or 'no flags'} failed (exit {done.returncode}):"
                       f"\n{done.stderr[-3000:]}")
  return json.loads(lines[-1])


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
  p.add_argument("--target", default="tpu-v5e", help="hardware target (default tpu-v5e)")
  p.add_argument("--chips", type=int, default=256, help="chips (default 256)")
  p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.one:
    print(json.dumps(_compile(args.target, args.chips, args.layers)), flush=True)
    return 0
  base = _in_process("", args)
  print(f"llama2-7b ({args.layers} layers), fsdp on {args.target} x{args.chips}; baseline: "
        f"async {base['async']}, compute {base['cycles'] / 1e9:.3f} Gcycles, "
        f"{base['bytes'] / 2**30:.2f} GiB per chip", flush=True)
  rows = []
  for flag in (CONTROL, *TPU_FLAGS):
    r = _in_process(flag, args)
    changed = r["fingerprint"] != base["fingerprint"]
    rows.append({"flag": flag, "changed": changed, **r})
    print(f"{flag:64s} {'CHANGES the program' if changed else 'no change':20s} "
          f"async {r['async']}, compute x{r['cycles'] / base['cycles']:.3f}, "
          f"memory x{r['bytes'] / base['bytes']:.3f}", flush=True)
  print(json.dumps({"baseline": base, "flags": rows}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
