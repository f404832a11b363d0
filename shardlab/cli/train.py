"""`python train.py` / `shardlab train`: train a bundled model on a named device mesh."""

import argparse
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path

import jax

from shardlab import generate
from shardlab.bounds import Int
from shardlab.config import BOUNDS
import shardlab.cli.text as text
from shardlab.cli.args import (add_model_mesh_strategy, add_overrides, add_simulate_devices,
                               cpu_entry_point, load_config, setup_devices)
import shardlab.cli.run_config as run_config
from shardlab.cli.auto import add_auto_args, resolve_auto
from shardlab.errors import ConfigError
from shardlab.hf import weights as hf
from shardlab.observe import log_capture, trackers
from shardlab.observe.progress import Activity
from shardlab.runtime import distributed
from shardlab.data import tokenizer as tokenizer_lib
from shardlab.training import checkpoint, checkpoint_lock, loop
from shardlab.training.nonfinite import NonFiniteError

SAMPLE_PROMPT = "def "  # the default corpus is Python source


def train_parser(prog: str = "train.py") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, description="Train a bundled model on a named device mesh.",
      epilog="Example: python train.py --model tiny --mesh data:1,fsdp:-1,tensor:2 "
             "--strategy fsdp_tp --steps 300 --set train.lr=1e-3")
  p.add_argument("--config", metavar="FILE.toml",
                 help="a run config: the config's sections and keys (model, mesh, strategy, "
                      "[train], [data], [checkpoint], ...) as TOML; flags given override it. "
                      f"Every --run-dir gets the resolved one ({run_config.RESOLVED}), which "
                      "reruns the run")
  add_model_mesh_strategy(p)
  # Unset (None) unless given, so that a default never overrides the --config file's value.
  p.set_defaults(model=None, mesh=None, strategy=None)
  p.add_argument("--steps", type=BOUNDS["train.steps"],
                 help="optimizer steps (train.steps; %(type)s)")
  p.add_argument("--seed", type=BOUNDS["train.seed"],
                 help="init and data seed (train.seed; %(type)s)")
  p.add_argument("--precision", help="auto | fp32 | bf16 | bf16-params (train.precision)")
  p.add_argument("--eval-every", type=BOUNDS["train.eval_every"], metavar="N",
                 help="held-out loss every N steps, in the metrics, TensorBoard and the plot "
                      "(train.eval_every; %(type)s; default: only at the end)")
  p.add_argument("--eval-batches", type=BOUNDS["train.eval_batches"], metavar="K",
                 help="held-out batches per evaluation (train.eval_batches, default 8; "
                      "%(type)s)")
  add_simulate_devices(p)
  _add_outputs(p)
  p.add_argument("--sample-tokens", type=Int(min=0, note="0: none"), default=80, metavar="N",
                 help="end a finished run with a sample of N tokens (default %(default)s; "
                      "%(type)s)")
  add_overrides(p)
  p.add_argument("--checkpoint-dir", help="save checkpoints here (async, every "
                 "checkpoint.every steps and at the end) and resume from the newest one")
  p.add_argument("--fresh", action="store_true",
                 help="start over: the checkpoint dir must be empty (or pass --overwrite)")
  p.add_argument("--overwrite", action="store_true",
                 help="with --fresh: delete what the checkpoint dir holds")
  p.add_argument("--allow-config-change", action="store_true",
                 help="resume even though the checkpoint was saved with other settings that "
                      "matter (model, optimizer hyperparameters, precision, grad_dtype, batch, "
                      "sequence length, microbatches, seed, data); see docs/checkpoints.md")
  p.add_argument("--init-from", help="load params only from this checkpoint dir, or from a "
                 "Hugging Face Llama dir as hf:DIR (fine-tuning)")
  p.add_argument("--stop-after", type=Int(min=1), metavar="N",
                 help="checkpoint and exit after N steps of this invocation (e.g. to fit a job "
                      "time limit; %(type)s); a later run resumes")
  _add_processes(p)
  p.add_argument("--quiet", action="store_true", help="no progress output")
  add_auto_args(p)
  return p


