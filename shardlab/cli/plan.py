"""`shardlab plan`: one subcommand per question — `train` (memory, fit, devices and mesh for
a training run; the default), `serve` (the same for serving a model) and `longest-context`
(the longest sequence that fits)."""

import argparse
import dataclasses
import json
import sys

from shardlab import config as config_lib
from shardlab import remat as remat_lib
import shardlab.cli.plan_user as plan_user
from shardlab.bounds import Int
from shardlab.cli.args import DefaultsHelp, Given, given, run_command
from shardlab.cli.plan_fewest import fewest_devices
from shardlab.cli.plan_fewest import inline_mesh  # noqa: F401 (callers read it here too)
from shardlab.cli.plan_render import fewest_line, render, to_json
from shardlab.errors import ConfigError
from shardlab.plan.auto import choice as plan_auto
from shardlab.plan.auto import layout as auto_layout
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.module import factory as factory_lib
from shardlab.plan.training import longest_context
from shardlab.plan.training import planner as plan_lib
from shardlab.plan.training import plot as plan_plot
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.training import combinations

# The mode flags that became subcommands: refused with the command to use instead.
OLD_FLAGS = {"--inference": "serve", "--longest-context": "longest-context"}
HELP = DefaultsHelp
FEWEST = "unset (with no --mesh): the fewest devices of --target that fit"


def _add_request(p: argparse.ArgumentParser, devices_help: str = FEWEST,
                 factory: bool = False) -> None:
  """The training request's options; defaults are the planner's run (PLANNER_TRAIN).
  `factory`: --model also takes a user's module factory (plan train)."""
  t = plan_lib.PLANNER_TRAIN
  p.add_argument("--model", default="llama2-7b",
                 help="preset name (models/presets/) or TOML" + (
                     "; or your own module's factory, path/to/file.py:NAME or "
                     "package.module:NAME (see --loss-fn, --batch-fn)" if factory else ""))
  p.add_argument("--optimizer", default=t.optimizer, help="adamw | adafactor | sgd")
  p.add_argument("--precision", default=t.precision, help="fp32 | bf16 | bf16-params")
  p.add_argument("--grad-dtype", default=t.grad_dtype,
                 help="auto (the stored params': fp32 under bf16) | fp32 | bf16")
  p.add_argument("--global-batch", type=config_lib.BOUNDS["train.global_batch"],
                 default=t.global_batch, help="sequences per step; %(type)s")
  p.add_argument("--seq-len", type=config_lib.BOUNDS["train.seq_len"], default=t.seq_len,
                 help="tokens per sequence; %(type)s")
  p.add_argument("--remat", default=t.remat,
                 help=" | ".join(remat_lib.POLICIES) + " | custom:NAME=WHERE,... (docs/remat.md)")
  p.add_argument("--microbatches", type=config_lib.BOUNDS["train.microbatches"],
                 default=t.microbatches, help="gradient accumulation steps; %(type)s")
  p.add_argument("--strategy", default="fsdp", action=Given,
                 help=" | ".join(plan_lib.STRATEGIES) + "; with neither --devices nor --mesh, "
                      "unset means any: the one that fits on the fewest devices")
  p.add_argument("--mesh", help="preset (meshes/), TOML file, or inline 'data:2,fsdp:-1'")
  p.add_argument("--devices", type=Int(min=1),
                 help=f"device count (%(type)s; sizes a -1 mesh axis, or picks the strategy's "
                      f"usual mesh); {devices_help}")
  p.add_argument("--target", help=f"{' | '.join(hardware.names())} (unset: the mesh preset's "
                                  f"accelerator, else h100-80g)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="rules overrides (rules.activations.length=context), optimizer-state "
                      "offload (train.offload=opt_state) or LoRA (lora.rank=16, lora.alpha, "
                      "lora.targets=q,k,v,o,gate,up,down)")
  p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def train_parser(prog: str = "shardlab plan train") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, formatter_class=HELP,
      description="Per-device memory, fit, device count, communication and the best mesh for "
                  "training a model — by formula, and by compiling the real train step. "
                  "`shardlab plan --model ...` with no subcommand means this one.",
      epilog="Example: shardlab plan train --model llama2-70b --target a100-80g --devices 64 "
             "--search --compile")
  _add_request(p, factory=True)
  p.add_argument("--search", action="store_true",
                 help="rank every data × fsdp × tensor factorisation and strategy that fits")
  p.add_argument("--top", type=Int(min=1), default=10,
                 help="rows of --search to print; %(type)s")
  p.add_argument("--plot", metavar="FILE.png",
                 help="draw each strategy's per-device memory on this device count (and, "
                      "with --search, the candidates' step time against memory)")
  p.add_argument("--compile", action="store_true",
                 help="compile the real train step with abstract inputs, allocating nothing "
                      "(simulated CPU devices, or the TPU topology; see --compile-on)")
  p.add_argument("--compile-on", default="auto", choices=("auto", "cpu", "tpu", "both", "gpu"),
                 help="where --compile compiles: auto = the TPU topology for a TPU target "
                      "when libtpu is installed, else simulated CPU devices; gpu = this "
                      "machine's GPU compiling for the plan's GPU count (mocked; one node's "
                      "mesh)")
  p.add_argument("--compile-top", type=plan_auto.TOP_K, default=2, metavar="K",
                 help="with --search --compile (%(type)s): compile candidates in the search's "
                      "order until K fit, and pick by the compiled programs (a module factory: "
                      "compile its K best by estimate)")
  p.add_argument("--loss-fn", default=factory_lib.DEFAULT_LOSS, metavar="NAME",
                 help="with a module factory --model: loss_fn(model, batch), a name in its "
                      "file or module:function")
  p.add_argument("--batch-fn", default=factory_lib.DEFAULT_BATCH, metavar="NAME",
                 help="with a module factory --model: NAME(size), the batch's arrays or "
                      "jax.ShapeDtypeStructs for --global-batch sequences, a name in its file "
                      "or module:function")
  p.add_argument("--compile-budget-s", type=plan_auto.BUDGET_S, default=600.0, metavar="S",
                 help="with --search --compile: start no compile after S seconds; %(type)s")
  return p


