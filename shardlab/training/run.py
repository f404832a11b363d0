"""A language-model run built from a Config: mesh, rules, abstract state, shardings, the
jitted steps and the data. `setup(cfg)` wires a bundled model (its config dataclass is
`cfg.model`, keeping the contract of models/protocol.py); your own module goes through the
`abstract_state` / `shardings` / `init` / `train_step` API directly, or `sl.fit` (fit.py:
the same loop, driver.py, as a Config's run); `place(cfg)` is the
one path from a Config to a placed abstract state. Also here: the config check of a resume
(the non-finite guard is training/nonfinite.py's).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlab import config as config_lib
from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.models import lm
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.data import corpus as corpus_lib
from shardlab.data import feed as feed_lib
from shardlab.training import checks, combinations, optim, precision
from shardlab.training import state as state_lib
from shardlab.training import step as step_lib

EVAL_SEED_OFFSET = feed_lib.EVAL_SEED_OFFSET


@dataclasses.dataclass
class Run:
  """Everything built for a run, before any step is taken."""
  cfg: Config
  placement: "Placement"
  train_step: object  # jitted
  eval_step: object
  corpus: corpus_lib.Corpus | None
  feed: feed_lib.ByteFeed | feed_lib.PackedFeed | None = None
  start: tuple[int, int] = (0, 0)  # (first step, its data position): set by `inputs`

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self.placement.mesh

  @property
  def abstract(self) -> state_lib.Abstract:
    return self.placement.abstract

  @property
  def shardings(self) -> state_lib.Shardings:
    return self.placement.shardings

  def batch(self, tokens: np.ndarray, seed: int, step: int) -> jax.Array:
    t = self.cfg.train
    return corpus_lib.global_batch(tokens, seed, step, t.global_batch, t.seq_len,
                             self.shardings.batch)

  def _rows(self) -> tuple[int, int]:
    t = self.cfg.train
    return corpus_lib.process_rows(self.shardings.batch, (t.global_batch, t.seq_len + 1))

  def held_out_loss(self, params) -> float:
    """Mean loss over train.eval_batches held-out batches (the same ones at every call)."""
    rows, t = self._rows(), self.cfg.train
    losses = [self.eval_step(params, feed_lib.place(self.feed.held_out(i, rows),
                                                    self.shardings.batch, t.global_batch))
              for i in range(t.eval_batches)]
    return float(np.mean(jax.device_get(losses)))

  def position(self, step: int) -> int:
    """The data position of `step`'s batch (the feed's, counted from `inputs`' start)."""
    first, position = self.start
    return position + (step - first) * self.feed.advance(0)

  def inputs(self, first_step: int, saved: dict | None) -> feed_lib.Prefetcher:
    """The train batches from `first_step` on (a resume continues at the saved position),
    built data.prefetch batches ahead in a background thread."""
    self.start = (first_step, self.feed.start(first_step, saved))
    rows, t = self._rows(), self.cfg.train
    produce = lambda step: feed_lib.place(self.feed.host(self.position(step), rows),
                                          self.shardings.batch, t.global_batch)
    return feed_lib.Prefetcher(produce, first_step, self.cfg.data.prefetch)

  def flops_per_step(self) -> float:
    t = self.cfg.train
    return self.cfg.model.flops_per_token(t.seq_len) * t.global_batch * t.seq_len


def model_factory(cfg: Config):
  """Builds the bundled model `cfg.model` describes, seeded by train.seed, with the layer
  scan's settings (train.remat, train.scan_unroll)."""
  combinations.check_model_settings(cfg)  # train.remat and lora.targets are offered
  param_dtype = precision.resolve(cfg.train.precision).param_dtype
  remat, unroll = cfg.train.remat, cfg.train.scan_unroll
  if not cfg.lora.rank:
    return lambda: cfg.model.make(nnx.Rngs(cfg.train.seed), param_dtype, remat,
                                  unroll=unroll)
  return lambda: cfg.model.make(nnx.Rngs(cfg.train.seed), param_dtype, remat, lora=cfg.lora,
                                unroll=unroll)


