"""What a run's pipeline does, in words: the schedule, its bubble, which layers each stage
holds (the run header and `inspect` print these)."""

from shardlab.parallel import pipeline
from shardlab.sharding import rules as rules_lib


def stages(rules: rules_lib.Rules, mesh) -> int:
  return rules_lib.pipeline_stages(rules, mesh)


def lines(n_layers: int | None, rules: rules_lib.Rules, mesh, microbatches: int,
          repeats: int, schedule: str = "gpipe") -> list[str]:
  """The pipeline's header lines ([] when the rules split no layers over a mesh axis);
  `schedule`: train.pipeline_schedule."""
  n = stages(rules, mesh)
  if n <= 1 or n_layers is None:
    return []
  pipeline.check(n_layers, n, repeats, microbatches)
  placed = pipeline.layers_per_stage(n_layers, n, repeats)
  return [f"pipeline {pipeline.describe(n_layers, n, repeats, microbatches, schedule)}",
          "         layers by stage: " + "; ".join(
              f"{s}: {_ranges(layers)}" for s, layers in enumerate(placed))]


def _ranges(layers: list[int]) -> str:
  """[0, 1, 2, 6, 7] → '0-2,6-7'."""
  out, start = [], layers[0]
  for prev, cur in zip(layers, layers[1:] + [None]):
    if cur != prev + 1:
      out.append(f"{start}" if start == prev else f"{start}-{prev}")
      start = cur
  return ",".join(out)
