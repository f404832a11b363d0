"""The training loop: set up a run from a Config, train, checkpoint, report held-out loss."""

import time
from typing import Callable

import jax

from shardlab import config as config_lib
from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.observe import plots, profiling, step_report, throughput
from shardlab.observe.progress import Activity, Progress
from shardlab.runtime import distributed
from shardlab.sharding import idle
from shardlab.training import checkpoint, schedule
from shardlab.training.preemption import StopRequest
from shardlab.training.reporting import Logger, RunPaths, run_paths
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
                 allow_config_change: bool = False):
  """(state, first step, skipped steps, saved progress or None): resumed from `ckpt`, or
  fresh (params from init_from if set)."""
  if ckpt is not None and ckpt.latest_step() is not None:
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
      params, step = checkpoint.restore_params(source, run.abstract, run.shardings, strict,
                                               progress.message)
    state = state.replace(params=completed(params, state.params, run.abstract, source))
    progress.message(f"initialised params from {source} (step {step}); fresh optimizer state")
  return state, 0, 0, None


def _loop(run: Run, compiled, state, first_step, inputs, ckpt, logger, profile,
          stop_after, guard: NonFiniteGuard):
  """Steps until the last (or a stop); returns (state, steps done, signal name or None,
  skipped steps). The non-finite counts are fetched only at log steps and before saves
  (there they cost no extra wait), so no checkpoint is written after a non-finite step."""
  t, config_json, done = run.cfg.train, config_lib.to_dict(run.cfg), first_step
  counts = guard.fetch()
  with StopRequest() as stop:
    for step in range(first_step, t.steps):
      x = inputs.get(step)
      profile.before(step)
      state, metrics = compiled(state, x)
      guard.after_step(metrics)
      done = step + 1
      profile.after(done, state)
      stopping = stop.due(done) or (stop_after and done - first_step >= stop_after)
      saving = ckpt is not None and ckpt.due(done, bool(stopping) or done == t.steps)
      if logger.due(done) or saving:
        counts = guard.fetch()
        if logger.due(done):
          logger.log(done, metrics, counts)
        guard.check(counts, lambda: last_good(ckpt))
        if ckpt is not None:
          ckpt.check()  # a save that failed in the background ends the run now
      if saving:
        ckpt.save(state, config_json, _progress(run, done, counts["bad"]), force=True)
      if t.eval_every and done % t.eval_every == 0 and done < t.steps:
        _evaluate(run, state, done, logger)
      if stopping:
        break
    if ckpt is not None:
      ckpt.wait()
  return state, done, stop.signal_name, counts["bad"]


