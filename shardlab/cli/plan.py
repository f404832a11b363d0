"""`shardlab plan`: the planner's command line, table and JSON output."""

import argparse
import dataclasses
import json
import sys

from shardlab import config as config_lib
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.plan import auto as plan_auto
from shardlab.plan import auto_layout
from shardlab.plan import compile as plan_compile, experts as plan_experts
from shardlab.plan import pipeline as plan_pipeline
from shardlab.plan import longest_context, planner as plan_lib
from shardlab.plan import plot as plan_plot
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib

GiB = 2**30


def plan_parser(prog: str = "shardlab plan") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, description="Per-device memory, fit, device count, communication and the "
                             "best mesh for training a model — by formula, and by compiling "
                             "the real train step.",
      epilog="Example: shardlab plan --model llama2-70b --target a100-80g --devices 64 "
             "--search --compile")
  p.add_argument("--model", default="llama2-7b", help="preset name (models/presets/) or TOML")
  p.add_argument("--optimizer", default="adamw", help="adamw | adafactor | sgd")
  p.add_argument("--precision", default="bf16", help="fp32 | bf16 | bf16-params")
  p.add_argument("--grad-dtype", default="auto",
                 help="auto (the stored params': fp32 under bf16) | fp32 | bf16")
  p.add_argument("--global-batch", type=int, default=256, help="sequences per step")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--remat", default="full", help="none | full | save-matmul-outputs | offload")
  p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps")
  p.add_argument("--strategy", default="fsdp", help=" | ".join(plan_lib.STRATEGIES))
  p.add_argument("--mesh", help="preset (meshes/), TOML file, or inline 'data:2,fsdp:-1'")
  p.add_argument("--devices", type=int, help="device count (sizes a -1 mesh axis, or picks "
                                              "the strategy's usual mesh)")
  p.add_argument("--target", help=f"{' | '.join(hardware.names())} (default: the mesh "
                                  f"preset's accelerator, else h100-80g)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="rules overrides (rules.activations.length=context), optimizer-state "
                      "offload (train.offload=opt_state) or LoRA (lora.rank=16, lora.alpha, "
                      "lora.targets=q,k,v,o,gate,up,down)")
  p.add_argument("--search", action="store_true",
                 help="rank every data × fsdp × tensor factorisation and strategy that fits")
  p.add_argument("--top", type=int, default=10, help="rows of --search to print")
  p.add_argument("--plot", metavar="FILE.png",
                 help="draw each strategy's per-device memory on this device count (and, "
                      "with --search, the candidates' step time against memory)")
  p.add_argument("--compile", action="store_true",
                 help="compile the real train step with abstract inputs, allocating nothing "
                      "(simulated CPU devices, or the TPU topology; see --compile-on)")
  p.add_argument("--compile-on", default="auto", choices=("auto", "cpu", "tpu", "both"),
                 help="where --compile compiles: auto = the TPU topology for a TPU target "
                      "when libtpu is installed, else simulated CPU devices")
  p.add_argument("--compile-top", type=int, default=4, metavar="K",
                 help="with --search --compile: compile candidates in the search's order "
                      "until K fit, and pick by the compiled programs (default 4)")
  p.add_argument("--compile-budget-s", type=float, default=600.0, metavar="S",
                 help="with --search --compile: start no compile after S seconds")
  p.add_argument("--longest-context", action="store_true",
                 help="the longest --seq-len that fits on --devices, per context-parallel "
                      "degree (fsdp or fsdp_tp_sp layouts), instead of the plan")
  p.add_argument("--attention", choices=("xla", "flash", "auto"),
                 help="the model's attention implementation (default: the model's)")
  p.add_argument("--kv-exchange", choices=("all-gather", "ring"),
                 help="context parallelism's KV exchange (default: the model's)")
  p.add_argument("--json", action="store_true", help="print JSON instead of tables")
  p.add_argument("--inference", action="store_true",
                 help="plan serving instead (shardlab plan --inference --help)")
  return p


