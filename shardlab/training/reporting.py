"""Where a run writes, and the logger of its steps: metrics JSONL, TensorBoard, progress bar
(with the time each step waited for input), and held-out evaluations."""

import dataclasses
import time
from pathlib import Path

import jax

from shardlab.config import Config
from shardlab.observe.metrics import EventWriter, MetricsWriter
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
  if not cfg.run_dir:
    return RunPaths(cfg.metrics_file, None, None, None)
  d = Path(cfg.run_dir)
  return RunPaths(cfg.metrics_file or str(d / "metrics.jsonl"), str(d), str(d / "plot.png"),
                  str(d / "profile"))


class Logger:
  """Metrics of every logged step to the JSONL, TensorBoard and the progress bar.
  `inputs` (a feed.Prefetcher) adds input_wait_s: the mean time a step waited for its batch."""

  def __init__(self, cfg: Config, paths: RunPaths, progress: Progress, rates, first: int,
               inputs=None):
    leader = distributed.is_leader()  # the other processes train silently
    self.file = MetricsWriter(paths.metrics if leader else None)
    self.events = EventWriter(paths.events) if paths.events and leader else None
    self.progress, self.rates, self.cfg, self.inputs = progress, rates, cfg, inputs
    self.last_time, self.last_step, self.record = time.perf_counter(), first, {}
    self.skipped, self.last_wait = 0, 0.0 if inputs is None else inputs.wait_s

  def due(self, done: int) -> bool:
    return done % self.cfg.train.log_every == 0 or done == self.cfg.train.steps

  def log(self, done: int, metrics, counts: dict) -> None:
    """Writes the step's metrics; `counts` (NonFiniteGuard's) turn the per-step `skipped`
    flag into the run's total."""
    t = self.cfg.train
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
                   "tokens_per_s": t.global_batch * t.seq_len / step_time,
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
