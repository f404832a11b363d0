"""The one training loop, for any job: the bundled models' runs (training/loop.py, from a
Config) and your own module's (training/fit.py, `sl.fit`). It owns the progress bar, the
metrics JSONL and TensorBoard, periodic held-out loss, the checkpoint cadence, the save on
SIGTERM/SIGINT, the resume, the non-finite guard, goodput and the end-of-run summary.

A job is what differs between the two; it has (duck-typed, see loop.Bundled, fit.FitJob):
  cfg           the settings: .train (steps, log_every, eval_every), .checkpoint, .run_dir,
                .metrics_file, .profile_steps (a Config, or fit's FitConfig)
  mesh, train_step (jitted; `.lower(state, batch).compile()`), unit (of the loss: "token",
  "byte", or None), title (the plot's)
  describe() -> str                   the lines printed before compiling
  start(ckpt, progress, clock)        (state, first step, skipped steps, saved progress|None)
  inputs(first_step, saved)           a feed.Prefetcher of placed batches by step
  flops_per_step() -> float | None    None: no TFLOP/s or MFU
  tokens_per_step(batch) -> float     the throughput's unit per step
  held_out_loss(params) -> float|None baseline() -> dict (e.g. the unigram loss)
  config_json() -> dict, progress(step, skipped) -> dict   saved beside each checkpoint
  guard(first_step, skipped) -> NonFiniteGuard
"""

import contextlib
import time
from typing import Callable

import jax

from shardlab.errors import ConfigError
from shardlab.observe import goodput, profiling, step_report, throughput, xla_log
from shardlab.observe.progress import Activity, Progress
from shardlab.runtime import distributed
from shardlab.training import checkpoint
from shardlab.training.nonfinite import NonFiniteGuard, last_good
from shardlab.training.preemption import StopRequest
from shardlab.training.reporting import Logger, finish, nothing_to_train, report_end, run_paths