def lora_frozen(path: tuple[str, ...]) -> bool:
  """Under LoRA every param but the adapters (under a `lora_` attribute) is held fixed."""
  return not any(key.startswith("lora_") for key in path)


def completed(loaded: dict, initial: dict, abstract: state_lib.Abstract,
              source: str = "the source") -> dict:
  """`loaded` params with what the source holds none of taken from `initial`: a base model
  (an HF import) for a LoRA run leaves the adapters at their init. A frozen param must be
  in the source, or the run would fine-tune around random weights; so must every param of
  a run that freezes none."""
  frozen = abstract.frozen or jax.tree.map(lambda _: True, initial)

  def walk(loaded, initial, frozen, path):
    out = {}
    for key, value in initial.items():
      if key in loaded:
        out[key] = (walk(loaded[key], value, frozen[key], path + (key,))
                    if isinstance(value, dict) else loaded[key])
      elif any(jax.tree.leaves(frozen[key])):
        raise ConfigError(f"{source} holds no param {'.'.join(path + (key,))}; only "
                          f"trained params a base model lacks (LoRA adapters) may be missing")
      else:
        out[key] = value
    return out

  return walk(loaded, initial, frozen, ())


@dataclasses.dataclass(frozen=True)
class Placement:
  """A Config laid out: its mesh (parsed once, here), the abstract state and where each
  array of it lives. Nothing is allocated."""
  spec: mesh_lib.MeshSpec  # cfg.mesh parsed and, for a -1 axis, resolved
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  abstract: state_lib.Abstract
  shardings: state_lib.Shardings


def place(cfg: Config, devices=None, offload: bool = False, abstract: bool = False,
          n_devices: int | None = None) -> Placement:
  """The one path from a Config to a placed abstract state. `devices`: the devices to build
  the mesh over (default: all of this process's). `abstract`: an AbstractMesh instead, of
  any size (nothing can be compiled or allocated on it): a -1 axis is filled to `n_devices`
  (default: this process's device count), a fixed mesh is checked against `n_devices` only
  when it is given. `offload`: train.offload's placements too (training keeps the state
  where train.offload says; generation, export and inspection read the weights on the
  devices)."""
  rules_lib.strategy(cfg.strategy, cfg.rules)  # a bad strategy fails before the mesh does
  spec = mesh_lib.load(cfg.mesh)
  if abstract:
    if n_devices is not None or any(s == -1 for s in (*spec.ici.values(),
                                                      *spec.dcn.values())):
      spec = spec.resolve(jax.device_count() if n_devices is None else n_devices)
    mesh = jax.sharding.AbstractMesh(tuple(spec.shape.values()), tuple(spec.shape))
  else:
    mesh = mesh_lib.build(spec, devices=devices)
    spec = spec.resolve(mesh.size)
  abstract = abstract_state(cfg)
  return Placement(spec, mesh, abstract, shardings(cfg, abstract, mesh, offload))


def abstract_state(cfg: Config) -> state_lib.Abstract:
  return state_lib.abstract_state(model_factory(cfg),
                                  optim.make(cfg.train, cfg.model.no_weight_decay),
                                  precision.resolve(cfg.train.precision),
                                  frozen=lora_frozen if cfg.lora.rank else None)


def shardings(cfg: Config, abstract: state_lib.Abstract, mesh,
              offload: bool = False) -> state_lib.Shardings:
  """The run's placements; with `offload`, train.offload's too (training keeps the state
  where train.offload says; generation and export read the weights on the devices)."""
  return state_lib.shardings(abstract, rules_lib.strategy(cfg.strategy, cfg.rules), mesh,
                             cfg.train.offload if offload else "none")


def loss_fn(cfg: Config):
  return lambda model, tokens: lm.next_token_loss(model, tokens, cfg.train.loss_chunk)


def abstract_batch(cfg: Config, shardings_: state_lib.Shardings) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32,
                              sharding=shardings_.batch)


