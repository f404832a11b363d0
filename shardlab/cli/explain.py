"""`shardlab explain`: every collective of the compiled train step, why it is there (source
line, pass, loop, what it moves, the rule behind it, planned or not), and with --against
what another strategy or rule override changes. See docs/explain.md."""

import argparse
import json
import sys

import jax

from shardlab.cli.args import add_model_mesh_strategy, add_overrides, add_simulate_devices
from shardlab.cli.args import load_config, setup_devices
from shardlab.errors import ConfigError
import shardlab.observe.explain.report as explain_lib
import shardlab.observe.explain.diff as explain_diff
import shardlab.observe.explain.html as explain_html
from shardlab.observe import progress
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.training import run as run_lib


def explain_parser(prog: str = "shardlab explain") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, description="List every collective of the compiled train step with the "
                             "source line it comes from, its bytes and time, the rule behind "
                             "it, and whether the strategy plans it.",
      epilog="Example: shardlab explain --model tiny --mesh fsdp:4,tensor:2 --strategy "
             "fsdp_tp --against fsdp")
  add_model_mesh_strategy(p, searched=False)
  p.add_argument("--target", default=explain_lib.DEFAULT_TARGET,
                 help=f"accelerator whose ICI/DCN bandwidths time each collective: "
                      f"{', '.join(hardware.names())} or a TOML file")
  p.add_argument("--against", metavar="STRATEGY",
                 help="also compile under this strategy and show what appeared, "
                      "disappeared or changed size")
  p.add_argument("--against-set", dest="against_overrides", action="append", default=[],
                 metavar="KEY=VALUE", help="the other step: this one with these overrides "
                                           "(e.g. rules.params.mlp=none)")
  p.add_argument("--against-report", metavar="FILE.json",
                 help="compare with a report saved by `shardlab explain --json > FILE.json`, "
                      "e.g. at another commit or on another machine")
  p.add_argument("--html", metavar="FILE", help="also write the report as one HTML page")
  p.add_argument("--json", action="store_true", help="print JSON instead of text")
  add_simulate_devices(p)
  add_overrides(p, "rules.activations.mlp=none")
  return p


def explain_config(cfg, target: str = explain_lib.DEFAULT_TARGET) -> explain_lib.Report:
  """The report of `cfg`'s train step compiled on this machine's first devices."""
  p = run_lib.place(cfg, jax.devices()[:_devices(cfg)])
  step = run_lib.make_steps(cfg, p.abstract, p.shardings)[0]
  args = run_lib.abstract_inputs(p.abstract, p.shardings, cfg)
  with progress.Activity(f"compiling the train step ({cfg.strategy})"):
    return explain_lib.explain(step, *args, names=p.abstract.names, target=target,
                               dcn_axes=tuple(a for a, n in p.spec.dcn.items() if n != 1))


def _devices(cfg) -> int:
  """How many of this machine's devices the mesh takes, from the mesh alone (a -1 axis
  takes them all): the abstract state is built once, by explain_config's place."""
  spec = mesh_lib.load(cfg.mesh)
  sizes = [*spec.ici.values(), *spec.dcn.values()]
  n = jax.device_count() if -1 in sizes else spec.n_devices
  if n > jax.device_count():
    raise ConfigError(f"explain compiles on this machine's devices: mesh {cfg.mesh!r} needs "
                      f"{n}, there are {jax.device_count()} (pass --simulate-devices {n})")
  return n


def explain_main(argv=None, prog: str = "shardlab explain") -> int:
  args = explain_parser(prog).parse_args(argv)
  try:
    setup_devices(args.simulate_devices)
    cfg = load_config(args.model, args.mesh, args.strategy, args.overrides)
    report = explain_config(cfg, args.target)
    diff = _against(args, report)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.html:
    with open(args.html, "w") as f:
      f.write(explain_html.render(report, f"shardlab explain: {args.model}, {args.strategy} "
                                          f"on {args.mesh}"))
  if args.json:
    out = report.as_dict()
    if diff is not None:
      out["against"] = {"other": diff.other, "delta_by_kind": diff.delta_by_kind(),
                        "appeared": len(diff.appeared), "disappeared": len(diff.disappeared),
                        "changed": len(diff.changed), "seconds": list(diff.seconds),
                        "memory_bytes": list(diff.memory)}
    print(json.dumps(out, indent=2))
  else:
    print("\n".join(report.render()))
    if diff is not None:
      print("\n" + "\n".join(diff.render()))
  return 0


def _against(args, report):
  """The comparison --against, --against-set or --against-report asks for, or None."""
  if args.against_report:
    try:
      saved = json.loads(open(args.against_report).read())
      other = explain_lib.Report.from_dict(saved)
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ConfigError(f"--against-report {args.against_report}: not a report written by "
                        f"`shardlab explain --json` ({type(e).__name__}: {e})") from None
    return explain_diff.compare(report, other, args.against_report)
  if not (args.against or args.against_overrides):
    return None
  strategy = args.against or args.strategy
  other_cfg = load_config(args.model, args.mesh, strategy,
                          list(args.overrides) + list(args.against_overrides))
  label = " ".join([strategy] + list(args.against_overrides))
  return explain_diff.compare(report, explain_config(other_cfg, args.target), label)
