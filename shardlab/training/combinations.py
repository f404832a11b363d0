"""Which settings combine: the one place a Config and its mesh are read together, before
the abstract state is built or anything is traced or compiled. `review` gives every refusal
(a ConfigError saying why and what would run) and every warning; `check` raises the first
refusal and returns the warnings. `shardlab train` (training/run.py setup), `inspect` and
`plan train` call it; tests/test_combinations.py holds the table of verdicts and
docs/guarantees.md lists it.

Refused: what cannot run inside a pipeline (context parallelism, a mixture of experts, remat
or optimizer-state offload, a schedule the layers or the batch cannot follow, 1F1B with
repeats), LoRA on targets the model does not offer (or on a model that offers none), a remat
policy the model does not offer, a context-parallel degree the sequence cannot zig-zag over,
expert parallelism the experts do not divide. Warned: a mesh axis of size > 1 that no rule of
the strategy splits over (sharding/idle.py).

Each rule's message lives beside the code it protects (parallel/pipeline.py, parallel/context.py,
training/checks.py), which checks it again where it runs, so a rule has one message.
"""

import dataclasses
import types

from shardlab import remat as remat_lib
from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.models import protocol
from shardlab.parallel import context as context_lib
from shardlab.sharding import idle
from shardlab.sharding import rules as rules_lib
from shardlab.training import checks


@dataclasses.dataclass(frozen=True)
class Review:
  refusals: tuple[ConfigError, ...]
  warnings: tuple[str, ...]

  @property
  def ok(self) -> bool:
    return not self.refusals


def check_model_settings(cfg: Config) -> None:
  """The model offers train.remat, and (under LoRA) every one of lora.targets."""
  model = cfg.model
  if not remat_lib.offered(cfg.train.remat, model.remat_policies):
    raise ConfigError(f"train.remat {cfg.train.remat!r} is not offered by model "
                      f"{model.name}; valid: {', '.join(model.remat_policies)}"
                      + _custom_needs(cfg.train.remat))
  if not cfg.lora.rank:
    return
  offered = model.lora_targets
  wrong = [t for t in cfg.lora.target_names if t not in offered]
  if wrong and not offered:
    raise ConfigError(f"lora.targets {', '.join(wrong)} not offered by model {model.name}; "
                      f"valid: none (no LoRA): it offers no LoRA targets, so set lora.rank=0 "
                      f"(train every param) or pick a model that offers them")
  if wrong:
    raise ConfigError(f"lora.targets {', '.join(wrong)} not offered by model "
                      f"{model.name}; valid: {', '.join(offered)}")


def _custom_needs(remat: str) -> str:
  """For a custom policy the model refuses: which of its listed policies it would need."""
  if remat in remat_lib.POLICIES:
    return ""
  return (" (a custom policy runs where the listed policies it builds on do: naming "
          "projections needs the named ones, such as save-qkv-proj; offloading layer_input "
          "needs offload)")


def _check_context(cfg: Config, rules: rules_lib.Rules, mesh) -> None:
  """Context parallelism splits each sequence into 2 × degree zig-zag chunks."""
  degree = checks.degree(rules, mesh, "length")
  if degree > 1:
    context_lib.zigzag_order(cfg.train.seq_len, degree)  # raises its one message


def _check_experts(cfg: Config, rules: rules_lib.Rules, mesh) -> None:
  """Expert parallelism holds n_experts / degree experts on each device."""
  if not protocol.has(cfg.model, "n_experts"):
    return  # a dense model: the `expert` axis splits the batch, as a data axis does
  degree = checks.degree(rules, mesh, "experts")
  if cfg.model.n_experts % degree:
    raise ConfigError(f"model.n_experts ({cfg.model.n_experts}) must be divisible by the "
                      f"expert-parallel degree ({degree}: `experts` split over the `expert` "
                      f"mesh axis); use an `expert` axis that divides {cfg.model.n_experts}")


RULES = (lambda cfg, rules, mesh: check_model_settings(cfg), checks.check_pipeline,
         _check_context, _check_experts)


def review(cfg: Config, mesh_shape: dict, rules: rules_lib.Rules | None = None) -> Review:
  """Every refusal and warning for `cfg` on a mesh of `mesh_shape` (axis → size; an axis
  still -1, not yet sized to the devices, counts as 1). `rules`: the tables the step is
  built with (default: the config's strategy and rules)."""
  mesh = types.SimpleNamespace(shape={a: max(int(s), 1) for a, s in mesh_shape.items()})
  rules = rules or rules_lib.strategy(cfg.strategy, cfg.rules)
  refusals = []
  for rule in RULES:
    try:
      rule(cfg, rules, mesh)
    except ConfigError as e:
      refusals.append(e)
  return Review(tuple(refusals), tuple(idle.warnings(rules, mesh.shape)))


def check(cfg: Config, mesh_shape: dict, rules: rules_lib.Rules | None = None) -> list[str]:
  """Raises the first refusal of `review`; else its warnings (the caller prints them)."""
  found = review(cfg, mesh_shape, rules)
  if found.refusals:
    raise found.refusals[0]
  return list(found.warnings)
