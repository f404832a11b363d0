"""`shardlab plan --model file.py:NAME` and `shardlab inspect --model file.py:NAME`: a user's
own module (plan.module.factory) through `sl.plan_module`, `sl.auto_layout` and the
parameter table, on simulated CPU devices; nothing is allocated."""

import dataclasses
import json
import sys

import jax

from shardlab import config as config_lib
from shardlab.errors import ConfigError
from shardlab.plan.auto import module as auto_module
from shardlab.plan.module import factory as factory_lib
from shardlab.plan.module.planner import plan_module
from shardlab.plan.training import layout as layout_lib
from shardlab.runtime import devices as devices_lib
from shardlab.runtime import hardware, jax_compat
from shardlab.runtime.units import size
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.training import optim
from shardlab.training import precision as precision_lib
from shardlab.training import state as state_lib

DEFAULT_DEVICES = 8
# Flags of the bundled models' formula that a module of the user's has no use for.
UNUSED = {"seq_len": "the batch's shapes come from --batch-fn",
          "remat": "the module's own nnx.remat / jax.checkpoint applies",
          "overrides": "--set applies to the bundled models", "plot": "--plot draws the formula's "
          "strategies", "compile_on": "a module factory compiles on simulated CPU devices"}


def train_config(args, base: config_lib.TrainConfig) -> config_lib.TrainConfig:
  """The flags as TrainConfig's fields (validated there, as `train.optimizer` etc.)."""
  values = {f"train.{k}": getattr(args, k) for k in (
      "optimizer", "precision", "grad_dtype", "global_batch", "microbatches")
      if hasattr(args, k)}
  cfg = config_lib.Config(model=None, train=base)
  return config_lib.set_values(cfg, values).train


def _refuse_unused(args, parser) -> None:
  for dest, why in UNUSED.items():
    if hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest):
      raise ConfigError(f"--{dest.replace('_', '-')} does not apply to a module factory "
                        f"--model {args.model!r}: {why}")


def devices_for(n: int) -> list:
  """n CPU devices: simulated now if no JAX backend has started, else this process's."""
  if not jax_compat.backends_are_initialized():
    devices_lib.simulate(n)
  found = jax.devices()
  if len(found) < n:
    raise ConfigError(f"a module factory is planned on this process's devices: {n} "
                      f"needed, there are {len(found)}")
  return found[:n]


def _mesh_spec(args, strategy: str) -> mesh_lib.MeshSpec:
  n = args.devices
  if args.mesh:
    spec = mesh_lib.load(args.mesh)
    return spec.resolve(n if n is not None else spec.n_devices
                        if all(s > 0 for s in spec.shape.values()) else DEFAULT_DEVICES)
  n = n or DEFAULT_DEVICES
  shape = {"dp": "data", "zero1": "data", "zero2": "data", "fsdp": "fsdp"}.get(strategy)
  if shape is None:
    raise ConfigError(f"strategy {strategy!r} with a module factory needs --mesh (e.g. "
                      f"data:1,fsdp:{max(1, n // 2)},tensor:2), or --search")
  return mesh_lib.load(f"{shape}:{n}")


def plan_main(args, parser) -> int:
  """`shardlab plan train` for a module factory."""
  from shardlab.plan.training import planner as plan_lib
  _refuse_unused(args, parser)
  user = factory_lib.load(args.model, args.loss_fn, args.batch_fn)
  train = train_config(args, plan_lib.PLANNER_TRAIN)
  acc = hardware.get(args.target or "h100-80g")
  opt = optim.make(train)
  batch_of = lambda: user.batch(train.global_batch)
  if args.search:
    if args.mesh:
      raise ConfigError(f"--search of a module factory searches the meshes of --devices N "
                        f"(default {DEFAULT_DEVICES}); leave out --mesh {args.mesh!r}")
    devices = devices_for(args.devices or DEFAULT_DEVICES)
    strategies = ((args.strategy,) if "strategy" in (getattr(args, "given", None) or ())
                  else auto_module.STRATEGIES)
    choice = auto_module.auto_layout_module(
        user.factory, acc, devices, optimizer=opt, precision=train.precision,
        batch=batch_of(), loss_fn=user.loss_fn, strategies=strategies,
        top_k=args.compile_top, microbatches=train.microbatches, say=_stderr)
    if args.json:
      print(json.dumps({"strategy": choice.strategy, "mesh": choice.mesh, "candidates": [
          {"strategy": c.strategy, "mesh": c.mesh, "verdict": c.verdict,
           "estimate_bytes": c.plan and c.plan.total,
           "compiled_bytes": c.report and c.report.total_bytes, "score_s": c.score_s}
          for c in choice.candidates]}, indent=2))
    else:
      print(choice.render())
    return 0
  spec = _mesh_spec(args, args.strategy)
  mesh = mesh_lib.build(spec, devices_for(spec.n_devices))
  plan = plan_module(user.factory, opt, train.precision, args.strategy, mesh,
                     batch=batch_of(), loss_fn=user.loss_fn,
                     microbatches=train.microbatches, grad_dtype=train.grad_dtype,
                     compiled=args.compile)
  fits = plan.total <= acc.usable_bytes
  if args.json:
    out = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
           if f.name not in ("residuals", "compiled")}
    out.update(model=args.model, total=plan.total, arguments=plan.arguments,
               target=acc.name, usable_bytes=acc.usable_bytes, fits=fits,
               compiled=plan.compiled and plan.compiled.as_dict())
    print(json.dumps(out, indent=2))
  else:
    print(f"model     {args.model} (a module factory; sl.plan_module, "
          f"docs/plan-any-module.md)\n" + plan.render() +
          f"\n{'fits' if fits else 'DOES NOT FIT'} on {acc.name}: {size(plan.total)} of "
          f"{size(acc.usable_bytes)} usable per device")
  return 0


def inspect_layout(args):
  """(layout, shardings) of a module factory's params and optimizer state on an abstract
  mesh of any size (nothing is allocated or compiled)."""
  for flag in ("activations", "collectives"):
    if getattr(args, flag):
      raise ConfigError(f"--{flag} applies to the bundled models; with a module factory "
                        f"--model {args.model!r}, `shardlab plan --model {args.model} "
                        f"--compile` compiles its step")
  cfg = config_lib.apply_overrides(
      config_lib.Config(model=None, mesh=args.mesh, strategy=args.strategy), args.overrides)
  user = factory_lib.load(args.model, None, None)
  abstract = state_lib.abstract_state(user.factory, optim.make(cfg.train),
                                      precision_lib.resolve(cfg.train.precision))
  spec = mesh_lib.load(cfg.mesh)
  spec = spec.resolve(args.devices if args.devices is not None else
                      spec.n_devices if all(s > 0 for s in spec.shape.values()) else
                      jax.device_count())
  mesh = jax.sharding.AbstractMesh(tuple(spec.shape.values()), tuple(spec.shape))
  sh = state_lib.shardings(abstract, rules_lib.strategy(cfg.strategy, cfg.rules), mesh)
  return layout_lib.state_layout(abstract, sh), sh


def _stderr(text: str) -> None:
  print(text, file=sys.stderr, flush=True)
