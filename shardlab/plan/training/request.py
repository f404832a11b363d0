"""What the planner is asked: a run's settings as the run's own config types (TrainConfig,
LoraConfig, rules, strategy, model: validated once, in shardlab.config) and where to plan it
(target, devices, mesh). `Request.from_config(cfg, target=...)` plans exactly what a run
config would run.
"""

import dataclasses
from typing import Any

from shardlab import config as config_lib
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.sharding import rules as rules_lib

# The planner's run unless told otherwise (`shardlab plan train`'s defaults): a production
# shape (256 × 2048 tokens, bf16, full remat) rather than TrainConfig's small CPU run.
PLANNER_TRAIN = config_lib.TrainConfig(global_batch=256, seq_len=2048, remat="full",
                                       precision="bf16")
TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(config_lib.TrainConfig))


@dataclasses.dataclass(frozen=True)
class Request:
  """What to plan: the run's own settings, as the run's config types (validated there, once),
  and where to plan it (target, devices, mesh)."""
  model: Any = "llama2-7b"  # preset name or TOML file, or a model config (Config.model)
  train: config_lib.TrainConfig = PLANNER_TRAIN
  strategy: str = "fsdp"
  rules: dict = dataclasses.field(default_factory=dict)
  lora: config_lib.LoraConfig = config_lib.LoraConfig()  # rank 0: every param trains
  mesh: str | None = None  # preset, file or inline; None: built from `devices`
  devices: int | None = None
  target: str = "h100-80g"

  def __post_init__(self):
    if self.devices is not None and self.devices < 1:
      raise ConfigError(f"devices must be >= 1, got {self.devices}")
    rules_lib.strategy(self.strategy, self.rules)  # an unknown strategy before any mesh talk

  @classmethod
  def from_config(cls, cfg: config_lib.Config, target: str = "h100-80g",
                  devices: int | None = None, mesh: str | None = "") -> "Request":
    """Plans exactly what `cfg` would run; `mesh` "" (default): the config's own, None: the
    strategy's usual mesh on `devices`."""
    return cls(model=cfg.model, train=cfg.train, strategy=cfg.strategy, rules=cfg.rules,
               lora=cfg.lora, mesh=cfg.mesh if mesh == "" else mesh, devices=devices,
               target=target)

  @classmethod
  def of(cls, train: config_lib.TrainConfig = PLANNER_TRAIN, **fields) -> "Request":
    """Request.of(model="llama2-70b", seq_len=4096, devices=64): TrainConfig's fields by
    name, on top of `train` (the planner's defaults), the rest the Request's own."""
    changes = {k: fields.pop(k) for k in list(fields) if k in TRAIN_FIELDS}
    return cls(train=dataclasses.replace(train, **changes), **fields)

  def with_train(self, **changes) -> "Request":
    """This request with TrainConfig fields changed (checked by TrainConfig)."""
    return dataclasses.replace(self, train=dataclasses.replace(self.train, **changes))

  def model_config(self):
    return registry.load(self.model) if isinstance(self.model, str) else self.model


def train_config(req: Request) -> config_lib.TrainConfig:
  """The run's TrainConfig as estimated: precision "auto" (the backend's choice) as bf16."""
  if req.train.precision == "auto":
    return dataclasses.replace(req.train, precision="bf16")
  return req.train


def run_config(req: Request, model, mesh: str = "cpu-8") -> config_lib.Config:
  """The run Config the request describes, on `mesh`."""
  return config_lib.Config(model=model, mesh=mesh, strategy=req.strategy,
                           train=train_config(req), rules=req.rules, lora=req.lora)