def _compile(run: Run, state, first_batch, progress: Progress, start: float):
  with Activity("compiling the train step", progress):
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
  non-finite step raises NonFiniteError (train.nonfinite)."""
  paths = run_paths(cfg)
  profile = profiling.Window(profiling.parse_steps(cfg.profile_steps, cfg.train.steps),
                             paths.profile)
  if cfg.checkpoint.dir:
    checkpoint.prepare(cfg.checkpoint.dir, fresh, overwrite)
  elif fresh or overwrite:
    raise ConfigError("--fresh and --overwrite need --checkpoint-dir")
  run = setup(cfg)
  progress = Progress(cfg.train.steps, quiet=quiet, silent=not distributed.is_leader())
  progress.message(describe(run))
  for line in idle.warnings(run.shardings.rules, dict(run.mesh.shape)):
    progress.message(line)
  ckpt = checkpoint.Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir else None
  start = time.perf_counter()
  state, first_step, skipped, saved = _start_or_close(run, ckpt, progress,
                                                      param_sources or {}, allow_config_change)
  if first_step >= cfg.train.steps:
    return _nothing_to_train(cfg, first_step, progress, ckpt)
  inputs = run.inputs(first_step, saved)
  compiled, report, rates = _compile(run, state, inputs.peek(first_step), progress, start)
  logger = Logger(cfg, paths, progress, rates, first_step, inputs)
  guard = NonFiniteGuard(cfg.train, run.mesh, first_step, skipped)
  logger.skipped = skipped  # a resumed run warns only about steps it skips itself
  try:
    state, done, signal, skipped = _loop(run, compiled, state, first_step, inputs, ckpt,
                                         logger, profile, stop_after, guard)
  except BaseException:
    logger.file.close()
    raise
  finally:
    inputs.close()
    progress.close()
    profile.stop(state)
    if ckpt is not None:
      ckpt.close()
  # The metrics file stays open for the final held-out loss.
  summary = _finish(run, state, done - first_step, done, signal, logger, progress, paths)
  logger.file.close()
  summary["compiled"] = report.as_dict()
  if cfg.train.nonfinite == "skip":
    summary["skipped_steps"] = skipped
  if ckpt is not None:
    summary["checkpoint"] = f"; checkpoint saved at step {done} in {ckpt.directory}"
  _report_end(run, summary, profile, progress, start)
  if "held_out_loss" in summary and on_finish is not None:
    summary.update(on_finish(run, state, progress))
  return summary


def _start_or_close(run: Run, ckpt, progress: Progress, sources: ParamSources, allow: bool):
  """_start_state, closing the bar and the checkpointer if it refuses."""
  try:
    return _start_state(run, ckpt, progress, sources, allow)
  except BaseException:
    progress.close()
    if ckpt is not None:
      ckpt.close()
    raise


def _nothing_to_train(cfg: Config, step: int, progress: Progress, ckpt) -> dict:
  """A resume whose checkpoint is already at (or past) train.steps: say so, train nothing."""
  progress.message(f"checkpoint at step {step} already reached train.steps "
                   f"{cfg.train.steps}: nothing to train (raise --steps to train further)")
  progress.close()
  if ckpt is not None:
    ckpt.close()
  return {"steps_done": step, "steps_this_run": 0, "stopped_by": None,
          "nothing_to_train": True}


def _finish(run: Run, state, ran: int, done: int, signal, logger: Logger,
            progress: Progress, paths: RunPaths) -> dict:
  record = logger.record
  summary = {"steps_done": done, "final_loss": record.get("loss"),
             "tokens_per_s": record.get("tokens_per_s"), "mfu": record.get("mfu"),
             "tflops_per_device": record.get("tflops_per_device"), "stopped_by": signal,
             "steps_this_run": ran}
  if not signal and done >= run.cfg.train.steps:
    summary["held_out_loss"] = run.held_out_loss(state.params)
    summary["unigram_loss"] = run.feed.unigram_loss()
    # The same record as train.eval_every's, so the JSONL and the plot end with it.
    logger.file.write({"step": done, "eval_loss": summary["held_out_loss"]})
    if logger.events:
      logger.events.write({"step": done, "held_out_loss": summary["held_out_loss"]},
                          prefix="eval/")
  if logger.events:
    logger.events.close()
  cfg = run.cfg
  if paths.plot and distributed.is_leader() and plots.write(
      paths.metrics, paths.plot, f"{cfg.model.name} {cfg.strategy} on {cfg.mesh}",
      run.feed.unit):
    summary["plot"] = paths.plot
    progress.message(f"plot of loss and throughput written to {paths.plot}")
  return summary


def _report_end(run: Run, summary: dict, profile, progress: Progress, start: float) -> None:
  where = summary.pop("checkpoint", "")
  if profile.written:
    progress.message(f"profile of steps {profile.steps[0] + 1}-{profile.steps[1]} written to "
                     f"{profile.written} (view: tensorboard --logdir {run.cfg.run_dir}, with "
                     f"xprof installed)")
  if summary["stopped_by"]:
    progress.message(f"received {summary['stopped_by']}: stopped after step "
                     f"{summary['steps_done']}{where}")
  elif "held_out_loss" not in summary:
    progress.message(f"stopped after {summary['steps_this_run']} steps (--stop-after){where}")
  else:
    summary["wall_s"] = time.perf_counter() - start
    progress.message(f"held-out loss {summary['held_out_loss']:.4f} nats/{run.feed.unit} (unigram "
                     f"baseline {summary['unigram_loss']:.4f}) after {run.cfg.train.steps} "
                     f"steps in {summary['wall_s']:.0f} s{where}")


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