def drive(cfg, build: Callable[[], object], quiet: bool = False, fresh: bool = False,
          overwrite: bool = False, stop_after: int | None = None,
          on_finish: Callable[[object, object, Progress], dict] | None = None):
  """Runs the job `build()` makes (after the checkpoint directory is checked) to
  cfg.train.steps, or `stop_after` more steps, or a SIGTERM/SIGINT; returns (job, final
  state, summary). Its wall time up to the summary is split into goodput phases
  (observe/goodput.py), kept in run_dir across restarts."""
  clock = goodput.Clock()
  # Without a checkpoint directory (or with --fresh) nothing earlier is continued.
  ledger = goodput.Ledger(cfg.run_dir if distributed.is_leader() else None, clock,
                          new_run=fresh or not cfg.checkpoint.dir)
  paths = run_paths(cfg)
  profile = profiling.Window(profiling.parse_steps(cfg.profile_steps, cfg.train.steps),
                             paths.profile)
  job, progress, ckpt = _set_up(cfg, build, quiet, fresh, overwrite)
  start = time.perf_counter()
  state, first_step, skipped, saved = _start_or_close(job, ckpt, progress, clock)
  clock.first_step = clock.last_step = first_step
  if first_step >= cfg.train.steps:
    return job, state, nothing_to_train(cfg, first_step, progress, ckpt, ledger)
  inputs = job.inputs(first_step, saved)
  with clock.phase("data_wait"):
    first_batch = inputs.peek(first_step)
  compiled, report, rates = _compile(job, state, first_batch, progress, start, clock)
  ledger.update(force=True)
  logger = Logger(cfg, paths, progress, rates, first_step, inputs,
                  tokens_per_step=job.tokens_per_step(first_batch))
  guard = job.guard(first_step, skipped)
  logger.skipped = skipped  # a resumed run warns only about steps it skips itself
  try:
    state, done, signal, skipped = _loop(job, compiled, state, first_step, inputs, ckpt,
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
  summary = finish(job, state, done - first_step, done, signal, logger, progress, paths,
                   ledger)
  logger.file.close()
  summary["compiled"] = report.as_dict()
  if cfg.train.nonfinite == "skip":
    summary["skipped_steps"] = skipped
  if ckpt is not None:
    summary["checkpoint"] = f"; checkpoint saved at step {done} in {ckpt.directory}"
  report_end(job, summary, profile, progress, start)
  if "held_out_loss" in summary and on_finish is not None:
    summary.update(on_finish(job, state, progress))
  return job, state, summary


def _loop(job, compiled, state, first_step, inputs, ckpt, logger, profile,
          stop_after, guard: NonFiniteGuard, ledger: goodput.Ledger):
  """Steps until the last (or a stop); returns (state, steps done, signal name or None,
  skipped steps). The non-finite counts are fetched only at log steps and before saves
  (there they cost no extra wait), so no checkpoint is written after a non-finite step.
  Its time is productive but for the waits for data, the blocking part of saves and the
  evaluations (goodput phases); the fetches that end a step's wait stay productive."""
  t, config_json, done = job.cfg.train, job.config_json(), first_step
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
          ckpt.save(state, config_json, job.progress(done, counts["bad"]), force=True)
      if t.eval_every and done % t.eval_every == 0 and done < t.steps:
        jax.block_until_ready(state)  # the step's own time stays productive
        with clock.phase("eval"):
          _evaluate(job, state, done, logger)
      if stopping:
        break
    if ckpt is not None:
      with clock.phase("checkpoint"):
        ckpt.wait()
  return state, done, stop.signal_name, counts["bad"]


class NoFlops:
  """The throughput figures of a job whose FLOPs per step are not known: none."""

  def record(self, step_time_s: float) -> dict:
    return {}

  def describe(self) -> str:
    return "unknown FLOPs per step: no TFLOP/s or MFU (give flops_per_step)"


def _compile(job, state, first_batch, progress: Progress, start: float,
             clock: goodput.Clock):
  # XLA's involuntary-rematerialisation warnings: one line naming the layout, the
  # partitioner's screenfuls kept in the run dir's xla.log (observe/xla_log.py).
  began = time.perf_counter()
  with Activity("compiling the train step", progress), clock.phase("compile"), \
       xla_log.quiet_remat(job.title, job.cfg.run_dir, progress.message):
    compiled = job.train_step.lower(state, first_batch).compile()
    report = step_report.report(compiled, job.mesh)
  now = time.perf_counter()
  # The compile's own time (goodput's "compilation"), then the whole wait before it.
  progress.message(f"compiled the train step in {now - began:.1f} s ({now - start:.1f} s "
                   f"since the run began, the state's init and the first batch included)")
  progress.message("\n".join(step_report.render(report)))
  flops = job.flops_per_step()
  if flops is None:
    rates = NoFlops()
  else:
    with Activity("measuring the peak FLOP/s", progress):
      rates = throughput.for_run(flops, job.mesh.size, list(job.mesh.devices.flat))
  progress.message(f"flops    {rates.describe()}")
  return compiled, report, rates


def _set_up(cfg, build: Callable[[], object], quiet: bool, fresh: bool, overwrite: bool):
  """(job, progress bar, Checkpointer or None), the checkpoint directory checked first."""
  if cfg.checkpoint.dir:
    checkpoint.prepare(cfg.checkpoint.dir, fresh, overwrite)
  elif fresh or overwrite:
    raise ConfigError("--fresh and --overwrite need --checkpoint-dir")
  job = build()
  progress = Progress(cfg.train.steps, quiet=quiet, silent=not distributed.is_leader())
  progress.message(job.describe())
  return job, progress, checkpoint.Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir else None


def _start_or_close(job, ckpt, progress: Progress, clock: goodput.Clock):
  """job.start, closing the bar and the checkpointer if it refuses."""
  try:
    return job.start(ckpt, progress, clock)
  except BaseException:
    progress.close()
    if ckpt is not None:
      ckpt.close()
    raise


def _evaluate(job, state, done: int, logger: Logger) -> None:
  """train.eval_every: the held-out loss now; its time is not counted as step time."""
  start = time.perf_counter()
  loss = job.held_out_loss(state.params)
  if loss is not None:
    logger.evaluated(done, loss)
  logger.last_time += time.perf_counter() - start
