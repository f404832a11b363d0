"""The `shardlab` console script: one subcommand per module of this package. This package
is the composition root: the only place (with bench/ and examples/) that picks a model."""

import argparse
import sys

from shardlab.cli import convert as convert_cli
from shardlab.cli import data as data_cli
from shardlab.cli import explain as explain_cli
from shardlab.cli import generate as generate_cli
from shardlab.cli import goodput as goodput_cli
from shardlab.cli import inspect as inspect_cli
from shardlab.cli import plan as plan_cli
from shardlab.cli.args import cpu_entry_point
from shardlab.cli.train import train_main



def launch_main(argv=None, prog: str = "shardlab launch") -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  ours = argv[:argv.index("--")] if "--" in argv else argv
  if "--slurm" in ours:  # an sbatch script for a SLURM cluster instead of local processes
    from shardlab.runtime import sbatch
    argv.remove("--slurm")
    return sbatch.sbatch_main(argv, f"{prog} --slurm")
  from shardlab.runtime import launch
  return launch.launch_main(argv, prog)


COMMANDS = {"train": train_main, "plan": plan_cli.plan_main, "launch": launch_main,
            "convert": convert_cli.convert_main, "inspect": inspect_cli.inspect_main,
            "generate": generate_cli.generate_main, "data": data_cli.data_main,
            "explain": explain_cli.explain_main}
COMMANDS["goodput"] = goodput_cli.goodput_main
# `shardlab --help`'s line for each command (each command's own --help says the rest).
SUMMARIES = {
    "train": "train a model on a device mesh (the same as python train.py)",
    "plan": "per-device memory, fit, device count and the best mesh, before renting "
            "hardware (train, serve, longest-context)",
    "launch": "N local processes of one multi-process run, or (--slurm) an sbatch script "
              "for a SLURM cluster",
    "convert": "Hugging Face checkpoints to shardlab's and back (from-hf, to-hf, hf-config)",
    "inspect": "each parameter's sharding and per-device bytes under a strategy and mesh",
    "generate": "sample text from a checkpoint with a sharded KV cache",
    "data": "tokenize text into training shards, or train a BPE tokenizer",
    "explain": "every collective of the compiled train step: its source line, bytes, time "
               "and the rule behind it",
    "goodput": "a run's wall time by phase and its goodput (productive / total)",
}


def top_parser() -> argparse.ArgumentParser:
  """Only for `shardlab --help`: each command dispatches to its own parser."""
  p = argparse.ArgumentParser(
      prog="shardlab", description="Declarative sharding for training Transformers in JAX.",
      epilog="shardlab COMMAND --help shows each command's options.")
  sub = p.add_subparsers(title="commands", metavar="COMMAND")
  for name in COMMANDS:
    sub.add_parser(name, help=SUMMARIES.get(name), add_help=False)
  return p


def main(argv=None) -> int:
  entry, argv = argv is None, sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    top_parser().print_help()
    return 0
  if not argv or argv[0] not in COMMANDS:
    top_parser().print_help(sys.stderr)
    if argv:
      print(f"\nerror: unknown command {argv[0]!r}; valid: {', '.join(COMMANDS)}",
            file=sys.stderr)
    return 2
  if entry:
    cpu_entry_point()
  return COMMANDS[argv[0]](argv[1:], prog=f"shardlab {argv[0]}")


if __name__ == "__main__":
  sys.exit(main())
