"""The planner's pipeline (shardlab/plan/pipeline.py): bubble, per-stage memory and
point-to-point bytes, checked against the compiled step; `plan --search` offers stages
across nodes."""

import pytest

import test_pipeline as TP
from shardlab.models import registry
from shardlab.observe import hlo
from shardlab.plan import planner as plan
from shardlab.plan import search as plan_search
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib


def request(case: str, **kw) -> plan.Request:
  strategy, mesh, microbatches, repeats = TP.CASES[case]
  t = TP.H.TRAIN
  given = dict(model="micro", optimizer="adamw", precision="fp32",
               global_batch=t.global_batch, seq_len=t.seq_len, remat="none",
               microbatches=microbatches, pipeline_repeats=repeats, strategy=strategy,
               mesh=mesh, target="h100-80g")
  return plan.Request(**{**given, **kw})


def estimate(case: str):
  req = request(case)
  return plan.estimate(req, TP.MODEL, hardware.get(req.target),
                       mesh_lib.parse_inline(req.mesh), backend="cpu")


@pytest.mark.parametrize("case", ["gpipe-stage8", "circular-stage8"])
def test_point_to_point_bytes_match_the_compiled_step(case):
  e = estimate(case)
  _, _, microbatches, repeats = TP.CASES[case]
  assert e.pipeline.bubble == pytest.approx(7 / (repeats * microbatches + 7))
  assert e.pipeline.iterations == repeats * microbatches + 7
  ops = hlo.collective_ops(TP.run(case).compiled_step.as_text(), 8)
  # XLA moves the circular schedule's weights with all-to-alls and permutes; the planner
  # counts them as permutes.
  compiled = sum(c.bytes * c.executions for c in ops
                 if c.op in ("collective-permute", "all-to-all"))
  predicted = e.collectives["collective-permute"]
  assert predicted == pytest.approx(compiled, rel=0.01 if repeats == 1 else 0.3), (
      predicted, compiled)


def test_per_stage_memory_and_time():
  flat = plan.estimate(request("gpipe-stage8", mesh="data:8", microbatches=1), TP.MODEL,
                       hardware.get("h100-80g"), mesh_lib.parse_inline("data:8"),
                       strategy="dp", backend="cpu")
  staged = estimate("gpipe-stage8")
  assert flat.pipeline is None
  # Each stage stores 1/8 of the layers (and of their optimizer state).
  assert staged.memory.state < flat.memory.state / 3
  # Data ×8 and stage ×8 give each device 1/8 of the work; the pipeline's is stretched by
  # its bubble.
  assert staged.compute_s == pytest.approx(flat.compute_s / (1 - 7 / 15))


def test_search_offers_stages_across_nodes():
  model = registry.load("llama2-7b")
  acc = hardware.get("h100-80g")
  shapes = plan_search.staged(32, 2048, model.axis_sizes(), acc)
  assert {s["stage"] for s in shapes} == {2, 4}
  spec = plan_search.split_ici_dcn(shapes[0], acc.ici_domain)
  assert spec.dcn["stage"] == shapes[0]["stage"] and spec.ici["stage"] == 1
