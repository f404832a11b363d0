"""The planner's view of a pipeline (models/pipeline.py): bubble, per-stage activations,
point-to-point bytes.

With S stages, R repeats, M microbatches of b rows and N = S·R·K layers:
  bubble        (S − 1) / (R·M + S − 1) of each stage's time is idle; the step's compute
                time is the work per stage / (1 − bubble).
  activations   autodiff keeps, per stage, the saved tensors of its K layers for each of the
                T = R·M + S − 1 iterations (bubble iterations included: they run on zeros),
                each for one microbatch, plus the schedule's buffers (input, loop-back and
                output: 3 × B×L×D, split over the batch axes).
  point-to-point one b×L×D activation per iteration forward and its gradient backward, to the
                next (previous) stage: 2·T collective-permutes of b×L×D per device; and two
                all-reduces of B×L×D over stages: the last stage's output to the head
                (replicated over stages), and the embedding output's gradient.
  circular      (R > 1) the stored contiguous layer blocks are moved into the round-robin
                groups and the gradients back: (S − 1)/S of a stage's layer weights need to
                move each way; XLA (seen on CPU) does it with an all-to-all and a permute of
                all of them, 4× the stage's layer bytes per step, which is what is counted.
Weights need nothing here: the rules put `layers` on `stage`, so the state's shardings
already divide the layers' bytes by S.
"""

import dataclasses
import math

import jax

from shardlab.models import pipeline
from shardlab.plan import memory as plan_memory
from shardlab.plan.comm import Transfer
from shardlab.sharding import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class Pipeline:
  stages: int
  repeats: int
  microbatches: int
  iterations: int
  bubble: float
  activations: float  # bytes per device: saved for backward + the schedule's buffers
  transfers: tuple  # Transfer, per device per step

  @property
  def schedule(self) -> str:
    return "gpipe" if self.repeats == 1 else f"circular×{self.repeats}"

  def as_dict(self) -> dict:
    return {"schedule": self.schedule, "stages": self.stages, "repeats": self.repeats,
            "microbatches": self.microbatches, "iterations": self.iterations,
            "bubble": self.bubble, "activations": self.activations,
            "point_to_point": sum(t.bytes for t in self.transfers)}


def estimate(m, train, rules: rules_lib.Rules, mesh, p: int, layer_bytes: float,
             platform: str = "cpu") -> Pipeline | None:
  """The pipeline of a run whose rules split `layers` over a mesh axis of > 1 devices (None
  otherwise). `layer_bytes`: the stacked layers' stored bytes per device (already / S)."""
  stages = rules_lib.pipeline_stages(rules, mesh)
  if stages <= 1:
    return None
  repeats, micro = train.pipeline_repeats, train.microbatches
  pipeline.check(m.n_layers, stages, repeats, micro, train.global_batch)
  iterations = repeats * micro + stages - 1
  per_group = m.n_layers // (stages * repeats)
  a = plan_memory.activation_shapes(m, train.global_batch // micro, train.seq_len,
                                    rules.activations, mesh, platform)
  saved = iterations * per_group * plan_memory.layer_saved_bytes(a, p, train.remat, m)
  activation = a.d * p  # one microbatch's b×L×D on this device
  buffers = 3 * micro * activation
  axes = tuple(rules_lib._axes(rules.activations.get("layers")))
  whole = micro * activation  # B×L×D on this device
  transfers = [Transfer("collective-permute", 2 * iterations * activation, axes,
                        "pipeline activations (forward) and their gradients (backward)"),
               Transfer("all-reduce", whole, axes, "the last stage's output to every stage"),
               Transfer("all-reduce", whole, axes, "the input's gradient, summed over stages")]
  if repeats > 1:  # XLA:CPU moves each way with an all-to-all and a permute of them all
    transfers.append(Transfer("collective-permute", 4 * layer_bytes, axes,
                              "circular: layer weights into round-robin groups, grads back"))
  return Pipeline(stages, repeats, micro, iterations,
                  pipeline.bubble(stages, micro, repeats), saved + buffers, tuple(transfers))


def stacked_bytes(abstract, sharding_tree) -> float:
  """Stored bytes per device of the params whose first logical axis is `layers`."""
  names = jax.tree.leaves(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  leaves = jax.tree.leaves(abstract.state.params)
  return float(sum(math.prod(s.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                   for n, leaf, s in zip(names, leaves, jax.tree.leaves(sharding_tree))
                   if n and n[0] == "layers"))


def fold(model, train, rules, mesh, p: int, abstract, sh, platform: str, memory, transfers,
         compute_s: float):
  """(memory, transfers, compute_s, Pipeline or None) of an estimate, with the pipeline's
  activations in place of a microbatch loop's, its point-to-point transfers added and the
  compute time stretched by the bubble."""
  pipe = estimate(model, train, rules, mesh, p, stacked_bytes(abstract, sh.state.params),
                  platform)
  if pipe is None:
    return memory, transfers, compute_s, None
  a = plan_memory.activation_shapes(model, train.global_batch // train.microbatches,
                                    train.seq_len, rules.activations, mesh, platform)
  loop_saved = model.n_layers * plan_memory.layer_saved_bytes(a, p, train.remat, model)
  memory = dataclasses.replace(memory, activations=memory.activations - loop_saved
                               + pipe.activations)
  return memory, list(transfers) + list(pipe.transfers), compute_s / (1 - pipe.bubble), pipe
