"""`shardlab inspect`: the sharding of every parameter (and activation) of a run, on any mesh,
without allocating it."""

import argparse
import json
import sys

import jax
import numpy as np

from shardlab.bounds import Int
from shardlab.cli.args import add_model_mesh_strategy, add_overrides, add_simulate_devices
from shardlab.cli.args import load_config, setup_devices
import shardlab.cli.plan_user as plan_user
from shardlab.errors import ConfigError
from shardlab.observe import progress, step_report
from shardlab.plan.module import factory as factory_lib
from shardlab.plan.training import layout as inspect_state
from shardlab.runtime import compile_only
from shardlab.training import combinations
from shardlab.training import run as run_lib


def inspect_parser(prog: str = "shardlab inspect") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, description="Show every parameter's logical axes, PartitionSpec and "
                             "per-device shape and bytes under a strategy and mesh.",
      epilog="Example: shardlab inspect --model 125m --mesh fsdp:4,tensor:2 --strategy "
             "fsdp_tp --activations")
  add_model_mesh_strategy(p, searched=False, factory=True)
  p.add_argument("--devices", type=Int(min=1), metavar="N",
                 help="device count for a mesh with a -1 axis (%(type)s; default: this "
                      "machine's, 8 simulated on CPU)")
  p.add_argument("--activations", action="store_true", help="also show the activation specs")
  p.add_argument("--collectives", action="store_true",
                 help="also compile the train step on this machine's devices (abstract "
                      "inputs, nothing allocated) and list its collectives and XLA memory")
  add_simulate_devices(p)
  p.add_argument("--json", action="store_true", help="print JSON instead of tables")
  add_overrides(p, "train.optimizer=adafactor, train.global_batch=64")
  return p


def build(model: str, mesh: str, strategy: str, overrides: list[str],
          devices: int | None = None):
  """(cfg, abstract, shardings) on an abstract mesh: no device memory is used."""
  cfg = load_config(model, mesh, strategy, overrides)
  p = run_lib.place(cfg, abstract=True, n_devices=devices)
  combinations.check(cfg, p.spec.shape)  # what a run refuses at setup (warnings: the layout's)
  return cfg, p.abstract, p.shardings


def compiled_collectives(cfg, sh) -> tuple[list[str], object]:
  """(report lines, StepReport): the train step compiled over this machine's first devices
  in the shape of `sh`'s mesh."""
  n = int(np.prod(list(sh.mesh.shape.values())))
  if n > jax.device_count():
    raise ConfigError(f"--collectives compiles on this machine's devices: mesh {cfg.mesh!r} "
                      f"needs {n}, there are {jax.device_count()} (pass --simulate-devices {n})")
  p = run_lib.place(cfg, jax.devices()[:n])
  train_step = run_lib.make_steps(cfg, p.abstract, p.shardings)[0]
  args = run_lib.abstract_inputs(p.abstract, p.shardings, cfg)
  with progress.Activity("compiling the train step"):
    compiled = compile_only.compile_lowered(train_step.lower(*args))
  report = step_report.report(compiled, p.mesh)
  return step_report.render(report, f"compiled train step on {n} {jax.devices()[0].platform} "
                                    f"device(s), per device"), report


def inspect_main(argv=None, prog: str = "shardlab inspect") -> int:
  args = inspect_parser(prog).parse_args(argv)
  try:
    setup_devices(args.simulate_devices)
    if factory_lib.is_factory(args.model):  # the user's own module: its state's table
      return _user_module(args)
    cfg, abstract, sh = build(args.model, args.mesh, args.strategy, args.overrides,
                              args.devices)
    lay = inspect_state.layout(cfg, abstract, sh)
    lines, report = compiled_collectives(cfg, sh) if args.collectives else ([], None)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    out = {k: [r.as_dict() for r in getattr(lay, k)] for k in ("params", "opt_state", "step")}
    if args.activations:
      out["activations"] = [r.as_dict() for r in lay.activations]
    out.update(bytes_per_device=lay.bytes_per_device(), warnings=lay.warnings)
    if report is not None:
      out["compiled"] = report.as_dict()
    print(json.dumps(out, indent=2))
  else:
    print(inspect_state.render(cfg, lay, sh, args.activations))
    if lines:
      print("\n" + "\n".join(lines))
  return 0


def _user_module(args) -> int:
  lay, sh = plan_user.inspect_layout(args)
  if args.json:
    out = {k: [r.as_dict() for r in getattr(lay, k)] for k in ("params", "opt_state", "step")}
    print(json.dumps(out | {"bytes_per_device": lay.bytes_per_device(),
                            "warnings": lay.warnings}, indent=2))
  else:
    print(inspect_state.render_state(lay, sh, args.model))
  return 0