PLAN_OVERRIDES = ("rules.", "train.offload=", "lora.", "train.pipeline_repeats=")


def request_from_args(args):
  for item in args.overrides:
    if not item.startswith(PLAN_OVERRIDES):
      raise ConfigError(f"--set here takes {', '.join(PLAN_OVERRIDES)}..., got {item!r}")
  cfg = config_lib.apply_overrides(config_lib.Config(model=None), args.overrides)
  target = args.target
  if target is None:
    acc = mesh_lib.load(args.mesh).accelerator if args.mesh else None
    target = acc if acc in hardware.ACCELERATORS else "h100-80g"
  return plan_lib.Request(
      model=args.model, optimizer=args.optimizer, precision=args.precision,
      grad_dtype=args.grad_dtype, global_batch=args.global_batch, seq_len=args.seq_len, remat=args.remat,
      microbatches=args.microbatches, strategy=args.strategy, mesh=args.mesh,
      devices=args.devices, target=target, rules=cfg.rules, offload=cfg.train.offload,
      lora=cfg.lora, pipeline_repeats=cfg.train.pipeline_repeats)


def plan_main(argv=None, prog: str = "shardlab plan") -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--inference" in argv:
    from shardlab.cli.plan_inference import main as inference_main
    return inference_main([a for a in argv if a != "--inference"], prog=f"{prog} --inference")
  args = plan_parser(prog).parse_args(argv)
  try:
    req = request_from_args(args)
    # The planner never runs on an accelerator: CPU (simulated devices for --compile) and
    # compile-only TPU topologies. Chosen before any JAX backend starts.
    where = plan_compile.where(req, args.compile_on) if args.compile else ()
    if "cpu" in where:
      plan_compile.prepare_cpu_devices(req)
    else:
      plan_compile.cpu_only()
    if args.longest_context:
      return _longest_context(req, args)
    result = plan_lib.plan(req, search_meshes=args.search)
    choice = None
    if args.compile and args.search:  # the top K, by their compiled programs
      choice = auto_layout.for_request(
          req, result.estimate.n_devices, "tpu" if "tpu" in where else "cpu",
          args.compile_top, args.compile_budget_s, say=_stderr)
    elif args.compile:
      result = plan_compile.attach(result, where)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.plot:
    plan_plot.write(result, args.plot)
    print(f"wrote {args.plot}", file=sys.stderr)
  if args.json:
    out = to_json(result, args.top)
    print(json.dumps(out if choice is None else {**out, "compiled_search": choice.as_dict()},
                     indent=2))
  else:
    print(render(result, args.top) +
          ("" if choice is None else "\n\n" + "\n".join(plan_auto.render(choice))))
  return 0


def _longest_context(req, args) -> int:
  if req.devices is None:
    raise ConfigError("--longest-context needs --devices N")
  model = registry.load(req.model)
  changes = {k: v for k, v in (("attention", args.attention),
                               ("kv_exchange", args.kv_exchange)) if v}
  model = dataclasses.replace(model, **changes) if changes else model
  acc = hardware.get(req.target)
  rows = longest_context.longest(req, model, acc, req.devices)
  if args.json:
    print(json.dumps([{"context": r.context, "seq_len": r.seq_len,
                       "strategy": r.best and r.best.strategy, "mesh": r.best and r.best.mesh,
                       "bytes_per_device": r.best and r.best.memory.total,
                       "tokens_per_s": r.best and r.best.tokens_per_s} for r in rows],
                     indent=2))
  else:
    print("\n".join(longest_context.render(rows, model, acc, req.devices, req.global_batch)))
  return 0


