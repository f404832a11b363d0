"""Command-line options that several commands share, each default declared once here."""

import argparse
import os
import sys

from shardlab import config as config_lib
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.runtime import devices, host_memory
from shardlab.sharding import rules

DEFAULT_MODEL = "tiny"
DEFAULT_MESH = "cpu-8"
DEFAULT_STRATEGY = "fsdp_tp"
DEFAULT_SIMULATED_DEVICES = 8


def add_model_mesh_strategy(p: argparse.ArgumentParser, model: str = DEFAULT_MODEL) -> None:
  p.add_argument("--model", default=model,
                 help=f"a preset ({', '.join(registry.presets())}) or a TOML model file")
  p.add_argument("--mesh", default=DEFAULT_MESH,
                 help="preset (meshes/), TOML file, or inline 'data:1,fsdp:-1,tensor:2'; "
                      "train.py also takes auto (searched, see --auto-top)")
  p.add_argument("--strategy", default=DEFAULT_STRATEGY,
                 help=" | ".join(rules.STRATEGIES) + "; train.py also takes auto")


def add_overrides(p: argparse.ArgumentParser, example: str = "train.lr=1e-3") -> None:
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help=f"override any config key, e.g. {example} or rules.params.mlp=tensor")


def add_simulate_devices(p: argparse.ArgumentParser) -> None:
  p.add_argument("--simulate-devices", type=int, metavar="N",
                 help=f"run on N simulated CPU devices (default {DEFAULT_SIMULATED_DEVICES} "
                      f"when no accelerator is present)")


def cpu_entry_point() -> None:
  """First thing in a command-line entry point: on a host without accelerators, restart with
  huge pages for XLA:CPU's buffers (runtime.host_memory)."""
  if not devices.accelerator_present():
    host_memory.reexec_with_huge_pages()


def setup_devices(requested: int | None) -> None:
  if requested is None:
    if devices.accelerator_present() or "device_count" in os.environ.get("XLA_FLAGS", ""):
      return
    requested = DEFAULT_SIMULATED_DEVICES
  devices.simulate(requested)


def load_config(model: str, mesh: str, strategy: str, overrides: list[str] = (),
                values: dict | None = None) -> config_lib.Config:
  """The run Config: a bundled model, then typed flag values, then `--set` strings."""
  cfg = config_lib.Config(model=registry.load(model), mesh=mesh, strategy=strategy)
  cfg = config_lib.set_values(cfg, {k: v for k, v in (values or {}).items() if v is not None})
  return config_lib.apply_overrides(cfg, list(overrides))


def run_command(run, args) -> int:
  """Runs a subcommand's `run(args)`: 0, or 2 with the ConfigError's one-line message."""
  try:
    run(args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
