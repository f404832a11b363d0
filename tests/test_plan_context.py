"""The planner under context parallelism: memory and KV-exchange traffic against the compiled
step, weight gradients reduced over the context axis, the search choosing a context axis for
long sequences, and the longest sequence that fits per context degree."""

import dataclasses
import functools

import jax
import pytest

from shardlab import config
from shardlab.cli.plan import plan_main
from shardlab.models import registry
from shardlab.plan.compiled import aot
from shardlab.plan.training import longest_context
from shardlab.plan.training import planner as plan
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib

SEQ, BATCH = 2048, 2
# fp32: XLA:CPU hoists bf16→fp32 converts of the stacked residuals out of the layer loop (a
# CPU-only copy of every layer's saved activations), which no TPU or GPU step holds.
CASES = [("dp", "context:4", "all-gather"), ("dp", "context:4", "ring"),
         ("fsdp", "fsdp:2,context:4", "all-gather")]


def tiny(exchange: str):
  return dataclasses.replace(registry.load("tiny"), max_seq_len=SEQ, attention="flash",
                             kv_exchange=exchange)


@functools.cache
def planned_and_compiled(strategy: str, mesh: str, exchange: str):
  model, spec = tiny(exchange), mesh_lib.load(mesh)
  batch = BATCH * spec.size("fsdp")
  train = config.TrainConfig(global_batch=batch, seq_len=SEQ, precision="fp32", remat="none")
  cfg = config.Config(model=model, mesh=mesh, strategy=strategy, train=train)
  report = aot.compile_step(cfg, jax.devices()[:spec.n_devices], f"cpu x{spec.n_devices}")
  req = plan.Request.of(model="tiny", precision="fp32", global_batch=batch, seq_len=SEQ,
                        remat="none", strategy=strategy)
  est = plan.estimate(req, model, hardware.get("h100-80g"), spec, strategy, backend="cpu")
  return est, report


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_memory_and_kv_exchange_match_the_compiled_step(case):
  est, report = planned_and_compiled(*case)
  assert est.memory.total == pytest.approx(report.total_bytes, rel=0.15)
  kinds = (("collective-permute",) if case[2] == "ring" else
           ("all-gather", "reduce-scatter", "collective-permute"))
  for kind in kinds:
    assert report.kinds()[kind]["bytes"] > 0
    assert est.collectives[kind] == pytest.approx(report.kinds()[kind]["bytes"], rel=0.05)
  if case[2] == "ring":  # no K/V is ever gathered whole
    assert report.kinds()["all-gather"]["bytes"] == 0 == est.collectives["all-gather"]


@pytest.mark.slow
def test_weight_gradients_are_reduced_over_the_context_axis():
  """On context:4 alone every weight's gradient is a partial sum over the four devices:
  one all-reduce of every fp32 parameter, in the compiled step and in the formula."""
  est, report = planned_and_compiled("dp", "context:4", "all-gather")
  params = registry.load("tiny").n_params * 4
  assert report.kinds()["all-reduce"]["bytes"] == pytest.approx(params, rel=0.01)
  assert est.collectives["all-reduce"] == pytest.approx(params, rel=0.01)


def test_flops_per_device_fall_with_the_context_degree():
  req = plan.Request.of(model="125m", global_batch=2, seq_len=16384, remat="none", strategy="dp")
  model, acc = registry.load("125m"), hardware.get("tpu-v5e")
  one, four = (plan.estimate(req, model, acc, mesh_lib.load(m)) for m in ("data:2",
                                                                         "data:2,context:4"))
  assert four.flops_per_device == pytest.approx(one.flops_per_device / 4)


def test_search_picks_a_context_axis_for_a_long_sequence():
  """125m at 16384 tokens, 2 sequences on 8 v5e chips (xla attention: B×H×L×L scores): the
  fastest fitting layout splits the sequence, and the search offers context degrees that
  leave each device at least MIN_CONTEXT_SHARD tokens."""
  req = plan.Request.of(model="125m", global_batch=2, seq_len=16384, remat="full",
                        target="tpu-v5e", devices=8)
  found = plan.search(req, registry.load("125m"), hardware.get("tpu-v5e"), 8)
  assert found[0].mesh_shape.get("context", 1) > 1
  without = [e for e in found if e.mesh_shape.get("context", 1) == 1]
  assert all(e.step_s >= found[0].step_s for e in without)
  assert {s.get("context", 1) for s in plan.factorizations(64, 16384)} == {1, 2, 4, 8, 16}
  assert {s.get("context", 1) for s in plan.factorizations(8, 2048)} == {1, 2}
  assert {s.get("context", 1) for s in plan.factorizations(8)} == {1}


def test_longest_context_is_the_edge_of_what_fits():
  model = dataclasses.replace(registry.load("125m"), attention="flash")
  acc = hardware.get("tpu-v5e")
  req = plan.Request.of(model="125m", global_batch=2, remat="full", target="tpu-v5e")
  rows = longest_context.longest(req, model, acc, 8)
  assert [r.context for r in rows] == [1, 2, 4, 8]
  for r in rows:
    assert r.seq_len > 0 and r.best.fits and r.best.mesh_shape.get("context", 1) == r.context
    unit = max(longest_context.GRANULE, 2 * r.context)
    assert longest_context.fastest_fitting(req, model, acc, 8, r.context,
                                           r.seq_len + unit) is None
  # Every row leaves a device a quarter of a sequence's activations (one sequence over
  # context × sequence-parallel tensor = 4, or two over 8), so each fits about as long a
  # one: within 15%, since the loss stage's backward holds the B×L×D final-norm buffers
  # beside the fp32 logits (memory.loss_transients), which the context=1 row's tensor
  # parallelism does not split (371,712 tokens there, 406,528-424,960 in the others).
  assert max(r.seq_len for r in rows) <= 1.15 * min(r.seq_len for r in rows)


def test_cli_longest_context(capsys):
  assert plan_main(["longest-context", "--model", "125m", "--devices", "8", "--target",
                    "tpu-v5e", "--global-batch", "2", "--attention", "flash"]) == 0
  out = capsys.readouterr().out
  assert "longest sequence that fits 125m on 8 × tpu-v5e" in out and "context=8" in out
  assert plan_main(["longest-context", "--model", "125m", "--target", "tpu-v5e"]) == 2
  assert "longest-context needs --devices N" in capsys.readouterr().err
  # The old mode flag is refused, naming the subcommand.
  assert plan_main(["--model", "125m", "--devices", "8", "--longest-context"]) == 2
  assert "shardlab plan longest-context" in capsys.readouterr().err
