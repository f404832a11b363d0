"""The planner's view of a pipeline (shardlab/parallel/pipeline.py): bubble, per-stage activations,
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
  weight traffic the step does not loop over microbatches (the pipeline does), so weights
                outside the layers are gathered and their gradients reduced once per step;
                a stage's layer weights are used once per iteration, K layers at a time
                (T/R passes over its N/S layers), and XLA gathers them (fsdp) and reduces
                their gradients inside the loop, per iteration — not per microbatch (seen in
                the compiled step: tests/test_pipeline_plan.py). `passes` gives the counts.
Weights need nothing here: the rules put `layers` on `stage`, so the state's shardings
already divide the layers' bytes by S.
"""

import dataclasses
import math

import jax

from shardlab.parallel import pipeline
from shardlab.plan.training import activations, memory as plan_memory
from shardlab.plan.training.comm import Transfer
from shardlab.sharding import rules as rules_lib
from shardlab.runtime.units import gib


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


@dataclasses.dataclass(frozen=True)
class Passes:
  """How often a step uses each weight, for the planner's collective counts."""
  looped: int  # microbatches the train step loops over (each non-layer weight's uses)
  layer_uses: float  # passes over a device's share of the stacked layers
  layer_runs: float  # layer applications per device, each on one microbatch


def passes(m, train, rules: rules_lib.Rules, mesh) -> Passes:
  """Without a pipeline: M microbatches, each running all N layers. With one (S stages, R
  repeats, T = R·M + S − 1 iterations): one pass of the step, and each stage runs one group
  of K = N/(S·R) layers per iteration, T·K applications, T/R passes over its N/S layers."""
  stages = rules_lib.pipeline_stages(rules, mesh)
  micro = train.microbatches
  if stages <= 1:
    return Passes(micro, micro, m.n_layers * micro)
  repeats = train.pipeline_repeats
  iterations = pipeline.iterations(stages, micro, repeats)
  return Passes(1, iterations / repeats, m.n_layers // (stages * repeats) * iterations)


def estimate(m, train, rules: rules_lib.Rules, mesh, p: int, layer_bytes: float,
             platform: str = "cpu") -> Pipeline | None:
  """The pipeline of a run whose rules split `layers` over a mesh axis of > 1 devices (None
  otherwise). `layer_bytes`: the stacked layers' stored bytes per device (already / S)."""
  stages = rules_lib.pipeline_stages(rules, mesh)
  if stages <= 1:
    return None
  repeats, micro = train.pipeline_repeats, train.microbatches
  pipeline.check(m.n_layers, stages, repeats, micro, train.global_batch)
  iterations = pipeline.iterations(stages, micro, repeats)
  per_group = m.n_layers // (stages * repeats)
  a = activations.activation_shapes(m, train.global_batch // micro, train.seq_len,
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
  a = activations.activation_shapes(model, train.global_batch // train.microbatches,
                                    train.seq_len, rules.activations, mesh, platform)
  loop_saved = model.n_layers * plan_memory.layer_saved_bytes(a, p, train.remat, model)
  memory = dataclasses.replace(memory, activations=memory.activations - loop_saved
                               + pipe.activations)
  return memory, list(transfers) + list(pipe.transfers), compute_s / (1 - pipe.bubble), pipe


# Printed under `shardlab plan`'s fewest-devices lines, which scan no `stage` axis.
MIN_DEVICES_NOTE = (
    "pipeline layouts are not part of this scan (`--search` weighs them, or give --mesh "
    "stage:S,...): a pipeline stage keeps the saved tensors of all its microbatches in flight "
    "(R·M + S − 1 iterations' worth, where a microbatch loop keeps one), so it seldom fits "
    "where fsdp over the same devices does not")


def versus(found: list) -> list[str]:
  """Search output: the fastest layout with a pipeline beside the fastest without one, and
  what decides between them ([] unless the search holds both)."""
  staged = [e for e in found if e.pipeline is not None]
  flat = [e for e in found if e.pipeline is None]
  if not staged or not flat:
    return []
  p, f = staged[0], flat[0]
  weights = sum(f.collectives.get(k, 0.0) for k in ("all-gather", "reduce-scatter",
                                                      "all-reduce"))
  lines = ["", "pipeline or not (the fastest of each):",
           f"  with stages {p.strategy} {p.mesh}: {p.step_s * 1e3:.1f} ms = compute "
           f"stretched by the {p.pipeline.schedule} bubble ({p.pipeline.bubble:.1%}); comm "
           f"{p.comm_s * 1e3:.1f} ms",
           f"  without     {f.strategy} {f.mesh}: {f.step_s * 1e3:.1f} ms, bound by "
           f"{f.binding}; comm {f.comm_s * 1e3:.1f} ms for {gib(weights, digits=1)} of weight "
           f"gathers and gradient reductions per device"]
  if p.step_s >= f.step_s:
    return lines + ["  no pipeline wins: its bubble costs more than the communication it saves"]
  where = "DCN" if "dcn" in f.mesh else "between devices"
  return lines + [f"  the pipeline wins: it sends only activations between neighbouring "
                  f"stages, while without one weight gathers and gradient reductions cross "
                  f"{where} for every microbatch"]