def _add_processes(p: argparse.ArgumentParser) -> None:
  """A multi-process run: where process 0 is, who this one is, how long to wait."""
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="multi-process run: process 0's address (jax.distributed); TPU pods, "
                      "SLURM and Open MPI are detected without it")
  p.add_argument("--num-processes", type=Int(min=1), metavar="N",
                 help="with --coordinator (%(type)s)")
  p.add_argument("--process-id", type=Int(min=0), metavar="I",
                 help="with --coordinator: 0..N-1 (%(type)s)")
  p.add_argument("--init-timeout", type=distributed.INIT_TIMEOUT, metavar="S",
                 default=distributed.INIT_TIMEOUT_S,
                 help="multi-process: every process must join within S seconds, else exit 4 "
                      "naming the coordinator (default %(default)s; %(type)s)")
  p.add_argument("--heartbeat-timeout", type=distributed.HEARTBEAT_TIMEOUT, metavar="S",
                 default=distributed.HEARTBEAT_TIMEOUT_S,
                 help="multi-process: a process silent for S seconds is taken as dead and "
                      "every other one exits 4 naming it (default %(default)s; %(type)s)")


def _add_outputs(p: argparse.ArgumentParser) -> None:
  """Where a run's metrics go: the JSONL, the run directory, trackers, profiles."""
  p.add_argument("--metrics-file", help="append one JSON object per logged step here")
  p.add_argument("--run-dir", help="write metrics.jsonl (unless --metrics-file), TensorBoard "
                 "event files, plot.png and --profile-steps traces here")
  p.add_argument("--logger", metavar="NAMES",
                 help="where the step scalars and the resolved config go besides the JSONL, "
                      "comma-separated: tensorboard, wandb, mlflow, or none (loggers; default: "
                      "tensorboard). W&B and MLflow need the trackers extra; see "
                      "docs/observability.md")
  p.add_argument("--profile-steps", metavar="A:B",
                 help="jax.profiler trace of steps A+1..B into RUN_DIR/profile")


def config_from_args(args):
  cfg = _config_from_args(args)
  trackers.names(cfg)  # --logger checked before any device work (an --auto search)
  source = cfg.checkpoint.init_from or ""
  if source.startswith(hf.PREFIX) and cfg.data.tokenizer == "bytes":  # the model's own
    from shardlab.hf import peft  # a PEFT adapter's tokenizer may be its base model's
    names = (tokenizer_lib.HF_FILE, tokenizer_lib.SP_FILE)
    root = peft.files_dir(source[len(hf.PREFIX):], names)
    if any((Path(root) / n).is_file() for n in names):
      cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=root))
  return cfg


def _config_from_args(args):
  """Defaults < --config < the flags given < --set: each flag sets one Config field."""
  return load_config(args.model, args.mesh, args.strategy, args.overrides, {
      "metrics_file": args.metrics_file, "run_dir": args.run_dir, "loggers": args.logger,
      "profile_steps": args.profile_steps, "train.steps": args.steps,
      "train.seed": args.seed, "train.precision": args.precision,
      "train.eval_every": args.eval_every, "train.eval_batches": args.eval_batches,
      "checkpoint.dir": args.checkpoint_dir, "checkpoint.init_from": args.init_from},
      config_file=args.config)


def sampler(max_new_tokens: int, prompt: str = SAMPLE_PROMPT):
  """The end-of-run hook that samples up to `max_new_tokens` tokens from the trained params."""

  def sample(run, state, progress) -> dict:
    if max_new_tokens <= 0 or jax.process_count() > 1:  # device_get needs every shard here
      return {}
    with Activity("sampling", progress):
      gen = generate.Generator(run.cfg, run.abstract, run.shardings)
      tokenizer = run.feed.tokenizer
      s = text.sampling(tokenizer, run.cfg, max_new_tokens=max_new_tokens,
                        seed=run.cfg.train.seed)
      sample = prompt + text.texts(gen, state.params, tokenizer, [prompt], s)[0][0][0]
    progress.message(f"sample (temperature 0.8, top-k 40):\n{sample}")
    return {"sample": sample}

  return sample


def hf_params(run):
  """Params for `--init-from hf:DIR` (with a PEFT adapter's, if DIR holds one: hf/peft.py),
  each born on its shard."""
  from shardlab.hf import peft
  return peft.load_params(run.cfg.checkpoint.init_from[len(hf.PREFIX):], run.cfg,
                          run.abstract, run.shardings)


