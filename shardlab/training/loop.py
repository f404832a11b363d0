"""The training loop: set up a run from a Config, train, checkpoint, report held-out loss."""

import contextlib
import time
from typing import Callable

import jax

from shardlab import config as config_lib
from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.observe import goodput, profiling, step_report, throughput
from shardlab.observe.progress import Activity, Progress
from shardlab.runtime import distributed
from shardlab.sharding import idle
from shardlab.training import checkpoint, schedule
from shardlab.training.preemption import StopRequest
from shardlab.training.reporting import Logger, finish, nothing_to_train, report_end, run_paths
from shardlab.training.nonfinite import NonFiniteGuard, last_good
from shardlab.training.run import Run, completed, init
from shardlab.training.run import resume_check, setup

# (run) -> params, for `checkpoint.init_from` values with a prefix (the CLI adds "hf:").
ParamSources = dict[str, Callable[[Run], object]]


def describe(run: Run) -> str:
  cfg, m = run.cfg, run.cfg.model
  shape = ", ".join(f"{k} {v}" for k, v in m.axis_sizes().items() if k != "vocab")
  return "\n".join([
      f"model    {m.name} ({m.arch}): {m.n_params / 1e6:,.2f}M params, {shape}",
      f"mesh     {cfg.mesh}: {run.placement.spec.describe()} on "
      f"{run.mesh.size} {jax.devices()[0].platform} device(s)" +
      (f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""),
      f"strategy {cfg.strategy}   precision {run.abstract.policy.name}   optimizer "
      f"{cfg.train.optimizer}   remat {cfg.train.remat}   offload {cfg.train.offload}" +
      (f"   scan unroll {cfg.train.scan_unroll}" if cfg.train.scan_unroll > 1 else "") +
      (f"   LoRA rank {cfg.lora.rank} on {cfg.lora.targets}" if cfg.lora.rank else ""),
      f"batch    {cfg.train.global_batch} × {cfg.train.seq_len} tokens, "
      f"{cfg.train.microbatches} microbatch(es), {cfg.train.steps} steps",
      *schedule.lines(m.n_layers, run.shardings.rules, run.mesh,
                      cfg.train.microbatches, cfg.train.pipeline_repeats,
                      cfg.train.pipeline_schedule),
      f"data     {run.feed.describe()}",
  ])


def compiled_report(run: Run, state, first_batch) -> tuple[object, step_report.StepReport]:
  """The compiled train step and its report (collectives with mesh axes, XLA memory)."""
  compiled = run.train_step.lower(state, first_batch).compile()
  return compiled, step_report.report(compiled, run.mesh)


def _start_state(run: Run, ckpt, progress: Progress, sources: ParamSources,
                 allow_config_change: bool, clock: goodput.Clock):
  """(state, first step, skipped steps, saved progress or None): resumed from `ckpt`, or
  fresh (params from init_from if set)."""
  if ckpt is not None and ckpt.latest_step() is not None:
    with clock.phase("restore"):
      state, saved = ckpt.restore(run.abstract, run.shardings, warn=progress.message,
                                  check_config=resume_check(run.cfg, allow_config_change,
                                                            progress.message))
    progress.message(f"resuming from the checkpoint at step {saved['step']} in {ckpt.directory}")
    return state, int(saved["step"]), int(saved.get("skipped_steps", 0)), saved
  state = init(run)
  source = run.cfg.checkpoint.init_from
  if source:
    prefix, sep, rest = source.partition(":")
    if sep and prefix in sources:
      params, step = sources[prefix](run), 0
    else:
      strict = "checkpoint.strict" if run.cfg.checkpoint.strict else None
      with clock.phase("restore"):
        params, step = checkpoint.restore_params(source, run.abstract, run.shardings, strict,
                                                 progress.message)
    state = state.replace(params=completed(params, state.params, run.abstract, source))
    progress.message(f"initialised params from {source} (step {step}); fresh optimizer state")
  return state, 0, 0, None


