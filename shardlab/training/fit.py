"""`sl.fit`: your own module, loss and data through the loop `train.py` runs (driver.py):
the progress bar, metrics JSONL, TensorBoard, plot, periodic held-out loss, checkpoint
cadence, the save on SIGTERM/SIGINT, exact resume (the data position included, see
fit_data.py), goodput and the end-of-run summary.
"""

import dataclasses
import math
from typing import Callable

import jax
import numpy as np
import optax

from shardlab.config import CheckpointConfig, TrainConfig
from shardlab.errors import ConfigError
from shardlab.observe import goodput
from shardlab.observe.progress import Progress
from shardlab.sharding import idle
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.data import feed as feed_lib
from shardlab.training import driver, fit_data
from shardlab.training import state as state_lib
from shardlab.training import step as step_lib
from shardlab.training.nonfinite import NonFiniteGuard


@dataclasses.dataclass(frozen=True)
class FitConfig:
  """A fit's run settings, in the sections the loop reads from a Config. Of `train`, only
  steps, log_every, eval_every, microbatches, nonfinite and max_skipped apply."""
  train: TrainConfig
  checkpoint: CheckpointConfig
  run_dir: str | None = None
  metrics_file: str | None = None
  profile_steps: str | None = None
  loggers: str = "tensorboard"  # observe/trackers.py: comma-separated, or "none"


def _settings(steps, log_every, eval_every, microbatches, nonfinite, max_skipped,
              checkpoint_dir, checkpoint_every, checkpoint_keep, run_dir,
              profile_steps, loggers) -> FitConfig:
  """The settings, validated by the Config sections' own checks, errors named as fit's
  arguments. global_batch and seq_len are placeholders: fit counts tokens itself."""
  try:
    train = TrainConfig(steps=steps, log_every=log_every, eval_every=eval_every,
                        microbatches=microbatches, global_batch=microbatches, seq_len=1,
                        nonfinite=nonfinite, max_skipped=max_skipped)
    ckpt = CheckpointConfig(dir=checkpoint_dir, every=checkpoint_every, keep=checkpoint_keep)
  except ConfigError as error:
    text = str(error).replace("train.", "").replace("checkpoint.", "checkpoint_")
    raise ConfigError(f"sl.fit: {text}") from None
  return FitConfig(train, ckpt, run_dir, None, profile_steps, loggers)


class _Guard(NonFiniteGuard):
  """The non-finite guard, its advice in fit's terms (no train.lr here)."""

  def message(self, counts: dict, newest: str) -> str:
    text = super().message(counts, newest)
    text = text[:text.index(" Training diverged")]
    other = "; or pass nonfinite='skip' to skip such steps" if self.cfg.nonfinite == "stop" else ""
    return (text.replace("train.", "") + " Training diverged: lower the optimizer's "
            f"learning rate or warm it up{other}")


