"""Command-line options that several commands share, each default declared once here."""

import argparse
import dataclasses
import os
import sys

from shardlab import config as config_lib
import shardlab.cli.run_config as run_config
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.runtime import devices, host_memory
from shardlab.sharding import rules

DEFAULT_MODEL = "tiny"
DEFAULT_MESH = "cpu-8"
DEFAULT_STRATEGY = "fsdp_tp"
DEFAULT_SIMULATED_DEVICES = 8


def add_model_mesh_strategy(p: argparse.ArgumentParser, model: str = DEFAULT_MODEL,
                            searched: bool = True, factory: bool = False) -> None:
  """--model, --mesh, --strategy. `searched`: the command takes `auto` for the last two
  (train.py: --auto-top); `factory`: --model also takes a user's module factory."""
  user = "; or a module factory, path/to/file.py:function or package.module:function " \
         "(docs/plan-any-module.md)" if factory else ""
  p.add_argument("--model", default=model,
                 help=f"a preset ({', '.join(registry.presets())}) or a TOML model file{user} "
                      f"(default {model})")
  auto = "; auto: searched (see --auto-top)" if searched else ""
  p.add_argument("--mesh", default=DEFAULT_MESH,
                 help="preset (meshes/), TOML file, or inline 'data:1,fsdp:-1,tensor:2'"
                      f"{auto} (default {DEFAULT_MESH})")
  p.add_argument("--strategy", default=DEFAULT_STRATEGY,
                 help=" | ".join(rules.STRATEGIES) + ("; auto: searched" if searched else "") +
                      f" (default {DEFAULT_STRATEGY})")


def add_overrides(p: argparse.ArgumentParser, example: str = "train.lr=1e-3") -> None:
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help=f"override any config key, e.g. {example} or rules.params.mlp=tensor")


def add_simulate_devices(p: argparse.ArgumentParser) -> None:
  p.add_argument("--simulate-devices", type=devices.SIMULATED, metavar="N",
                 help=f"run on N simulated CPU devices (%(type)s; default "
                      f"{DEFAULT_SIMULATED_DEVICES} when no accelerator is present)")


cpu_entry_point = host_memory.cpu_entry_point  # train.py and shardlab call it before this


def setup_devices(requested: int | None) -> None:
  if requested is None:
    if devices.accelerator_present() or "device_count" in os.environ.get("XLA_FLAGS", ""):
      return
    requested = DEFAULT_SIMULATED_DEVICES
  devices.simulate(requested)


def load_config(model: str | None, mesh: str | None, strategy: str | None,
                overrides: list[str] = (), values: dict | None = None,
                config_file: str | None = None) -> config_lib.Config:
  """The run Config: the defaults, then a run config file (`--config`), then the flags given
  (None: not given, so a default never hides a value of the file), then `--set` strings."""
  if config_file:
    cfg = run_config.load(config_file, DEFAULT_MODEL)
    cfg = cfg if model is None else dataclasses.replace(cfg, model=registry.load(model))
  else:
    cfg = config_lib.Config(model=registry.load(model or DEFAULT_MODEL), mesh=DEFAULT_MESH,
                            strategy=DEFAULT_STRATEGY)
  given = {"mesh": mesh, "strategy": strategy, **(values or {})}
  cfg = config_lib.set_values(cfg, {k: v for k, v in given.items() if v is not None})
  return config_lib.apply_overrides(cfg, list(overrides))


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
  """--help shows each option's default, except where there is none to show (None, off, an
  empty list): there the help text says what leaving it unset does."""

  def _get_help_string(self, action):
    unset = action.default is None or action.default is False or action.default == []
    if unset or "%(default)" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


class Given(argparse.Action):
  """Stores the value and records the option as given in `namespace.given`: where leaving
  it out means more than its default (a search picks it, a file sets it)."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    namespace.given = set(getattr(namespace, "given", None) or ()) | {self.dest}


def given(args, dest: str) -> bool:
  return dest in (getattr(args, "given", None) or ())


def run_command(run, args) -> int:
  """Runs a subcommand's `run(args)`: 0, or 2 with the ConfigError's one-line message."""
  try:
    run(args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
