"""train.py's `--strategy auto` / `--mesh auto`: search (shardlab.plan.auto.layout), print
the table chosen from, record the choice, or keep the one a checkpoint was saved with."""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.plan.auto import choice as auto
from shardlab.plan.auto import layout as auto_layout
from shardlab.runtime import distributed, hardware
from shardlab.training import checkpoint

AUTO = auto_layout.AUTO
RECORD = "layout.json"  # in the run directory


def add_auto_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("--strategy auto / --mesh auto")
  g.add_argument("--target", help=f"the accelerator the search assumes: "
                 f"{', '.join(hardware.names())} or a TOML file (default: the attached "
                 f"devices' kind; this host for CPU)")
  g.add_argument("--auto-top", type=auto.TOP_K, default=4, metavar="K",
                 help="compile candidates in the formula's order until K fit (default 4; "
                      "%(type)s)")
  g.add_argument("--auto-budget-s", type=auto.BUDGET_S, default=600.0, metavar="S",
                 help="start no compile after S seconds of searching (default 600; %(type)s)")
  g.add_argument("--auto-memory-options", action="store_true",
                 help="search remat policies and microbatch counts too")
  g.add_argument("--auto-again", action="store_true",
                 help="search again on resume (default: keep the checkpoint's layout)")


def resolve_auto(cfg: Config, args, fresh: bool, say=None) -> Config:
  """`cfg` with "auto" replaced: by the checkpoint's layout on resume, else by a search."""
  if AUTO not in (cfg.strategy, cfg.mesh):
    return cfg
  say = say or (lambda text: print(text, file=sys.stderr, flush=True))
  saved = None if fresh else _saved(cfg)
  if saved is not None and not args.auto_again:
    kept = _keep(cfg, saved, args.auto_memory_options)
    say(f"auto layout: kept {kept.strategy} on {kept.mesh} (remat {kept.train.remat}), "
        f"the checkpoint's; --auto-again searches again")
    return kept
  choice = auto_layout.auto_layout(
      cfg, target=args.target, top_k=args.auto_top, budget_s=args.auto_budget_s,
      memory_options=args.auto_memory_options, vary_microbatches=saved is None,
      say=say if distributed.is_leader() else lambda text: None)
  if distributed.is_leader():
    say("\n".join(auto.render(choice)))
    record(cfg.run_dir, choice)
  return choice.apply(cfg)


def record(run_dir: str | None, choice: auto.Choice) -> None:
  if run_dir:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / RECORD).write_text(json.dumps(choice.as_dict(), indent=2) + "\n")


def _saved(cfg: Config) -> dict | None:
  """The newest checkpoint's config, if the checkpoint dir holds one."""
  d = cfg.checkpoint.dir
  if not d or not Path(d).is_dir() or not any(p.name.isdigit() for p in Path(d).iterdir()):
    return None
  return checkpoint.saved_config(d)


def _keep(cfg: Config, saved: dict, memory_options: bool) -> Config:
  for key in ("strategy", "mesh"):
    if saved.get(key) in (None, AUTO):
      raise ConfigError(f"checkpoint {cfg.checkpoint.dir!r} records no {key} to keep; "
                        f"pass --auto-again or a {key}")
  train = (dataclasses.replace(cfg.train, remat=saved["train"]["remat"]) if memory_options
           else cfg.train)
  return dataclasses.replace(
      cfg, strategy=saved["strategy"] if cfg.strategy == AUTO else cfg.strategy,
      mesh=saved["mesh"] if cfg.mesh == AUTO else cfg.mesh, train=train)
