"""The train step compiled by the real TPU compiler for a TPU topology, from this CPU machine
(libtpu is in the `test` extra, so CI has it; no TPU is needed)."""

import dataclasses

import pytest

from shardlab.plan.compiled import aot
from shardlab.runtime import hardware
from shardlab.plan.training import planner as plan
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.models import registry

pytestmark = pytest.mark.skipif(
    not aot.libtpu_available(),
    reason="libtpu is not installed (pip install 'jax[tpu]==0.10.2'; it needs no TPU)")

# TPU-friendly dims (head_dim 128, lane-aligned widths) so the tiled layouts add no padding.
MODEL = """
vocab_size = 1024
d_model = 512
n_layers = 2
n_heads = 4
n_kv_heads = 2
head_dim = 128
mlp_dim = 1024
max_seq_len = 512
"""


def test_topology_names():
  assert aot.tpu_topology_name("v5e", 256) == "v5e:16x16"
  assert aot.tpu_topology_name("v5e", 8) == "v5e:2x4"
  assert aot.tpu_topology_name("v5p", 4) == "v5p:2x2x1"
  assert aot.tpu_topology_name("v5p", 64) == "v5p:4x4x4"


def test_train_step_compiles_for_a_tpu_topology(tmp_path):
  model = tmp_path / "tpu-small.toml"
  model.write_text(MODEL)
  # SGD and no remat keep the TPU compile short on two CPU cores.
  req = plan.Request.of(model=str(model), optimizer="sgd", precision="bf16", global_batch=8,
                        seq_len=512, remat="none", strategy="fsdp", devices=4, target="tpu-v5e")
  spec = plan_compile._spec(req)
  report = aot.compile_on_tpu(plan_compile.run_config(req, spec), "v5e", 4,
                              dump=tmp_path / "dump")
  assert report.where == "tpu v5e:2x2" and report.n_devices == 4
  # The TPU compiler's own buffer assignment, for reading what is live at the peak.
  for kind in ("memory-usage-report", "live-range"):
    assert list((tmp_path / "dump").glob(f"*train_step*{kind}.txt")), kind
  est = plan.estimate(req, registry.load(str(model)), hardware.get("tpu-v5e"),
                      spec)
  ratio = plan_compile.compare(report, est)["ratio"]
  assert ratio["state"] == pytest.approx(1, abs=0.02), ratio
  assert ratio["all-gather"] == pytest.approx(1, abs=0.10), ratio
  # The TPU compiler reduce-scatters most gradients but all-reduces a few (it picks per
  # weight); the bytes convention is the same for both, so their sum is compared.
  got = {k: c["bytes"] for k, c in report.kinds().items()}
  reductions = got["reduce-scatter"] + got["all-reduce"]
  want = est.collectives["reduce-scatter"] + est.collectives["all-reduce"]
  assert want == pytest.approx(reductions, rel=0.10), (got, est.collectives)
  # Total memory is not asserted here: on a model this small the TPU compiler fuses away most
  # of what autodiff saves (temp 12 MB against the formula's 115 MB); the full-size figures
  # are in bench/plan_tpu.py.
  assert report.total_bytes > report.argument_bytes


@pytest.mark.slow
@pytest.mark.parametrize("strategy, mesh, remat, microbatches, scatters, tol", [
    ("tp_sp", "data:2,tensor:2", "none", 1, 9, 0.03),
    ("tp_sp", "data:2,tensor:2", "full", 2, 22, 0.03),
    # FSDP's weight gathers and gradient reduce-scatters beside SP's: measured 0.99 and 1.04
    # of the compiler's (the 4% of reduce-scatters is not broken down).
    ("fsdp_tp_sp", "fsdp:2,tensor:2", "full", 1, None, 0.06)])