def longest_context_parser(prog: str = "shardlab plan longest-context"):
  p = argparse.ArgumentParser(
      prog=prog, formatter_class=HELP,
      description="The longest --seq-len that fits on --devices, per context-parallel degree "
                  "(fsdp or fsdp_tp_sp layouts), with its fastest layout.",
      epilog="Example: shardlab plan longest-context --model llama3-70b --target tpu-v5p "
             "--devices 64 --global-batch 8")
  _add_request(p, devices_help="required here")
  p.add_argument("--attention", choices=("xla", "flash", "auto"),
                 help="the model's attention implementation (unset: the model's own)")
  p.add_argument("--kv-exchange", choices=("all-gather", "ring"),
                 help="context parallelism's KV exchange (unset: the model's own)")
  return p


def overview_parser(prog: str = "shardlab plan") -> argparse.ArgumentParser:
  """Only for `shardlab plan --help`: the subcommands, each with its own --help."""
  p = argparse.ArgumentParser(
      prog=prog, description="Plan before renting hardware; nothing is allocated. With no "
                             "subcommand, `shardlab plan --model ...` means `shardlab plan "
                             "train --model ...`.",
      epilog="Example: shardlab plan train --model llama2-70b --target a100-80g --devices 64")
  sub = p.add_subparsers(title="subcommands", metavar="{train,serve,longest-context}")
  sub.add_parser("train", help="memory, fit, devices, communication and the best mesh for "
                               "training (the default; --search, --compile, --plot)")
  sub.add_parser("serve", help="memory, fit, fewest devices and prefill/decode speeds for "
                               "serving")
  sub.add_parser("longest-context", help="the longest sequence that fits, per "
                                         "context-parallel degree")
  return p


PLAN_OVERRIDES = ("rules.", "train.offload=", "lora.", "train.pipeline_repeats=")


def request_from_args(args) -> plan_lib.Request:
  """The request as a run Config would hold it: the flags set TrainConfig's fields (checked
  there, as `train.remat` etc.), `--set` the rules, offload and LoRA."""
  for item in args.overrides:
    if not item.startswith(PLAN_OVERRIDES):
      raise ConfigError(f"--set here takes {', '.join(PLAN_OVERRIDES)}..., got {item!r}")
  cfg = config_lib.Config(model=None, strategy=args.strategy, train=plan_lib.PLANNER_TRAIN)
  cfg = config_lib.set_values(cfg, {
      "train.optimizer": args.optimizer, "train.precision": args.precision,
      "train.grad_dtype": args.grad_dtype, "train.global_batch": args.global_batch,
      "train.seq_len": args.seq_len, "train.remat": args.remat,
      "train.microbatches": args.microbatches})
  cfg = config_lib.apply_overrides(cfg, args.overrides)
  target = args.target
  if target is None:
    acc = mesh_lib.load(args.mesh).accelerator if args.mesh else None
    target = acc if acc in hardware.ACCELERATORS else "h100-80g"
  return dataclasses.replace(
      plan_lib.Request.from_config(cfg, target=target, devices=args.devices, mesh=args.mesh),
      model=args.model)


