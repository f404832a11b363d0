"""`shardlab launch --slurm --nodes N --gpus-per-node G [--per gpu|node] -- COMMAND ...`: an
sbatch script for a SLURM cluster, printed (or written with --script FILE); submit it with
`sbatch FILE`.

One task per GPU (default) or per node; every task runs COMMAND, and shardlab finds the
coordinator, the process count and its own id from srun's environment (slurm.py). The
script names the coordinator (the first node of the job) itself, from `scontrol show
hostnames`, which reads every host-list form. Before the time limit SLURM sends the script
SIGUSR1: it sends the tasks SIGTERM (each saves a checkpoint at the same step and exits 0)
and requeues the job, which resumes from that checkpoint. With --cpu-devices D it
runs on CPUs alone (each task simulating D devices): the same script, tested anywhere.
"""

import argparse
import shlex
import sys

from shardlab.bounds import Int
from shardlab.runtime import slurm

SIGNAL_S = 120  # how long before --time ends the script is told to save (SIGUSR1)


def script(command: list[str], nodes: int, gpus_per_node: int, per: str = "gpu",
           time: str | None = None, partition: str | None = None, job_name: str = "shardlab",
           output: str = "shardlab-%j.out", cpus_per_task: int | None = None,
           cpu_devices: int | None = None, signal_s: int = SIGNAL_S,
           sbatch_options: list[str] = (), made_by: str = "") -> str:
  """The text of the sbatch script."""
  tasks = gpus_per_node if per == "gpu" else 1
  each = (f"{cpu_devices} simulated CPU devices" if cpu_devices else
          "its GPU" if per == "gpu" else f"the node's {gpus_per_node} GPUs")
  lines = ["#!/bin/bash", f"# {made_by}" if made_by else None,
           "# Submit with: sbatch THIS_FILE  (options given to sbatch override these)",
           f"#SBATCH --job-name={job_name}",
           f"#SBATCH --nodes={nodes}",
           f"#SBATCH --ntasks-per-node={tasks}  # one process per {per}, driving {each}",
           None if cpu_devices else f"#SBATCH --gpus-per-node={gpus_per_node}",
           f"#SBATCH --cpus-per-task={cpus_per_task}" if cpus_per_task else None,
           f"#SBATCH --time={time}" if time else None,
           f"#SBATCH --partition={partition}" if partition else None,
           f"#SBATCH --output={output}",
           "#SBATCH --open-mode=append  # a requeued run's output follows the first's",
           "#SBATCH --requeue  # a preempted or requeued job resumes from its newest checkpoint",
           f"#SBATCH --signal=B:USR1@{signal_s}  # save and requeue before --time runs out",
           *(f"#SBATCH {option}" for option in sbatch_options), ""]
  lines += _environment(cpu_devices) + _coordinator() + _run(command, signal_s)
  return "\n".join(line for line in lines if line is not None) + "\n"


def _environment(cpu_devices: int | None) -> list[str]:
  if cpu_devices:
    return ["# CPUs only: each task simulates this many devices, with gloo collectives.",
            "export JAX_PLATFORMS=cpu",
            f"export XLA_FLAGS=--xla_force_host_platform_device_count={cpu_devices}", ""]
  return ["# NCCL finds the network between nodes itself; if it picks the wrong interface,",
          "# name it (`ip -br link` lists them), e.g. export NCCL_SOCKET_IFNAME=ib0",
          'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
          "# XLA takes 75% of each GPU's memory by default; the planner counts on more.",
          'export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"', ""]


def _coordinator() -> list[str]:
  port = (f"$(( {slurm.PORT_BASE} + SLURM_JOB_ID % {slurm.PORT_SLOTS // slurm.STEPS_PER_JOB}"
          f" * {slurm.STEPS_PER_JOB} ))")
  return ["# Process 0 runs on the job's first node and hosts the coordinator there (the",
          "# port shardlab derives for the job's first step; set JAX_COORDINATOR_PORT to",
          "# choose another).",
          'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
          f'export JAX_COORDINATOR_ADDRESS="$head_node:${{JAX_COORDINATOR_PORT:-{port}}}"',
          'echo "shardlab: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}), '
          '$SLURM_NTASKS tasks on $SLURM_JOB_NODELIST, coordinator $JAX_COORDINATOR_ADDRESS"',
          ""]


