"""Which of the XLA flags that trainers set for collective/compute overlap change shardlab's
compiled train step: for a TPU topology (libtpu; no TPU needed), or for 8 GPUs mocked on one.

  .venv/bin/python bench/xla_flags.py [--layers 2] [--target tpu-v5e] [--chips 256]
  python bench/xla_flags.py --platform gpu [--jobs 8] [--json PATH]   (on a GPU machine)

Each flag is compiled alone, in its own process (libtpu reads LIBTPU_INIT_ARGS once, when
it loads; XLA:GPU reads XLA_FLAGS once), against a baseline with none: llama2-7b, FSDP over
every chip, full remat, `--layers` of its layers. On TPU one sequence of 2048 a chip over a
v5e-256 (bench/plan_tpu.py's setup); on GPU MaxText's llama2-7b recipe for one 8-GPU host
(configs/gpu/a3/llama_2_7b/1vm.sh: FSDP 8, 4 sequences of 4096 a GPU) with the devices
mocked (`mock_num_gpu_processes`: JAX's GPU client presents 8 devices and compiles
collectives for them; nothing runs), autotuning off so that the compiler's choices do not
vary between processes. Each row says whether the program changed (its instructions in
order, names and metadata aside), the async collectives in it, the TPU compiler's compute
estimate (observe/hlo_cycles.py) and the memory per chip. A flag that changes nothing is
already the default in this XLA, or has no collective to act on here; a flag this XLA does
not know is reported as such. docs/performance.md#xla-flags has the tables and what
shardlab sets.
"""

import argparse
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

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

# The flags of MaxText's llama2-7b recipe for one 8-GPU host (configs/gpu/a3/llama_2_7b/
# 1vm.sh), its dump path aside, each alone and then all together.
GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_command_buffer=",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    "--xla_gpu_pipeline_all_gather=on",
    "--xla_gpu_pipeline_reduce_scatter=on",
    "--xla_gpu_pipeline_all_reduce=on",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_disable_hlo_passes=rematerialization",
)
# Controls the other way: collectives made synchronous, and no latency-hiding scheduler.
GPU_CONTROLS = ("--xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER,REDUCESCATTER",
                "--xla_gpu_enable_latency_hiding_scheduler=false")
PLATFORMS = {"tpu": {"target": "tpu-v5e", "chips": 256, "per_chip": 1, "seq_len": 2048},
             "gpu": {"target": "h100-80g", "chips": 8, "per_chip": 4, "seq_len": 4096}}

_NAME = re.compile(r"%[\w.\-]+")
_NOISE = re.compile(r", metadata=\{[^}]*\}|, frontend_attributes=\{[^}]*\}|"
                    r'"estimated_cycles":"\d+"')
# Collectives run asynchronously: start/done pairs (XLA:GPU also wraps some in async-start),
# and the TPU compiler's async collective fusions (a fusion with an
# "async_collective_fusion_config").
_ASYNC = re.compile(r" ((?:all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all"
                    r"|async)-start)\(|\"(async_collective_fusion)_config\"")
# Lines that are not the program: its header, and the tables of the Python source it was
# traced from (file and function names, stack frames), which name this script's path.
_NOT_PROGRAM = re.compile(r"HloModule|(FileNames|FunctionNames|FileLocations|StackFrames)$|\d+ ")
# XLA:GPU marks a start/done pair that has nothing to overlap as synchronous.
_SYNC = re.compile(r'"is_sync":true')


def fingerprint(text: str) -> str:
  """A short hash of a compiled program's text that two compiles of the same program share:
  its instructions in order, without their names, metadata, cost estimates or the table of
  Python source lines it was traced from."""
  body = "\n".join(_NAME.sub("%", _NOISE.sub("", line)) for line in text.splitlines()
                   if not _NOT_PROGRAM.match(line))
  return hashlib.sha256(body.encode()).hexdigest()[:12]


def _devices(args):
  """The devices to compile for: a TPU topology, or `chips` GPUs mocked on this one."""
  from shardlab.plan.compiled import aot
  from shardlab.plan.training import planner as plan
  if args.platform == "tpu":
    return aot.tpu_devices(plan.hardware.get(args.target).topology, args.chips)[0]
  return aot.mocked_gpus(args.chips)  # this machine's GPU stands for each of them


def _compile(args) -> dict:
  """This process's compile (LIBTPU_INIT_ARGS or XLA_FLAGS as set): the program's
  fingerprint, its async collectives, the collectives by kind, cycles and bytes per chip, and
  the planner's total for the same step."""
  from shardlab import config
  from shardlab.observe import step_report
  from shardlab.plan.compiled import aot
  from shardlab.plan.compiled import train_step as plan_compile
  from shardlab.plan.training import planner as plan
  devices = _devices(args)  # first: the GPU mock must be set before JAX starts its client
  req = plan.Request.of(model="llama2-7b", precision="bf16",
                        global_batch=args.chips * args.per_chip, seq_len=args.seq_len,
                        remat="full", strategy="fsdp", devices=args.chips, target=args.target)
  spec = plan_compile._spec(req)
  cfg = config.apply_overrides(plan_compile.run_config(req, spec),
                               [f"model.n_layers={args.layers}"])
  compiled, mesh, _ = aot.compiled_step(cfg, devices)
  report = step_report.report(compiled, mesh, flops=True)
  est = plan.estimate(dataclasses.replace(req, train=cfg.train), cfg.model,
                      plan.hardware.get(args.target), spec)
  text = compiled.as_text()
  return {"fingerprint": fingerprint(text),
          "async": dict(collections.Counter(a or b for a, b in _ASYNC.findall(text))),
          "sync": len(_SYNC.findall(text)),
          "collectives": {k: v["count"] for k, v in report.kinds().items()},
          "cycles": report.cycles, "bytes": report.total_bytes,
          "planned_bytes": est.memory.total, "attention": cfg.model.attention}