def plan_main(argv=None, prog: str = "shardlab plan") -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  for flag, sub in OLD_FLAGS.items():
    if flag in argv:
      print(f"error: {flag} is now a subcommand: {prog} {sub} ... (see {prog} {sub} --help)",
            file=sys.stderr)
      return 2
  if argv and argv[0] in ("-h", "--help"):
    overview_parser(prog).print_help()
    return 0
  if argv and argv[0] == "serve":
    from shardlab.cli.plan_serve import main as serve_main
    return serve_main(argv[1:], prog=f"{prog} serve")
  if argv and argv[0] == "longest-context":
    return _run(longest_context_parser(f"{prog} longest-context").parse_args(argv[1:]),
                _longest_context)
  if argv and argv[0] == "train":
    argv, prog = argv[1:], f"{prog} train"
  parser = train_parser(prog)
  args = parser.parse_args(argv)
  if factory_lib.is_factory(args.model):  # the user's own module: sl.plan_module
    return run_command(lambda a: plan_user.plan_main(a, parser), args)
  return _run(args, _train)


def _run(args, command) -> int:
  try:
    req = request_from_args(args)
    return command(req, args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _check_combinations(req: plan_lib.Request) -> None:
  """What a run of this request would refuse at setup (training/combinations.py)."""
  if req.mesh is None:
    return
  spec = mesh_lib.load(req.mesh)
  try:
    spec = spec.resolve(req.devices) if req.devices else spec
  except ConfigError:
    pass  # the planner says how the mesh and --devices disagree
  cfg = config_lib.Config(model=req.model_config(), mesh=req.mesh, strategy=req.strategy,
                          train=req.train, lora=req.lora, rules=req.rules)
  combinations.check(cfg, spec.shape)


def _train(req: plan_lib.Request, args) -> int:
  fewest = None
  if req.devices is None and req.mesh is None:
    req, fewest = fewest_devices(req, any_strategy=not given(args, "strategy"))
  _check_combinations(req)
  # The planner never runs on an accelerator: CPU (simulated devices for --compile) and
  # compile-only TPU topologies; --compile-on gpu starts the GPU client in a subprocess.
  # Chosen before any JAX backend starts.
  where = plan_compile.where(req, args.compile_on) if args.compile else ()
  if args.search and "gpu" in where:
    raise ConfigError("--search --compile compiles candidates on CPU or a TPU topology; "
                      "--compile-on gpu compiles one plan (drop --search, or pick its mesh "
                      "with --mesh)")
  if "cpu" in where:
    plan_compile.prepare_cpu_devices(req)
  else:
    plan_compile.cpu_only()
  result = plan_lib.plan(req, search_meshes=args.search)
  choice = None
  if args.compile and args.search:  # the top K, by their compiled programs
    choice = auto_layout.for_request(
        req, result.estimate.n_devices, "tpu" if "tpu" in where else "cpu",
        args.compile_top, args.compile_budget_s, say=_stderr, found=result.search)
  elif args.compile:
    result = plan_compile.attach(result, where)
  if args.plot:
    plan_plot.write(result, args.plot)
    print(f"wrote {args.plot}", file=sys.stderr)
  if args.json:
    out = to_json(result, args.top) | ({"fewest_devices": fewest} if fewest else {})
    print(json.dumps(out if choice is None else {**out, "compiled_search": choice.as_dict()},
                     indent=2))
  else:
    print(("" if fewest is None else fewest_line(fewest, result) + "\n\n") +
          render(result, args.top) +
          ("" if choice is None else "\n\n" + "\n".join(plan_auto.render(choice))))
  return 0


def _longest_context(req: plan_lib.Request, args) -> int:
  if req.devices is None:
    raise ConfigError("longest-context needs --devices N")
  plan_compile.cpu_only()
  model = req.model_config()
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
    print("\n".join(longest_context.render(rows, model, acc, req.devices,
                                           req.train.global_batch)))
  return 0


def _stderr(text: str) -> None:
  print(text, file=sys.stderr, flush=True)