def _loop(run: Run, compiled, state, first_step, inputs, ckpt, logger, profile,
          stop_after, guard: NonFiniteGuard, ledger: goodput.Ledger):
  """Steps until the last (or a stop); returns (state, steps done, signal name or None,
  skipped steps). The non-finite counts are fetched only at log steps and before saves
  (there they cost no extra wait), so no checkpoint is written after a non-finite step.
  Its time is productive but for the waits for data, the blocking part of saves and the
  evaluations (goodput phases); the fetches that end a step's wait stay productive."""
  t, config_json, done = run.cfg.train, config_lib.to_dict(run.cfg), first_step
  clock = ledger.clock
  counts = guard.fetch()
  with StopRequest() as stop, clock.phase("productive"):
    for step in range(first_step, t.steps):
      with clock.phase("data_wait"):
        x = inputs.get(step)
      profile.before(step)
      state, metrics = compiled(state, x)
      guard.after_step(metrics)
      done = clock.last_step = step + 1
      profile.after(done, state)
      stopping = stop.due(done) or (stop_after and done - first_step >= stop_after)
      saving = ckpt is not None and ckpt.due(done, bool(stopping) or done == t.steps)
      if logger.due(done) or saving:
        counts = guard.fetch()
        if logger.due(done):
          logger.log(done, metrics, counts)
          ledger.update()
        guard.check(counts, lambda: last_good(ckpt))
        if ckpt is not None:
          with clock.phase("checkpoint"):
            ckpt.check()  # a save that failed in the background ends the run now
      if saving:
        with clock.phase("checkpoint"):
          ckpt.save(state, config_json, _progress(run, done, counts["bad"]), force=True)
      if t.eval_every and done % t.eval_every == 0 and done < t.steps:
        jax.block_until_ready(state)  # the step's own time stays productive
        with clock.phase("eval"):
          _evaluate(run, state, done, logger)
      if stopping:
        break
    if ckpt is not None:
      with clock.phase("checkpoint"):
        ckpt.wait()
  return state, done, stop.signal_name, counts["bad"]


def _compile(run: Run, state, first_batch, progress: Progress, start: float,
             clock: goodput.Clock):
  with Activity("compiling the train step", progress), clock.phase("compile"):
    compiled, report = compiled_report(run, state, first_batch)
  progress.message(f"compiled the train step in {time.perf_counter() - start:.1f} s")
  progress.message("\n".join(step_report.render(report)))
  with Activity("measuring the peak FLOP/s", progress):
    rates = throughput.for_run(run.flops_per_step(), run.mesh.size,
                               list(run.mesh.devices.flat))
  progress.message(f"flops    {rates.describe()}")
  return compiled, report, rates