def _stderr(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def to_json(result, top: int) -> dict:
  e = result.estimate
  return {
      "request": dataclasses.asdict(result.request),
      "model": {"name": result.model.name, "params": result.model.n_params},
      "target": dataclasses.asdict(result.target),
      "estimate": _estimate_json(e),
      "min_devices": result.min_devices,
      "warnings": list(result.warnings),
      # each strategy on this device count with its usual mesh (what --plot draws)
      "strategies": {s: ({"error": e} if isinstance(e, str) else _estimate_json(e))
                     for s, e in result.strategies.items()},
      "thresholds": result.thresholds,
      "search": None if result.search is None else [_estimate_json(x) for x in
                                                    result.search[:top]],
      "search_fitting": None if result.search is None else len(result.search),
      "compiled": result.compiled,
  }


def _estimate_json(e) -> dict:
  d = {k: v for k, v in dataclasses.asdict(e).items() if k != "memory"}
  d.update(memory=e.memory.as_dict(), fits=e.fits, headroom=e.headroom)
  return d


def _gib(x: float) -> str:
  return f"{x / GiB:9.2f} GiB"


def render(result, top: int) -> str:
  lines = (_header(result) + [f"warning: {w}" for w in result.warnings] +
           ([""] if result.warnings else []) + _memory_lines(result) + _min_device_lines(result) +
           _time_lines(result) + _scaling_lines(result) + _search_lines(result, top))
  if result.compiled:
    lines += ["", *plan_compile.render(result.compiled)]
  return "\n".join(lines)


def _header(result) -> list[str]:
  e, m, r, acc = result.estimate, result.model, result.request, result.target
  return [
      f"model     {m.name}: {m.n_params / 1e9:.2f}B params   optimizer {r.optimizer}   "
      f"precision {r.precision}   remat {r.remat}   offload {r.offload}" +
      (f"   LoRA rank {r.lora.rank} on {r.lora.targets} "
       f"({m.n_lora_params(r.lora) / 1e6:.1f}M trained)" if r.lora.rank else ""),
      f"batch     {r.global_batch} × {r.seq_len} tokens, {r.microbatches} microbatch(es)",
      f"target    {acc.name}: {acc.peak_flops / 1e12:.0f} TFLOP/s bf16, "
      f"{acc.hbm_bytes / 2**30:.1f} GiB HBM ({acc.usable_bytes / 2**30:.2f} usable), "
      f"{acc.hbm_bw / 1e12:.2f} TB/s",
      f"mesh      {e.mesh} ({e.n_devices} devices), strategy {e.strategy}", ""]


def _memory_lines(result) -> list[str]:
  e, mem = result.estimate, result.estimate.memory
  lines = ["memory per device (analytic)"]
  for key, label, value in (
      ("params", "params", mem.params), ("grads", "gradients", mem.grads),
      ("opt_state", "optimizer state", mem.opt_state),
      ("master", "master weights", mem.master), (None, "activations", mem.activations),
      (None, "gathered weights", mem.gathered), (None, "token batch", mem.batch)):
    how = e.accounting.get(key)
    note = "" if how is None else (
        f"   {how['bytes_per_param']:g} B/param, " +
        ("whole on every device" if how["divided_by"] <= 1 else f"÷ {how['divided_by']:g}"))
    lines.append(f"  {label:18s}{_gib(value)}{note}")
  verdict = "fits" if e.fits else "DOES NOT FIT"
  lines.append(f"  {'total':18s}{_gib(mem.total)}   {verdict}, headroom "
               f"{e.headroom / GiB:.2f} GiB of {e.usable_bytes / GiB:.2f} GiB usable")
  if mem.host:
    lines.append(f"  {'host memory':18s}{_gib(mem.host)}   offloaded (not in the total); "
                 f"{e.host_transfer_bytes / GiB:.2f} GiB host↔device per step")
  return lines + [""] + plan_experts.lines(plan_experts.for_plan(result))


def _min_device_lines(result) -> list[str]:
  mins, m = result.min_devices, result.request.microbatches
  overall, any_m = mins["overall"], mins["any_microbatches"]
  lines = [f"minimum devices   {overall['devices']} at {m} microbatch(es) "
           f"({overall['strategy']}: {overall['mesh']})"]
  if any_m and (any_m["devices"], any_m["microbatches"]) != (overall["devices"], m):
    lines.append(f"                  {any_m['devices']} at any microbatch count: "
                 f"--microbatches {any_m['microbatches']} ({any_m['strategy']}: "
                 f"{any_m['mesh']}, {any_m['step_s']:.1f} s per step)")
  return lines + ["  " + "   ".join(f"{s} {v['devices'] if v else '-'}"
                                    for s, v in mins.items() if s in plan_lib.STRATEGIES),
                  "  " + plan_pipeline.MIN_DEVICES_NOTE]


def _time_lines(result) -> list[str]:
  e, acc = result.estimate, result.target
  lines = ["", "communication per device per step"]
  lines += [f"  {kind:18s}{_gib(b)}" for kind, b in e.collectives.items()]
  return lines + [
      "", "predicted step time (roofline; compute at an achievable fraction of peak)",
      f"  compute {e.compute_s * 1e3:10.1f} ms   ({e.flops_per_device / 1e12:.1f} TFLOP per "
      f"device incl. remat, at {e.efficiency:.0%} of peak)",
      f"  memory  {e.memory_s * 1e3:10.1f} ms   (HBM traffic)",
      f"  comm    {e.comm_s * 1e3:10.1f} ms   (ICI {acc.ici_bw / 1e9:.0f} GB/s, DCN "
      f"{acc.dcn_bw / 1e9:.1f} GB/s per device)",
      *([f"  host    {e.host_s * 1e3:10.1f} ms   (offload traffic at "
         f"{acc.host_bw / 1e9:.0f} GB/s each way)"] if e.host_transfer_bytes else []),
      f"  step    {e.step_s * 1e3:10.1f} ms   bound by {e.binding}; "
      f"{e.tokens_per_s:,.0f} tokens/s" + (f"; pipeline {e.pipeline.schedule}, bubble "
                                             f"{e.pipeline.bubble:.1%}" if e.pipeline else ""),
      f"  MFU     {e.mfu:10.1%} predicted (assumes {e.efficiency:.0%} of peak on {acc.name}: "
      f"{acc.efficiency_source}); roofline ceiling {e.mfu_ceiling:.1%}", ""]


def _scaling_lines(result) -> list[str]:
  e, r, t, acc = result.estimate, result.request, result.thresholds, result.target
  tokens_now = r.global_batch * r.seq_len / max(1, e.mesh_shape.get("data", 1) *
                                                e.mesh_shape.get("fsdp", 1))
  return [
      f"scaling on {acc.name}: data/FSDP parallelism stays compute-bound from "
      f"{t['fsdp_tokens_per_device_ici']:,.0f} tokens per device (FSDP over ICI; "
      f"{t['fsdp_tokens_per_device_dcn']:,.0f} over DCN; plain DP "
      f"{t['dp_tokens_per_device_ici']:,.0f} / {t['dp_tokens_per_device_dcn']:,.0f}); "
      f"tensor parallelism up to about {t['tp_max_degree_ici']:.0f}-way within ICI",
      f"  this mesh: {tokens_now:,.0f} tokens per device per step"]


def _search_lines(result, top: int) -> list[str]:
  if result.search is None:
    return []
  n = result.estimate.n_devices
  lines = ["", f"search: {len(result.search)} fitting (mesh, strategy) on {n} devices, "
               f"fastest first (one row per placement; no idle axes)",
           f"  {'strategy':8s} {'mesh':34s} {'memory':>9s} {'step':>10s} {'MFU':>6s} "
           f"{'ceiling':>7s}  bound"]
  if not result.search:
    lines.append(f"  nothing fits on {n} devices: use more devices (see minimum devices "
                 f"above), --microbatches, --remat full or a shorter sequence")
  for x in result.search[:top]:
    lines.append(f"  {x.strategy:8s} {x.mesh:34s} {x.memory.total / GiB:6.2f}GiB "
                 f"{x.step_s * 1e3:8.1f}ms {x.mfu:6.1%} {x.mfu_ceiling:7.1%}  {x.binding}")
  return lines + plan_pipeline.versus(result.search)
