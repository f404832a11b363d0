"""Where a run writes, the logger of its steps (metrics JSONL, TensorBoard, progress bar with
the time each step waited for input, held-out evaluations), and the end of a run: its
summary, plot and goodput (observe/goodput.py)."""

import dataclasses
import time
from pathlib import Path

import jax

from shardlab.config import Config
from shardlab.observe import goodput, plots, trackers
from shardlab.observe.metrics import MetricsWriter
from shardlab.observe.progress import Progress
from shardlab.runtime import distributed


@dataclasses.dataclass(frozen=True)
class RunPaths:
  """Where a run writes: the JSONL always beside the rest when run_dir is set."""
  metrics: str | None
  events: str | None
  plot: str | None
  profile: str | None


def run_paths(cfg: Config) -> RunPaths:
  trackers.names(cfg)  # --logger checked before any device work
  if not cfg.run_dir:
    return RunPaths(cfg.metrics_file, None, None, None)
  d = Path(cfg.run_dir)
  return RunPaths(cfg.metrics_file or str(d / "metrics.jsonl"), str(d), str(d / "plot.png"),
                  str(d / "profile"))


class Logger:
  """Metrics of every logged step to the JSONL, TensorBoard and the progress bar.
  `inputs` (a feed.Prefetcher) adds input_wait_s: the mean time a step waited for its batch.
  `cfg`: the run's settings (a Config, or sl.fit's FitConfig: .train's log_every and steps);
  `tokens_per_step` (default train.global_batch × train.seq_len) gives tokens_per_s."""

  def __init__(self, cfg: Config, paths: RunPaths, progress: Progress, rates, first: int,
               inputs=None, tokens_per_step: float | None = None):
    leader = distributed.is_leader()  # the other processes train silently
    self.file = MetricsWriter(paths.metrics if leader else None)
    self.events = trackers.open(cfg, paths.events) if leader else None  # TensorBoard, W&B, ...
    self.progress, self.rates, self.cfg, self.inputs = progress, rates, cfg, inputs
    self.last_time, self.last_step, self.record = time.perf_counter(), first, {}
    self.skipped, self.last_wait = 0, 0.0 if inputs is None else inputs.wait_s
    self.tokens_per_step = (cfg.train.global_batch * cfg.train.seq_len
                            if tokens_per_step is None else tokens_per_step)

  def due(self, done: int) -> bool:
    # Step 1 too: the first line shows the run training (its loss, its first step's time,
    # with the first run's own overheads) as soon as one step has run, not log_every later.
    return done == 1 or done % self.cfg.train.log_every == 0 or done == self.cfg.train.steps

  def log(self, done: int, metrics, counts: dict) -> None:
    """Writes the step's metrics; `counts` (NonFiniteGuard's) turn the per-step `skipped`
    flag into the run's total."""
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "finite"}
    if "skipped" in metrics:
      metrics["skipped"] = counts["bad"]
      if counts["bad"] > self.skipped:
        self.progress.message(f"warning: {counts['bad']} non-finite step(s) skipped so far "
                              f"(train.nonfinite=skip), the last at step {counts['last']}")
      self.skipped = counts["bad"]
    now = time.perf_counter()
    step_time = (now - self.last_time) / (done - self.last_step)
    if self.inputs is not None:
      wait, self.last_wait = self.inputs.wait_s - self.last_wait, self.inputs.wait_s
      metrics["input_wait_s"] = wait / (done - self.last_step)
    self.record = {"step": done, **metrics,
                   "tokens_per_s": self.tokens_per_step / step_time,
                   "step_time_s": step_time, **self.rates.record(step_time)}
    self.file.write(self.record)
    if self.events:
      self.events.write(self.record)
    self.progress.update(self.record)
    self.last_time, self.last_step = now, done

  def evaluated(self, done: int, loss: float) -> None:
    """A held-out loss (train.eval_every): its own JSONL line, eval/ in TensorBoard."""
    self.file.write({"step": done, "eval_loss": loss})
    if self.events:
      self.events.write({"step": done, "held_out_loss": loss}, prefix="eval/")
    self.progress.message(f"step {done}: held-out loss {loss:.4f}")


