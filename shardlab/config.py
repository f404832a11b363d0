"""Typed run configuration: dataclasses, TOML/dict loading, dotted `key=value` overrides.

Every field is validated where it is read, so a typo fails before any device work starts.
"""

import dataclasses
import json
import tomllib
import types
import typing
from typing import Any

from shardlab import remat as remat_policies
from shardlab.bounds import Float, Int, check_fields
from shardlab.errors import ConfigError, finite, unknown

# Each number's range, by dotted key: the sections' checks and the command-line options that
# set one (train.py --steps, plan --global-batch, data prepare --held-out-fraction) read it.
BOUNDS = {
    **{f"train.{f}": Int(min=1) for f in (
        "steps", "global_batch", "seq_len", "microbatches", "log_every", "eval_batches",
        "max_skipped", "pipeline_repeats", "scan_unroll")},
    **{f"train.{f}": Float(gt=0) for f in ("lr", "clip_norm", "eps")},
    "train.weight_decay": Float(min=0), "train.warmup_steps": Int(min=0),
    "train.eval_every": Int(min=0), "train.loss_chunk": Int(min=0, note="0: off"),
    "train.b1": Float(min=0, lt=1), "train.b2": Float(min=0, lt=1),
    "train.min_lr_ratio": Float(min=0, max=1), "train.seed": Int(min=0, lt=2**63),
    "data.held_out_fraction": Float(gt=0, lt=0.5), "data.max_bytes": Int(min=1),
    "data.prefetch": Int(min=0), "checkpoint.every": Int(min=1), "checkpoint.keep": Int(min=1),
    "lora.rank": Int(min=0, note="0: off"), "lora.alpha": Float(gt=0)}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  global_batch: int = 32
  seq_len: int = 128
  microbatches: int = 1
  pipeline_repeats: int = 1  # layer groups per pipeline stage: 1 GPipe, > 1 circular
  pipeline_schedule: str = "gpipe"  # or "1f1b" (docs/pipeline.md; repeats 1, set-up checks)
  loss_chunk: int = 0  # positions per logits chunk in the loss (0: whole sequence)
  optimizer: str = "adamw"
  lr: float = 3e-3
  warmup_steps: int = 30
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_norms_and_embeddings: bool = False
  clip_norm: float = 1.0
  precision: str = "auto"
  grad_dtype: str = "auto"  # "auto" (the stored params'), "fp32", or "bf16" under bf16
  early_grad_reduce: bool = True  # reduce weight grads where made (parallel/early_grads.py)
  remat: str = "none"
  scan_unroll: int = 1  # layers per layer-scan iteration; n_layers unrolls (performance.md)
  offload: str = "none"  # "opt_state": master weights and optimizer state in host memory
  seed: int = 0
  log_every: int = 10  # steps between logged ones (step 1 and the last are logged too)
  eval_batches: int = 8
  eval_every: int = 0  # held-out loss every N steps (0: only at the end)
  # A step whose loss or gradient norm is not finite: "stop" the run (exit 3, nothing saved
  # from that step on) or "skip" its update, stopping after max_skipped in a row.
  nonfinite: str = "stop"
  max_skipped: int = 10

  def __post_init__(self):
    check_fields(self, BOUNDS, "train")
    if self.loss_chunk and self.seq_len % self.loss_chunk:
      raise ConfigError(f"train.loss_chunk ({self.loss_chunk}) must be 0 (off) or divide "
                        f"train.seq_len ({self.seq_len})")
    if self.global_batch % self.microbatches:
      raise ConfigError(f"train.global_batch ({self.global_batch}) must be divisible by "
                        f"train.microbatches ({self.microbatches})")
    choices = {"optimizer": ("adamw", "adafactor", "sgd"),
               "precision": ("auto", "fp32", "bf16", "bf16-params"),
               "grad_dtype": ("auto", "fp32", "bf16"), "offload": ("none", "opt_state"),
               "nonfinite": ("stop", "skip"), "pipeline_schedule": ("gpipe", "1f1b")}
    for f, valid in choices.items():
      if getattr(self, f) not in valid:
        raise unknown(f"train.{f}", getattr(self, f), valid)
    remat_policies.policy(self.remat)  # a listed policy or a custom spec, else refused


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # corpus: "stdlib" (this Python's source), a text file or dir, .jsonl, a prepared dir or
  # a .bin/.npy token file; tokenizer: "bytes", a tokenizer.json, a .model, a dir (docs/data.md)
  corpus: str = "stdlib"
  tokenizer: str = "bytes"
  text_field: str = "text"  # the text of a .jsonl record
  held_out_fraction: float = 0.02
  max_bytes: int = 64 * 2**20
  prefetch: int = 2  # batches built ahead in a background thread (0: none)

  def __post_init__(self):
    for f in ("corpus", "tokenizer", "text_field"):
      if not getattr(self, f).strip():
        raise ConfigError(f"data.{f} is empty ({getattr(self, f)!r}); see docs/data.md")
    check_fields(self, BOUNDS, "data")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  dir: str | None = None  # save here, and resume from the newest complete checkpoint here
  every: int = 100  # steps between saves; the last step is always saved
  keep: int = 3  # newest complete checkpoints kept
  async_save: bool = True
  init_from: str | None = None  # load params only (fine-tuning) from this checkpoint dir
  strict: bool = False  # a damaged newest step stops the run instead of falling back

  def __post_init__(self):
    check_fields(self, BOUNDS, "checkpoint")
    for f in ("dir", "init_from"):  # "" would silently mean "none"
      if getattr(self, f) is not None and not getattr(self, f).strip():
        raise ConfigError(f"checkpoint.{f} is empty ({getattr(self, f)!r}); give a "
                          f"directory, or leave it unset")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (Hu et al. 2021): each targeted projection W becomes
  W + (alpha / rank)·A·B with A random and B zero, and only A and B train."""
  rank: int = 0  # 0: no adapters, every param trains
  alpha: float = 16.0
  targets: str = "q,k,v,o,gate,up,down"  # the model's projection names, comma-separated

  def __post_init__(self):
    check_fields(self, BOUNDS, "lora")
    if self.rank and not self.target_names:
      raise ConfigError(f"lora.targets is empty ({self.targets!r}); name the projections to "
                        f"adapt, e.g. q,k,v,o,gate,up,down")

  @property
  def target_names(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.targets.split(",") if t.strip())

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class Config:
  model: Any  # a bundled architecture's config (shardlab.models.registry) or your own
  mesh: str = "cpu-8"
  strategy: str = "fsdp_tp"
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  lora: LoraConfig = LoraConfig()
  # Single-rule overrides on top of the strategy's tables: {"params": {"mlp": "tensor"}, ...}
  rules: dict = dataclasses.field(default_factory=dict)
  metrics_file: str | None = None
  run_dir: str | None = None  # metrics.jsonl (unless metrics_file), TensorBoard, plot, profile/
  loggers: str = "tensorboard"  # or "tensorboard,wandb,mlflow", "none" (observe/trackers.py)
  profile_steps: str | None = None  # "A:B": a jax.profiler trace of steps A+1..B in run_dir


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)


# What a resumed run must share with its checkpoint: the model, the optimizer's update rule,
# the numerics and which batches come next. The schedule (lr, warmup_steps, min_lr_ratio,
# steps), logging, evaluation, remat, scan_unroll, loss_chunk, mesh, strategy, rules may change.
RESUME_FIELDS = ("model", "train.optimizer", "train.b1", "train.b2", "train.eps",
                 "train.weight_decay", "train.decay_norms_and_embeddings", "train.clip_norm",
                 "train.precision", "train.grad_dtype", "train.global_batch", "train.seq_len",
                 "train.microbatches", "train.seed", "data", "lora")
# A label (the same model from another TOML file is fine), and implementation choices.
RESUME_IGNORED = ("model.name", "model.attention", "model.kv_exchange", "data.prefetch")


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def resume_changes(saved: dict, now: dict, fields=RESUME_FIELDS) -> list[str]:
  """'field: saved → now' for each of `fields` (dotted keys or sections) that differs
  between a checkpoint's saved config and this run's (`to_dict` forms). A field the saved
  config lacks (an older checkpoint, or none recorded) is not compared."""
  old, new = _flat(json.loads(json.dumps(saved))), _flat(json.loads(json.dumps(now)))
  picked = lambda key: key not in RESUME_IGNORED and any(
      key == f or key.startswith(f + ".") for f in fields)
  return [f"{key}: {json.dumps(old[key])} → {json.dumps(new.get(key))}"
          for key in sorted(k for k in old if picked(k)) if old[key] != new.get(key)]


def from_dict(cls, data: dict, where: str = "", **given):
  """Builds dataclass `cls` from a nested dict, rejecting unknown keys with suggestions;
  `given` fields are passed through as they are."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = dict(given)
  for key, value in data.items():
    if key not in fields:
      raise unknown(f"config key {where}", key, fields)
    hint = hints[key]
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
      value = from_dict(hint, value, f"{where}{key}.")
    else:
      value = _coerce(value, hint, f"{where}{key}")
    kwargs[key] = value
  missing = [f.name for f in fields.values() if f.name not in kwargs and f.init and
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ConfigError(f"missing {', '.join(where + m for m in missing)} (no default; "
                      f"every field of {cls.__name__} without one must be given)")
  return cls(**kwargs)


def _coerce(value, hint, field: str):
  """Checks (and widens int→float) a value against a simple type hint."""
  if hint is Any:
    return value
  options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
  if value is None and type(None) in options:
    return None
  if isinstance(value, _Text):  # from the command line: typed by the field it sets
    value = value.parsed if not (str in options and not isinstance(value.parsed, str)) \
        else str(value)
  for t in options:
    if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
      return finite(value, field)
    if t in (int, str, bool, dict) and type(value) is t:
      return value
  names = " or ".join(getattr(t, "__name__", str(t)) for t in options)
  raise ConfigError(f"{field} must be {names}, got {value!r}")


class _Text(str):
  """A command-line value: a TOML scalar where the field wants one (`train.lr=1e-3`), the
  text itself where the field is a string (`data.corpus=2024` names a file)."""

  @property
  def parsed(self):
    try:
      return tomllib.loads(f"v = {self}")["v"]
    except tomllib.TOMLDecodeError:
      return str(self)


def set_values(cfg, values: dict):
  """Sets dotted keys to typed values (`{"checkpoint.dir": "runs/a"}`), checking each."""
  for key, value in values.items():
    if not key.startswith("rules.") and key not in _all_keys(cfg):
      raise unknown("config key", key, _all_keys(cfg))
    cfg = _set(cfg, key.split("."), value, key)
  return cfg


def apply_overrides(cfg, overrides: list[str]):
  """Applies `section.key=value` strings (`--set`): values are read as TOML scalars, or as
  plain text for string fields."""
  values = {}
  for item in overrides:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
      raise ConfigError(f"--set expects key=value, got {item!r}")
    raw = raw.strip()
    values[key.strip()] = _Text(raw).parsed if key.strip().startswith("rules.") else _Text(raw)
  return set_values(cfg, values)


def _set(obj, path: list[str], value, full_key: str):
  if isinstance(obj, dict):  # free-form section (rules): nested dicts are created on demand
    out = dict(obj)
    out[path[0]] = value if len(path) == 1 else _set(obj.get(path[0], {}), path[1:], value,
                                                     full_key)
    return out
  current = getattr(obj, path[0])
  if len(path) > 1:
    if not (dataclasses.is_dataclass(current) or isinstance(current, dict)):
      raise ConfigError(f"config key {full_key!r}: {path[0]!r} has no sub-keys")
    new = _set(current, path[1:], value, full_key)
  else:
    new = _coerce(value, typing.get_type_hints(type(obj))[path[0]], full_key)
  return dataclasses.replace(obj, **{path[0]: new})


def _all_keys(obj, prefix: str = "") -> list[str]:
  keys = []
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      keys += _all_keys(value, f"{prefix}{f.name}.")
    else:
      keys.append(prefix + f.name)
  return keys