def _in_process(flag: str, args) -> dict:
  """One compile in a fresh process with `flag` set; {"error": ...} when it fails (an unknown
  flag stops XLA as it starts)."""
  env = dict(os.environ)
  if args.platform == "tpu":
    env.update(JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=flag)
  else:
    # aot.mocked_gpus adds --xla_gpu_autotune_level=0 in every process, the baseline's too:
    # autotuning times kernels, so its picks (and the program) could differ between two
    # compiles of the same program.
    env.update(XLA_FLAGS=flag)
  cmd = [sys.executable, __file__, "--one", "--platform", args.platform, "--layers",
         str(args.layers), "--target", args.target, "--chips", str(args.chips), "--per-chip",
         str(args.per_chip), "--seq-len", str(args.seq_len)]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=args.timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"no result in {args.timeout} s"}
  lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
  if done.returncode or not lines:
    tail = done.stderr.strip().splitlines()[-8:]
    unknown = [l for l in tail if "nknown flag" in l]
    return {"error": unknown[0] if unknown else f"exit {done.returncode}: " + " | ".join(tail)}
  return json.loads(lines[-1])


def _row(flag: str, r: dict, base: dict) -> str:
  if "error" in r:
    return f"{flag:64s} FAILED: {r['error'][-300:]}"
  changed = r["fingerprint"] != base["fingerprint"]
  compute = f"compute x{r['cycles'] / base['cycles']:.3f}, " if base["cycles"] else ""
  return (f"{flag:64s} {'CHANGES the program' if changed else 'no change':20s} "
          f"async {r['async']}, sync {r['sync']}, {compute}"
          f"memory x{r['bytes'] / base['bytes']:.3f}")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--platform", choices=sorted(PLATFORMS), default="tpu",
                 help="tpu: a topology compiled from this host; gpu: 8 GPUs mocked on this "
                      "machine's GPU (default tpu)")
  p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
  p.add_argument("--target", help="hardware target (default tpu-v5e; h100-80g on gpu)")
  p.add_argument("--chips", type=int, help="chips (default 256 on tpu, 8 on gpu)")
  p.add_argument("--per-chip", type=int, help="sequences a chip (default 1 on tpu, 4 on gpu)")
  p.add_argument("--seq-len", type=int, help="tokens a sequence (default 2048; 4096 on gpu)")
  p.add_argument("--timeout", type=int, default=900, help="seconds a compile may take")
  p.add_argument("--jobs", type=int, default=1, help="compiles at once (default 1)")
  p.add_argument("--json", type=Path, help="also write the results here")
  p.add_argument("--one", action="store_true",
                 help="compile once, in this process, with the flags in the environment "
                      "(LIBTPU_INIT_ARGS, XLA_FLAGS), and print its figures as JSON")
  args = p.parse_args()
  for key, value in PLATFORMS[args.platform].items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  if args.one:
    if args.platform == "tpu":  # a topology compiled from this host's CPU client
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(json.dumps(_compile(args)), flush=True)
    return 0
  base = _in_process("", args)
  if "error" in base:
    raise SystemExit(f"the baseline compile failed: {base['error']}")
  kinds = ", ".join(f"{k} {n}" for k, n in sorted(base["collectives"].items()))
  print(f"llama2-7b ({args.layers} layers), fsdp on {args.target} x{args.chips}, "
        f"{args.per_chip} x {args.seq_len} tokens a chip, {base['attention']} attention; "
        f"baseline: {kinds}; async {base['async']}, sync {base['sync']}"
        + (f", compute {base['cycles'] / 1e9:.3f} Gcycles" if base["cycles"] else "")
        + f", {base['bytes'] / 2**30:.2f} GiB per chip (planned "
        f"{base['planned_bytes'] / 2**30:.2f})", flush=True)
  together = " ".join(GPU_FLAGS)
  flags = ((CONTROL, *TPU_FLAGS) if args.platform == "tpu"
           else (*GPU_CONTROLS, *GPU_FLAGS, together))
  rows = []
  # Compiles in parallel only where cores are plenty (a GPU host): each is one process.
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for flag, r in zip(flags, pool.map(lambda f: _in_process(f, args), flags)):
      rows.append({"flag": flag, "changed": r.get("fingerprint", base["fingerprint"])
                   != base["fingerprint"], **r})
      print(_row("all of the above together" if flag == together else flag, r, base),
            flush=True)
  result = {"platform": args.platform, "target": args.target, "chips": args.chips,
            "baseline": base, "flags": rows}
  if args.json:
    args.json.write_text(json.dumps(result, indent=1))
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