def _run(command: list[str], signal_s: int) -> list[str]:
  # Never SIGTERM srun itself: it answers with SIGKILL to every task (no checkpoint).
  return [
      f"# SIGUSR1 (--time ends in {signal_s} s): SIGTERM to the tasks, not to this script",
      "# or srun; they save and exit 0, then the job requeues itself. On SIGTERM (preempted,",
      "# cancelled, `scontrol requeue`) SLURM signals the tasks itself; this script waits.",
      "requeue=0",
      "trap 'requeue=1; echo \"shardlab: SIGUSR1: saving, then requeueing\"; "
      "scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1",
      "trap 'echo \"shardlab: SIGTERM: the tasks save and exit\"' TERM",
      f"srun {shlex.join(command)} &",
      "srun_pid=$!",
      'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done  # a trap wakes wait',
      'wait "$srun_pid"; code=$?',
      'if [ "$requeue" = 1 ] && [ "$code" = 0 ]; then',
      '  echo "shardlab: saved; requeueing job $SLURM_JOB_ID"',
      '  scontrol requeue "$SLURM_JOB_ID"',
      "fi",
      'exit "$code"']


def _saves_checkpoints(command: list[str]) -> bool:
  return any(a.startswith(("--checkpoint-dir", "checkpoint.dir=", "--run-dir", "run_dir="))
             for a in command)


def sbatch_main(argv=None, prog: str = "shardlab launch --slurm") -> int:
  p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                              usage=f"{prog} --nodes N --gpus-per-node G [options] -- COMMAND ...")
  count = Int(min=1)
  p.add_argument("--nodes", type=count, default=1,
                 help="nodes to allocate (default %(default)s; %(type)s)")
  p.add_argument("--gpus-per-node", type=count, required=True, metavar="G",
                 help="GPUs on each node (required; %(type)s)")
  p.add_argument("--per", choices=("gpu", "node"), default="gpu",
                 help="one task (process) per GPU, or per node driving all its GPUs "
                      "(default %(default)s)")
  p.add_argument("--time", help="the job's time limit, as sbatch takes it (e.g. 24:00:00)")
  p.add_argument("--partition", help="the SLURM partition (unset: the cluster's default)")
  p.add_argument("--job-name", default="shardlab", help="the job's name (default %(default)s)")
  p.add_argument("--output", default="shardlab-%j.out",
                 help="the job's log (%%j: job id; default %(default)s)")
  p.add_argument("--cpus-per-task", type=count,
                 help="CPU cores for each task (%(type)s; unset: the cluster's default)")
  p.add_argument("--cpu-devices", type=count, metavar="D",
                 help="no GPUs: each task simulates D CPU devices (a test of the script; "
                      "%(type)s)")
  p.add_argument("--signal-seconds", type=count, default=SIGNAL_S, metavar="S",
                 help="SIGUSR1 (save, requeue) this long before --time ends (default "
                      "%(default)s; %(type)s)")
  p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                 help="one more #SBATCH line, e.g. --sbatch=--account=proj")
  p.add_argument("--script", metavar="FILE", help="write the script here (default: print it)")
  p.add_argument("command", nargs=argparse.REMAINDER,
                 help="after --: the command every task runs, e.g. python train.py ...")
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("give the command every task runs after --, e.g. -- python train.py --mesh "
            "dcn.data:2,fsdp:8")
  if not _saves_checkpoints(command):
    print("warning: the command has no --checkpoint-dir: a requeued job starts over",
          file=sys.stderr)
  given = shlex.join(argv if argv is not None else sys.argv[1:])
  text = script(command, args.nodes, args.gpus_per_node, args.per, args.time, args.partition,
                args.job_name, args.output, args.cpus_per_task, args.cpu_devices,
                args.signal_seconds, args.sbatch, made_by=f"Written by: {prog} {given}")
  if args.script:
    with open(args.script, "w") as f:
      f.write(text)
    print(f"wrote {args.script}: submit it with `sbatch {args.script}`", file=sys.stderr)
  else:
    sys.stdout.write(text)
  return 0