class FitJob:
  """Your module as a job of the one loop (driver.py's contract)."""

  def __init__(self, cfg: FitConfig, abstract: state_lib.Abstract,
               shardings: state_lib.Shardings, loss_fn, data, eval_data, lr_schedule,
               name: str, strategy: str, flops_per_step, tokens_per_step, prefetch: int):
    self.cfg, self.abstract, self.shardings = cfg, abstract, shardings
    self.mesh, self.unit = shardings.mesh, None
    self.title = f"{name} {strategy} on {_mesh_text(self.mesh)}"
    self.name, self.strategy = name, strategy
    self.source = fit_data.source(data, bool(cfg.checkpoint.dir))
    self.eval_data, self.prefetch = eval_data, prefetch
    self._flops, self._tokens = flops_per_step, tokens_per_step
    m = cfg.train.microbatches
    self.train_step = step_lib.make_train_step(loss_fn, abstract, shardings, microbatches=m,
                                               lr_schedule=lr_schedule,
                                               nonfinite=cfg.train.nonfinite)
    self.eval_step = (None if eval_data is None else
                      step_lib.make_eval_step(loss_fn, abstract, shardings, microbatches=m))
    self._placed_eval = None

  def describe(self) -> str:
    params = jax.tree.leaves(self.abstract.state.params)
    n = sum(math.prod(p.shape) for p in params)
    t = self.cfg.train
    return "\n".join([
        f"model    {self.name}: {n / 1e6:,.3f}M params in {len(params)} arrays",
        f"mesh     {_mesh_text(self.mesh)} on {self.mesh.size} "
        f"{jax.devices()[0].platform} device(s)",
        f"strategy {self.strategy}   precision {self.abstract.policy.name}   "
        f"{t.microbatches} microbatch(es), {t.steps} steps",
        f"data     {self.source.kind}" +
        ("" if self.eval_data is None else "; held-out batches for eval"),
        *idle.warnings(self.shardings.rules, dict(self.mesh.shape))])

  def start(self, ckpt, progress: Progress, clock: goodput.Clock):
    if ckpt is not None and ckpt.latest_step() is not None:
      with clock.phase("restore"):
        state, saved = ckpt.restore(self.abstract, self.shardings, warn=progress.message)
      progress.message(f"resuming from the checkpoint at step {saved['step']} in "
                       f"{ckpt.directory}")
      return state, int(saved["step"]), int(saved.get("skipped_steps", 0)), saved
    return state_lib.init_state(self.abstract, self.shardings), 0, 0, None

  def inputs(self, first_step: int, saved: dict | None) -> feed_lib.Prefetcher:
    self.source.start(saved)
    produce = lambda step: fit_data.place(self.source.produce(step), self.shardings.batch)
    return feed_lib.Prefetcher(produce, first_step, self.prefetch)

  def flops_per_step(self) -> float | None:
    return self._flops

  def tokens_per_step(self, batch) -> float:
    return self._tokens or jax.tree.leaves(batch)[0].shape[0]

  def held_out_loss(self, params) -> float | None:
    if self.eval_step is None:
      return None
    batches = fit_data.eval_batches(self.eval_data)
    if isinstance(batches, (list, tuple)):  # placed once, reused at every evaluation
      if self._placed_eval is None:
        self._placed_eval = [fit_data.place(b, self.shardings.batch) for b in batches]
      placed = self._placed_eval
    else:
      placed = (fit_data.place(b, self.shardings.batch) for b in batches)
    losses = [self.eval_step(params, b) for b in placed]
    if not losses:
      raise ConfigError("sl.fit: eval_data gave no batches")
    return float(np.mean(jax.device_get(losses)))

  def baseline(self) -> dict:
    return {}

  def config_json(self) -> dict:
    return {"fit": {"name": self.name, "strategy": self.strategy,
                    "mesh": dict(self.mesh.shape), **dataclasses.asdict(self.cfg)}}

  def progress(self, step: int, skipped: int = 0) -> dict:
    progress = {"step": step, "data_position": step, "data": self.source.state(step)}
    if self.cfg.train.nonfinite == "skip":
      progress["skipped_steps"] = skipped
    return progress

  def guard(self, first_step: int, skipped: int) -> NonFiniteGuard:
    return _Guard(self.cfg.train, self.mesh, first_step, skipped)


def _module_name(abstract: state_lib.Abstract) -> str:
  """The module's class name, from its graph definition."""
  node = getattr(abstract.graphdef, "nodes", [None])[0]
  return getattr(getattr(node, "metadata", None), "__name__", None) or "model"


def _mesh_text(mesh) -> str:
  return ",".join(f"{k}:{v}" for k, v in mesh.shape.items())