def abstract_inputs(abstract: state_lib.Abstract, shardings_: state_lib.Shardings,
                    cfg: Config):
  """(state, batch) of the train step as placed ShapeDtypeStructs: compile without memory."""
  return state_lib.placed(abstract.state, shardings_.state), abstract_batch(cfg, shardings_)


def make_steps(cfg: Config, abstract: state_lib.Abstract, shardings_: state_lib.Shardings):
  """(train_step, eval_step), jitted with the run's shardings."""
  combinations.check(cfg, dict(shardings_.mesh.shape), shardings_.rules)
  checks.check_pipeline_parts(cfg, abstract, shardings_.rules, shardings_.mesh)
  step_lib.check_batch(cfg.train.global_batch, cfg.train.microbatches, shardings_)
  loss = loss_fn(cfg)
  return (step_lib.make_train_step(loss, abstract, shardings_,
                                   microbatches=cfg.train.microbatches,
                                   lr_schedule=optim.schedule(cfg.train),
                                   grad_dtype=cfg.train.grad_dtype,
                                   early_grads=cfg.train.early_grad_reduce,
                                   nonfinite=cfg.train.nonfinite,
                                   pipeline_repeats=cfg.train.pipeline_repeats,
                                   pipeline_schedule=cfg.train.pipeline_schedule),
          step_lib.make_eval_step(loss, abstract, shardings_,
                                  microbatches=cfg.train.microbatches,
                                  pipeline_repeats=cfg.train.pipeline_repeats))


def setup(cfg: Config, with_data: bool = True, devices=None) -> Run:
  """Validates the config against the devices and data, and builds the sharded steps."""
  checks.check_model_fits(cfg, with_data and not feed_lib.is_packed(cfg.data))
  rules = rules_lib.strategy(cfg.strategy, cfg.rules)  # a bad strategy fails before the mesh
  spec = mesh_lib.load(cfg.mesh)
  mesh = mesh_lib.build(spec, devices=devices)
  # What the layout cannot combine fails here, before the data, the abstract state or the
  # steps are built (make_steps repeats it for callers that build steps without setup).
  combinations.check(cfg, dict(mesh.shape))  # warnings: the loop prints the idle axes
  t = cfg.train
  feed = feed_lib.feed(cfg.data, t.seed, t.global_batch, t.seq_len) if with_data else None
  checks.check_tokenizer_fits(cfg, feed)
  abstract = abstract_state(cfg)
  placement = Placement(spec.resolve(mesh.size), mesh, abstract,
                        shardings(cfg, abstract, mesh, offload=True))
  train_step, eval_step = make_steps(cfg, abstract, placement.shardings)
  return Run(cfg, placement, train_step, eval_step, getattr(feed, "corpus", None), feed)


def init(run: Run) -> state_lib.TrainState:
  return state_lib.init_state(run.abstract, run.shardings)


def resume_check(cfg: Config, allow: bool, warn: Callable[[str], None]):
  """The check a resume runs on the checkpoint's saved config: settings that matter
  (config.RESUME_FIELDS) must be unchanged unless `allow`. A step-0 checkpoint (an import,
  say) has trained on no data, so only its model is compared."""
  now = config_lib.to_dict(cfg)

  def check(saved: dict, step: int) -> None:
    fields = ("model",) if step == 0 else config_lib.RESUME_FIELDS
    changes = config_lib.resume_changes(saved, now, fields)
    if not changes:
      return
    listed = "\n".join(f"  {c}" for c in changes)
    if allow:
      warn(f"warning: resuming from step {step} with {len(changes)} changed "
           f"setting(s) (--allow-config-change), saved → now:\n{listed}")
      return
    raise ConfigError(
        f"checkpoint {cfg.checkpoint.dir}/{step} was saved by a run with other settings "
        f"({len(changes)} differ, saved → now):\n{listed}\nresuming would continue that run "
        f"under these settings; pass --allow-config-change to resume anyway, or start over "
        f"with --fresh --overwrite or another --checkpoint-dir")

  return check
