"""The checks a run makes when it is set up, before anything is traced or compiled: what the
model, the data and the parallel layout must agree on. A combination that cannot run is a
ConfigError naming its fields here, not a failure in the middle of tracing the step.

The rules themselves live beside the code they protect (parallel/pipeline.py's `check` and
`check_combination`, which the traced code calls again as a last line of defence); this
module reads the config's values for them, so each rule has one message. Which settings
combine is decided in one place, training/combinations.py, which calls `check_pipeline`.
"""

import math

from flax import nnx

from shardlab.config import Config
from shardlab.data import corpus as corpus_lib
from shardlab.errors import ConfigError
from shardlab.models import protocol
from shardlab.parallel import pipeline
from shardlab.sharding import rules as rules_lib


def check_model_fits(cfg: Config, bytes_data: bool) -> None:
  """The model takes the run's sequences (and byte-level text, when that is the data)."""
  if bytes_data and cfg.model.vocab_size < corpus_lib.VOCAB:
    raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) must be >= "
                      f"{corpus_lib.VOCAB} for byte-level text data")
  if cfg.train.seq_len > cfg.model.max_seq_len:
    raise ConfigError(f"train.seq_len ({cfg.train.seq_len}) exceeds model.max_seq_len "
                      f"({cfg.model.max_seq_len})")


def check_tokenizer_fits(cfg: Config, feed) -> None:
  if feed is not None and feed.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                      f"vocabulary of data.tokenizer {feed.tokenizer.spec!r} "
                      f"({feed.tokenizer.vocab_size}); use a model with vocab_size >= "
                      f"{feed.tokenizer.vocab_size}")


def degree(rules: rules_lib.Rules, mesh, logical: str) -> int:
  """Over how many devices the activation rules split the logical axis `logical`."""
  axes = rules.activations.get(logical)
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape.get(a, 1) for a in axes)


def check_pipeline(cfg: Config, rules: rules_lib.Rules, mesh) -> None:
  """What runs inside a pipeline (the rules split `layers` over a `stage` axis above 1):
  the schedule's divisibility and the settings a pipeline refuses. Nothing without one."""
  t, model = cfg.train, cfg.model
  pipeline.check_schedule(t.pipeline_schedule, t.pipeline_repeats)
  stages = rules_lib.pipeline_stages(rules, mesh)
  if stages <= 1:  # train.pipeline_schedule (and _repeats) have nothing to run
    return
  # A mixture of experts is the contract's one marker of layers that return statistics
  # (router losses): read from the optional member, so no architecture is named here.
  stats = (f"model {model.name!r} is a mixture of experts (model.n_experts={model.n_experts}):"
           f" its layers" if protocol.has(model, "n_experts") else None)
  pipeline.check_combination(stages, remat=t.remat, offload=t.offload, layer_stats=stats,
                             context=degree(rules, mesh, "length"))
  pipeline.check(model.n_layers, stages, t.pipeline_repeats, t.microbatches, t.global_batch,
                 "train.global_batch")


def check_pipeline_parts(cfg: Config, abstract, rules: rules_lib.Rules, mesh) -> None:
  """Under a 1F1B pipeline the model's module gives `pipeline_parts` (models/protocol.py):
  the schedule owns the loss, so the loss needs the module's parts."""
  if cfg.train.pipeline_schedule != "1f1b" or rules_lib.pipeline_stages(rules, mesh) <= 1:
    return
  module = nnx.merge(abstract.graphdef, abstract.state.params)  # shapes only: no memory
  protocol.require_module_member(module, "pipeline_parts",
                                 f"train.pipeline_schedule=1f1b (model {cfg.model.name!r})")
