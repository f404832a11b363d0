"""The `shardlab` console script: one subcommand per module of this package. This package
is the composition root: the only place (with bench/ and examples/) that picks a model."""

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


def main(argv=None) -> int:
  entry, argv = argv is None, sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in COMMANDS:
    names = " | ".join(COMMANDS)
    print(f"usage: shardlab {{{names}}} [options]   (shardlab COMMAND --help for each)",
          file=sys.stderr)
    return 2
  if entry:
    cpu_entry_point()
  return COMMANDS[argv[0]](argv[1:], prog=f"shardlab {argv[0]}")


if __name__ == "__main__":
  sys.exit(main())