def train(cfg: Config, quiet: bool = False, fresh: bool = False, overwrite: bool = False,
          stop_after: int | None = None, param_sources: ParamSources | None = None,
          on_finish: Callable[[Run, object, Progress], dict] | None = None,
          allow_config_change: bool = False) -> dict:
  """Runs `cfg` to its last step (or `stop_after` more steps, or a SIGTERM/SIGINT), saving
  and resuming checkpoints when `cfg.checkpoint.dir` is set; returns a summary. A finished
  run reports its held-out loss, then `on_finish(run, state, progress)` adds to it. A resume
  refuses changed settings (config.RESUME_FIELDS) unless `allow_config_change`; a
  non-finite step raises NonFiniteError (train.nonfinite). Its wall time up to the summary
  is split into goodput phases (observe/goodput.py), kept in run_dir across restarts."""
  clock = goodput.Clock()
  # Without a checkpoint directory (or with --fresh) nothing earlier is continued.
  ledger = goodput.Ledger(cfg.run_dir if distributed.is_leader() else None, clock,
                          new_run=fresh or not cfg.checkpoint.dir)
  paths = run_paths(cfg)
  profile = profiling.Window(profiling.parse_steps(cfg.profile_steps, cfg.train.steps),
                             paths.profile)
  run, progress, ckpt = _set_up(cfg, quiet, fresh, overwrite)
  start = time.perf_counter()
  state, first_step, skipped, saved = _start_or_close(
      run, ckpt, progress, param_sources or {}, allow_config_change, clock)
  clock.first_step = clock.last_step = first_step
  if first_step >= cfg.train.steps:
    return nothing_to_train(cfg, first_step, progress, ckpt, ledger)
  inputs = run.inputs(first_step, saved)
  with clock.phase("data_wait"):
    first_batch = inputs.peek(first_step)
  compiled, report, rates = _compile(run, state, first_batch, progress, start, clock)
  ledger.update(force=True)
  logger = Logger(cfg, paths, progress, rates, first_step, inputs)
  guard = NonFiniteGuard(cfg.train, run.mesh, first_step, skipped)
  logger.skipped = skipped  # a resumed run warns only about steps it skips itself
  try:
    state, done, signal, skipped = _loop(run, compiled, state, first_step, inputs, ckpt,
                                         logger, profile, stop_after, guard, ledger)
  except BaseException as error:
    logger.file.close()
    with contextlib.suppress(OSError):  # the error, not a full disk here, is the news
      ledger.end("interrupted" if isinstance(error, KeyboardInterrupt) else "error")
    raise
  finally:
    inputs.close()
    progress.close()
    profile.stop(state)
    if ckpt is not None:
      with clock.phase("checkpoint"):
        ckpt.close()
  # The metrics file stays open for the goodput and the final held-out loss.
  summary = finish(run, state, done - first_step, done, signal, logger, progress, paths,
                   ledger)
  logger.file.close()
  summary["compiled"] = report.as_dict()
  if cfg.train.nonfinite == "skip":
    summary["skipped_steps"] = skipped
  if ckpt is not None:
    summary["checkpoint"] = f"; checkpoint saved at step {done} in {ckpt.directory}"
  report_end(run, summary, profile, progress, start)
  if "held_out_loss" in summary and on_finish is not None:
    summary.update(on_finish(run, state, progress))
  return summary


def _set_up(cfg: Config, quiet: bool, fresh: bool, overwrite: bool):
  """(run, progress bar, Checkpointer or None), the checkpoint directory checked first."""
  if cfg.checkpoint.dir:
    checkpoint.prepare(cfg.checkpoint.dir, fresh, overwrite)
  elif fresh or overwrite:
    raise ConfigError("--fresh and --overwrite need --checkpoint-dir")
  run = setup(cfg)
  progress = Progress(cfg.train.steps, quiet=quiet, silent=not distributed.is_leader())
  progress.message(describe(run))
  for line in idle.warnings(run.shardings.rules, dict(run.mesh.shape)):
    progress.message(line)
  return run, progress, checkpoint.Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir else None


def _start_or_close(run: Run, ckpt, progress: Progress, sources: ParamSources, allow: bool,
                    clock: goodput.Clock):
  """_start_state, closing the bar and the checkpointer if it refuses."""
  try:
    return _start_state(run, ckpt, progress, sources, allow, clock)
  except BaseException:
    progress.close()
    if ckpt is not None:
      ckpt.close()
    raise


def _evaluate(run: Run, state, done: int, logger: Logger) -> None:
  """train.eval_every: the held-out loss now; its time is not counted as step time."""
  start = time.perf_counter()
  logger.evaluated(done, run.held_out_loss(state.params))
  logger.last_time += time.perf_counter() - start


def _progress(run: Run, step: int, skipped: int = 0) -> dict:
  """What a resume needs besides the arrays: the step, the seed, and where the input stands
  (`data`: for packed documents, the rows consumed; data/feed.py)."""
  cfg = run.cfg
  progress = {"step": step, "seed": cfg.train.seed, "data_position": step,
              "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
              "data": run.feed.state(run.position(step))}
  if cfg.train.nonfinite == "skip":
    progress["skipped_steps"] = skipped
  return progress