def nothing_to_train(cfg: Config, step: int, progress: Progress, ckpt,
                     ledger: goodput.Ledger) -> dict:
  """A resume whose checkpoint is already at (or past) train.steps: say so, train nothing."""
  progress.message(f"checkpoint at step {step} already reached train.steps "
                   f"{cfg.train.steps}: nothing to train (raise --steps to train further)")
  progress.close()
  if ckpt is not None:
    ckpt.close()
  return {"steps_done": step, "steps_this_run": 0, "stopped_by": None,
          "nothing_to_train": True, "goodput": ledger.end("nothing to train").as_dict()}


def finish(job, state, ran: int, done: int, signal, logger: Logger, progress: Progress,
           paths: RunPaths, ledger: goodput.Ledger) -> dict:
  """The end of a run (finished or stopped): the held-out loss if finished (and the job has
  held-out data), the plot, and the goodput, which closes the invocation's clock: its record
  goes to the metrics file before the final held-out loss (the file's last line, as
  train.eval_every's losses). `job`: training/driver.py's."""
  record, clock = logger.record, ledger.clock
  summary = {"steps_done": done, "final_loss": record.get("loss"),
             "tokens_per_s": record.get("tokens_per_s"), "mfu": record.get("mfu"),
             "tflops_per_device": record.get("tflops_per_device"), "stopped_by": signal,
             "steps_this_run": ran}
  final = []
  finished = not signal and done >= job.cfg.train.steps
  if finished:
    with clock.phase("eval"):
      loss = job.held_out_loss(state.params)
      if loss is not None:
        summary["held_out_loss"] = loss
        summary.update(job.baseline())
    # The same record as train.eval_every's, so the JSONL and the plot end with it.
    final = [] if loss is None else [{"step": done, "eval_loss": loss}]
  if paths.plot and distributed.is_leader() and _plot(paths, final, job.title, job.unit):
    summary["plot"] = paths.plot
    progress.message(f"plot of loss and throughput written to {paths.plot}")
  status = signal or ("finished" if finished else "stopped")
  good = ledger.end(status)
  summary["goodput"], summary["goodput_line"] = good.as_dict(), good.line()
  for line in [{"step": done, **good.metrics()}] + final:
    logger.file.write(line)
  if logger.events:
    logger.events.write({"step": done, **good.scalars()}, prefix="goodput/")
    if final:
      logger.events.write({"step": done, "held_out_loss": summary["held_out_loss"]},
                          prefix="eval/")
    logger.events.close()
  return summary


def _plot(paths: RunPaths, final: list[dict], title: str, unit: str | None) -> bool:
  """plot.png from the metrics file and the final held-out loss (not written yet: the
  goodput record, which counts the plot's time, goes before it). `unit` None: a loss that
  is not nats per token (your own module's), labelled "loss"."""
  fig = plots.figure(plots.read_jsonl(paths.metrics) + final, title, unit or "token")
  if fig is None:
    return False
  if unit is None:
    fig.axes[0].set_ylabel("loss")
  import matplotlib.pyplot as plt
  Path(paths.plot).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(paths.plot, dpi=100)
  plt.close(fig)
  return True


def report_end(job, summary: dict, profile, progress: Progress, start: float) -> None:
  """The closing lines: where the checkpoint and profile are, the held-out loss, goodput."""
  where = summary.pop("checkpoint", "")
  if profile.written:
    progress.message(f"profile of steps {profile.steps[0] + 1}-{profile.steps[1]} written to "
                     f"{profile.written} (view: tensorboard --logdir {job.cfg.run_dir}, with "
                     f"xprof installed)")
  if summary["stopped_by"]:
    progress.message(f"received {summary['stopped_by']}: stopped after step "
                     f"{summary['steps_done']}{where}")
  elif summary["steps_done"] < job.cfg.train.steps:
    progress.message(f"stopped after {summary['steps_this_run']} steps (--stop-after){where}")
  else:
    summary["wall_s"] = time.perf_counter() - start
    steps = f"after {job.cfg.train.steps} steps in {summary['wall_s']:.0f} s{where}"
    if "held_out_loss" not in summary:
      progress.message(f"final loss {summary['final_loss']:.4f} {steps}")
    else:
      unit = f" nats/{job.unit}" if job.unit else ""
      base = (f" (unigram baseline {summary['unigram_loss']:.4f})"
              if "unigram_loss" in summary else "")
      progress.message(f"held-out loss {summary['held_out_loss']:.4f}{unit}{base} {steps}")
  progress.message(summary.pop("goodput_line"))