def test_sequence_parallel_collectives_match_the_tpu_compiler(tmp_path, strategy, mesh, remat,
                                                               microbatches, scatters, tol):
  """tp_sp on data:2 × tensor:2: the TPU compiler reduce-scatters each block's output and its
  summed input gradients onto the sequence shards (2 + 2 a layer run, +1 under full remat,
  and the head's input gradient each microbatch: 9 and 22 here) and all-gathers the sequence
  before each matmul region (6 a layer run, 7 under full remat, and the head's input) and
  the vocab-sharded embedding table for the lookup; the planner's bytes of each within 3%
  (measured exact, both cases): without the seventh gather it was 0.88 of the compiled
  all-gathers under full remat, without the table 0.94 and 0.96. fsdp_tp_sp adds FSDP's
  collectives on fsdp:2 × tensor:2. About 7 s a case.
  Total memory is not asserted, as for fsdp above (llama2-7b's, on CPU:
  tests/test_plan_compile.py)."""
  model = tmp_path / "tpu-small.toml"
  model.write_text(MODEL)
  req = plan.Request.of(model=str(model), optimizer="sgd", precision="bf16", global_batch=8,
                        seq_len=512, remat=remat, microbatches=microbatches, strategy=strategy,
                        mesh=mesh, target="tpu-v5e")
  spec = plan_compile._spec(req)
  report = aot.compile_on_tpu(plan_compile.run_config(req, spec), "v5e", 4)
  est = plan.estimate(req, registry.load(str(model)), hardware.get("tpu-v5e"), spec)
  ratio = plan_compile.compare(report, est)["ratio"]
  assert ratio["state"] == pytest.approx(1, abs=0.02), ratio
  if scatters is not None:
    assert report.kinds()["reduce-scatter"]["count"] == scatters, report.kinds()
  for kind in ("reduce-scatter", "all-gather"):
    assert ratio[kind] == pytest.approx(1, abs=tol), (kind, ratio)


@pytest.mark.slow
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_gradients_are_reduced_in_the_matmul_dtype(tmp_path, grad_dtype):
  """zero2 reduce-scatters each gradient once, where the weight-gradient matmul makes it: in
  its bf16 output whatever dtype the gradients are held in afterwards (a cast to fp32 before
  the sharding constraint does not move the reduction); the planner agrees."""
  model = tmp_path / "tpu-small.toml"
  model.write_text(MODEL)
  req = plan.Request.of(model=str(model), optimizer="sgd", precision="bf16", global_batch=8,
                        seq_len=512, remat="none", strategy="zero2", mesh="data:4",
                        target="tpu-v5e", grad_dtype=grad_dtype)
  spec = plan_compile._spec(req)
  report = aot.compile_on_tpu(plan_compile.run_config(req, spec), "v5e", 4)
  est = plan.estimate(req, registry.load(str(model)), hardware.get("tpu-v5e"), spec)
  got = {k: c["bytes"] for k, c in report.kinds().items()}
  reductions = got["reduce-scatter"] + got["all-reduce"]
  n_params = registry.load(str(model)).n_params
  assert reductions == pytest.approx(n_params * 2, rel=0.10), got  # not 4 bytes a param
  want = est.collectives["reduce-scatter"] + est.collectives["all-reduce"]
  assert want == pytest.approx(reductions, rel=0.10), (got, est.collectives)


@pytest.mark.slow
@pytest.mark.parametrize("model, offload", [("llama2-7b", "none"), ("llama2-70b", "none"),
                                            ("llama2-7b", "opt_state")])
def test_planner_memory_matches_the_tpu_compiler_on_v5e_256(model, offload):
  """FSDP over a v5e-256, one 2048-token sequence per chip, full remat, bf16 compute over fp32
  weights (bench/plan_tpu.py's setup): the planner's per-chip total within 15% of the TPU
  compiler's. Measured 1.11 (7b, 2.54 GiB compiled) and 0.89 (70b, 13.97 GiB); each compile
  takes about 70 s on 2 cores (twice that beside other work). The compiler reports about 1
  (7b) to 4 GiB (70b) more temporary memory than its HLO buffer assignment holds at its peak
  (seen in the dumped assignment); the formula's two layers of weights stand in for part of
  it. With the optimizer state offloaded (7b: 2.48 GiB on the device, 0.32 in host memory)
  the state is host bytes; the compiler holds 33 MB more host memory than the state
  (measured 1.10, not broken down)."""
  # Plain attention, as measured (the presets run splash on a TPU: `attention = "auto"`).
  model = dataclasses.replace(registry.load(model), attention="xla")
  req = plan.Request.of(model=model, precision="bf16", global_batch=256, seq_len=2048,
                        remat="full", strategy="fsdp", devices=256, target="tpu-v5e",
                        offload=offload)
  spec = plan_compile._spec(req)
  report = aot.compile_on_tpu(plan_compile.run_config(req, spec), "v5e", 256)
  est = plan.estimate(req, model, hardware.get("tpu-v5e"), spec)
  ratio = plan_compile.compare(report, est)["ratio"]
  if offload == "none":
    assert ratio["state"] == pytest.approx(1, abs=0.02), ratio
  else:  # only the step counter and the batch are device arguments
    assert report.host_bytes == pytest.approx(est.memory.host, rel=0.15)
    assert report.argument_bytes < 0.001 * report.host_bytes
  assert ratio["total"] == pytest.approx(1, abs=0.15), (ratio, report.total_bytes)
