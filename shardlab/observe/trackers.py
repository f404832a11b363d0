"""Experiment trackers (`--logger tensorboard,wandb,mlflow`, Config.loggers): the scalars the
metrics JSONL holds, under TensorBoard's `train/`, `eval/` and `goodput/` names, and the
resolved config once at the start (W&B's config, MLflow's params). Each writer has
EventWriter's interface (`write(record, prefix)`, `close()`); `open` builds them as one.

W&B and MLflow are optional (`pip install 'shardlab[trackers]'`) and imported only when
named. W&B reads its own environment (WANDB_MODE=offline, WANDB_PROJECT, WANDB_NAME, ...);
MLflow writes to MLFLOW_TRACKING_URI, else to a local SQLite store in the run directory
(RUN_DIR/mlflow.db, no server), which `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`
shows. MLflow 3's file store (./mlruns) is refused by MLflow itself unless opted into."""

import dataclasses
import json
import math
import os
import time
from pathlib import Path

from shardlab.errors import ConfigError, suggest

NAMES = ("tensorboard", "wandb", "mlflow")
EXTRA = "pip install 'shardlab[trackers]'"  # wandb, mlflow-skinny and MLflow's SQLite store
PROJECT = "shardlab"  # W&B project and MLflow experiment unless the environment names one


def names(cfg) -> tuple[str, ...]:
  """The trackers `cfg.loggers` names, checked (before any device work): known names, and
  what each needs (W&B a run directory; MLflow a run directory or MLFLOW_TRACKING_URI).
  `cfg`: a Config, or any settings object (without `loggers`: TensorBoard, as before)."""
  loggers, run_dir = getattr(cfg, "loggers", "tensorboard"), getattr(cfg, "run_dir", None)
  given = tuple(n.strip() for n in loggers.split(",") if n.strip())
  if given == ("none",):
    return ()
  if "none" in given:
    raise ConfigError(f"loggers: none means the metrics JSONL only, so it stands alone, got "
                      f"{loggers!r}")
  for name in given:
    if name not in NAMES:
      raise ConfigError(f"loggers: unknown logger {name!r} in {loggers!r}"
                        f"{suggest(name, NAMES)}; valid: {', '.join(NAMES)} (comma-separated), "
                        f"or none (the metrics JSONL only)")
  if not given:
    raise ConfigError(f"loggers is empty ({loggers!r}); name some of {', '.join(NAMES)}, "
                      f"or none")
  if "wandb" in given and not run_dir:
    raise ConfigError("--logger wandb needs --run-dir (run_dir): W&B keeps its run files in "
                      "RUN_DIR/wandb")
  if "mlflow" in given and not (run_dir or os.environ.get("MLFLOW_TRACKING_URI")):
    raise ConfigError("--logger mlflow needs --run-dir (run_dir: a local store in "
                      "RUN_DIR/mlflow.db) or MLFLOW_TRACKING_URI (a server or store to use)")
  return tuple(dict.fromkeys(given))


def open(cfg, logdir: str | None):
  """The trackers `cfg.loggers` names, as one writer (None if there are none): TensorBoard's
  event files in `logdir` (the run directory; none without one, as before trackers)."""
  from shardlab.observe.metrics import EventWriter

  writers = []
  for name in names(cfg):
    if name == "tensorboard" and logdir:
      writers.append(EventWriter(logdir))
    elif name == "wandb":
      writers.append(WandbWriter(cfg))
    elif name == "mlflow":
      writers.append(MlflowWriter(cfg))
  return Trackers(writers) if writers else None


class Trackers:
  """Several writers as one, in EventWriter's interface."""

  def __init__(self, writers: list):
    self.writers = writers

  def write(self, record: dict, prefix: str = "train/") -> None:
    for writer in self.writers:
      writer.write(record, prefix)

  def close(self) -> None:
    for writer in self.writers:
      writer.close()


def scalars(record: dict, prefix: str) -> dict[str, float]:
  """TensorBoard's selection: every finite number but the step, named `prefix + key`."""
  return {prefix + k: float(v) for k, v in record.items()
          if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


def settings(cfg) -> dict:
  """The resolved config as a nested dict (any dataclass of settings; else none)."""
  return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}


def params(cfg) -> dict[str, str]:
  """The resolved config flat, as MLflow params: {"train.lr": "0.003", "mesh": "cpu-8"}."""
  out = {}

  def walk(tree: dict, prefix: str) -> None:
    for key, value in tree.items():
      if isinstance(value, dict) and value:
        walk(value, f"{prefix}{key}.")
      else:
        out[prefix + key] = value if isinstance(value, str) else json.dumps(value)

  walk(json.loads(json.dumps(settings(cfg), default=str)), "")
  return out


def _require(module: str, name: str):
  import importlib
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ConfigError(f"--logger {name} needs the {module.split('.')[0]} package, which is "
                      f"not installed ({e}): {EXTRA}") from None


class WandbWriter:
  """A W&B run in RUN_DIR/wandb, named after the run directory unless WANDB_NAME is set;
  WANDB_MODE=offline keeps it on disk (`wandb sync` uploads it later)."""

  def __init__(self, cfg):
    wandb = _require("wandb", "wandb")
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
      self._run = wandb.init(
          dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", PROJECT),
          name=os.environ.get("WANDB_NAME", run_dir.name), config=settings(cfg),
          reinit="create_new",  # a run of its own, even beside another in this process
          settings=wandb.Settings(console="off"))  # the progress bar keeps the terminal
    except wandb.errors.UsageError as e:  # e.g. not logged in, and no WANDB_MODE=offline
      raise ConfigError(f"--logger wandb could not start a run: {e} (log in with `wandb "
                        f"login`, or set WANDB_MODE=offline to keep the run on disk)") from None

  def write(self, record: dict, prefix: str = "train/") -> None:
    values = scalars(record, prefix)
    if values:
      self._run.log(values, step=int(record["step"]))

  def close(self) -> None:
    self._run.finish()


class MlflowWriter:
  """An MLflow run (in experiment MLFLOW_EXPERIMENT_NAME, else "shardlab") named after the
  run directory, through MlflowClient: no process-wide active run to collide with."""

  def __init__(self, cfg):
    _require("mlflow", "mlflow")
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
    if not uri:  # the local SQLite store, which needs SQLAlchemy and Alembic
      _require("sqlalchemy", "mlflow"), _require("alembic", "mlflow")
      run_dir = Path(cfg.run_dir).resolve()
      run_dir.mkdir(parents=True, exist_ok=True)
      uri, artifacts = f"sqlite:///{run_dir / 'mlflow.db'}", (run_dir / "mlartifacts").as_uri()
    self.client = MlflowClient(uri)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
    found = self.client.get_experiment_by_name(name)
    experiment = found.experiment_id if found else self.client.create_experiment(
        name, artifact_location=artifacts)
    run_dir = getattr(cfg, "run_dir", None)
    run_name = Path(run_dir).resolve().name if run_dir else None
    self.run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
    flat = [Param(k, v[:6000]) for k, v in params(cfg).items()]  # MLflow's value limit
    for i in range(0, len(flat), 100):  # at most 100 params per call
      self.client.log_batch(self.run_id, params=flat[i:i + 100])

  def write(self, record: dict, prefix: str = "train/") -> None:
    from mlflow.entities import Metric
    now, step = int(time.time() * 1000), int(record["step"])
    metrics = [Metric(k, v, now, step) for k, v in scalars(record, prefix).items()]
    if metrics:
      self.client.log_batch(self.run_id, metrics=metrics)

  def close(self) -> None:
    self.client.set_terminated(self.run_id)