def train_main(argv=None, prog: str = "train.py") -> int:
  """The train command. At a process's entry point (train.py, the shardlab command) a
  Ctrl-C outside the training loop, where nothing is being saved, ends the process at once
  with one line (`_leave`): a KeyboardInterrupt can be swallowed by a library's bare
  `except:`, and leaving while XLA still compiles on its own threads must skip the
  interpreter's teardown (it aborts: "pure virtual method called"). In the loop, the first
  Ctrl-C stops at the next step and saves (preemption.py)."""
  args = train_parser(prog).parse_args(argv)
  where = {"checkpoint_dir": args.checkpoint_dir}  # known better once the config is read
  entry = (argv is None or prog.startswith("shardlab")) and \
      threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGINT, lambda *_: _leave(where)) if entry else None
  try:
    return _train(args, argv, where)
  except KeyboardInterrupt:  # a second Ctrl-C in the loop, or any one in-process
    if entry:
      _leave(where)
    return _interrupted(where["checkpoint_dir"])
  finally:
    if entry:
      signal.signal(signal.SIGINT, previous)


def _leave(where: dict) -> None:
  terminal = next((s for s in (sys.stdout, sys.stderr) if s.isatty()), None)
  if terminal is not None:  # a live progress line was cut off: clear it, show the cursor
    terminal.write("\r\x1b[2K\x1b[?25h")
  code = _interrupted(where["checkpoint_dir"])
  checkpoint_lock.release_all()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _train(args, argv, where: dict) -> int:
  if argv is None:  # train.py: the process's entry point
    cpu_entry_point()
  logs = log_capture.LibraryLogs()  # Orbax's and JAX's logging: to run.log, not the console
  try:
    with logs:
      setup_devices(args.simulate_devices)
      how = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   args.init_timeout, args.heartbeat_timeout)
      if how and distributed.is_leader() and not args.quiet:
        print(f"distributed: {how}", flush=True)
      cfg = resolve_auto(config_from_args(args), args, args.fresh,
                         say=(lambda text: None) if args.quiet else None)
      where["checkpoint_dir"] = cfg.checkpoint.dir
      if cfg.run_dir:
        i = jax.process_index()
        logs.keep_in(cfg.run_dir, "run.log" if i == 0 else f"run.{i}.log")
      if cfg.run_dir and distributed.is_leader():  # as resolved: auto layouts and all
        run_config.write(cfg, cfg.run_dir)
      loop.train(cfg, quiet=args.quiet, fresh=args.fresh, overwrite=args.overwrite,
                 stop_after=args.stop_after, param_sources={"hf": hf_params},
                 on_finish=sampler(args.sample_tokens),
                 allow_config_change=args.allow_config_change)
  except ConfigError as e:
    return _error(e, 2, logs)
  except NonFiniteError as e:  # its own code: a scheduler can tell divergence from bad input
    return _error(e, 3, logs)
  _said(logs)
  return 0


def _interrupted(checkpoint_dir: str | None) -> int:
  """One line for a Ctrl-C that the loop did not turn into a stop at a step boundary (one
  during start-up or compiling, or a second one): what is saved, and exit 130."""
  if not checkpoint_dir:
    saved = "nothing was saved (no --checkpoint-dir)"
  else:
    steps = checkpoint.saved_steps(checkpoint_dir)
    saved = (f"the newest checkpoint is step {steps[-1]} in {checkpoint_dir}; rerun the same "
             f"command to resume from it" if steps else
             f"no checkpoint was saved in {checkpoint_dir}")
  print(f"interrupted (Ctrl-C): {saved}", file=sys.stderr, flush=True)
  distributed.fail("interrupted (Ctrl-C)", 130)  # the other processes stop too
  return 130


def _said(logs: log_capture.LibraryLogs | None) -> None:
  """One line on what the libraries logged (kept in run.log), before our own last word."""
  line = logs and logs.summary()
  if line:
    print(f"note: {line}", file=sys.stderr, flush=True)


def _error(error: Exception, code: int, logs: log_capture.LibraryLogs | None = None) -> int:
  _said(logs)
  print(f"error: {error}", file=sys.stderr, flush=True)
  # Several processes: this one may be alone in failing (a path only its host lacks), so
  # the others are told, and nobody waits at the exit for a peer that left.
  distributed.fail(f"error: {str(error)[:300]}", code)
  return code