def _placement(model, optimizer, precision, mesh, strategy, shardings):
  """(abstract state, shardings, strategy's name) from fit's arguments."""
  if isinstance(model, state_lib.Abstract):
    if optimizer is not None:
      raise ConfigError("sl.fit: model is an abstract state, which holds its optimizer "
                        "already; pass optimizer=None")
    abstract = model
  elif callable(model):
    if optimizer is None:
      raise ConfigError("sl.fit: optimizer is required with a model factory (an optax "
                        "GradientTransformation, e.g. optax.adamw(1e-3))")
    abstract = state_lib.abstract_state(model, optimizer, precision)
  else:
    raise ConfigError(f"sl.fit: model must be a factory () -> nnx.Module or "
                      f"sl.abstract_state(...), got {type(model).__name__}")
  if shardings is not None:
    return abstract, shardings, "given shardings"
  if mesh is None:
    raise ConfigError("sl.fit: give a mesh (sl.mesh(...) or its text, e.g. 'fsdp:4,"
                      "tensor:2') and a strategy, or shardings")
  mesh = mesh_lib.make(mesh) if isinstance(mesh, str) else mesh
  rules = rules_lib.strategy(strategy) if isinstance(strategy, str) else strategy
  name = strategy if isinstance(strategy, str) else "custom rules"
  return abstract, state_lib.shardings(abstract, rules, mesh), name


def fit(model, loss_fn: Callable, optimizer: optax.GradientTransformation | None, data, *,
        steps: int, mesh=None, strategy="fsdp", shardings: state_lib.Shardings | None = None,
        precision: str = "fp32", microbatches: int = 1,
        lr_schedule: optax.Schedule | None = None, eval_data=None, eval_every: int = 0,
        log_every: int = 10, run_dir: str | None = None, loggers: str = "tensorboard",
        checkpoint_dir: str | None = None, checkpoint_every: int = 100,
        checkpoint_keep: int = 3, nonfinite: str = "stop", max_skipped: int = 10,
        prefetch: int = 2, tokens_per_step: float | None = None,
        flops_per_step: float | None = None, profile_steps: str | None = None,
        name: str | None = None, quiet: bool = False, fresh: bool = False,
        overwrite: bool = False, stop_after: int | None = None):
  """Trains `model` (a factory () -> nnx.Module, or sl.abstract_state(...) with
  optimizer=None) on `loss_fn(model, batch) -> loss | (loss, metrics)` for `steps` steps;
  returns (final TrainState, summary dict). `data`: a function batch(step) -> batch, or an
  iterator (with state()/restore(state) when checkpointing; fit_data.py). Placement: `mesh`
  (a jax Mesh or its text) and `strategy` (a name or sl.strategy(...)), or `shardings`.
  `eval_data` (a list of batches, or () -> iterable of them): the held-out loss every
  `eval_every` steps (0: only at the end) and at the end. `run_dir`: metrics.jsonl,
  TensorBoard events, plot.png, goodput; `loggers`: "tensorboard,wandb,mlflow" (any of them,
  or "none"), as train.py's --logger. `checkpoint_dir`: saves every `checkpoint_every`
  steps, the last step and on SIGTERM/SIGINT, and a rerun resumes from the newest
  (`fresh=True, overwrite=True` start over). `lr_schedule`: logged as lr (and given to the
  step; the optimizer uses its own). tok/s counts `tokens_per_step` (default: the batch's
  rows); MFU needs `flops_per_step` (model FLOPs, all devices). `stop_after`: stop (and save)
  after that many steps of this call."""
  if eval_every and eval_data is None:
    raise ConfigError(f"sl.fit: eval_every={eval_every} needs eval_data (held-out batches)")
  if prefetch < 0:
    raise ConfigError(f"sl.fit: prefetch must be >= 0 (batches built ahead), got {prefetch}")
  cfg = _settings(steps, log_every, eval_every, microbatches, nonfinite, max_skipped,
                  checkpoint_dir, checkpoint_every, checkpoint_keep, run_dir, profile_steps,
                  loggers)

  def build() -> FitJob:
    abstract, sh, strategy_name = _placement(model, optimizer, precision, mesh, strategy,
                                             shardings)
    label = name or _module_name(abstract)
    return FitJob(cfg, abstract, sh, loss_fn, data, eval_data, lr_schedule, label,
                  strategy_name, flops_per_step, tokens_per_step, prefetch)

  _, state, summary = driver.drive(cfg, build, quiet, fresh, overwrite, stop_after)
  return state, summary
