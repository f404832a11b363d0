"""What gradient accumulation costs in compiled bytes: the train step with 4 microbatches
against the same step with 1, under FSDP, on simulated CPU devices and for a TPU topology.

Accumulating into the sharded gradient, with each microbatch's gradient reduced to its shard
where it is made, 4 microbatches hold at most 1 microbatch's bytes plus one microbatch's
activations. The batch is small beside the weights here, so a second gradient buffer shows
(one microbatch's activations, 2.2 MB, are under half of one fp32 gradient shard, 5.8 MB).

That bound assumes the 1-microbatch step holds its whole gradient at its peak. XLA:CPU's
peak comes earlier, in the backward pass, while the batch's activations are all live and the
gradient is not yet whole, so there the bound holds only once those activations outweigh
what the gradient still lacks at that point, as they do in any real run. At 16 sequences (32
tokens a device a microbatch) they did not: 42.0 MB with 4 microbatches against 39.5 + 1.4
MB. At 48, 42.6 MB against 41.8 + 2.2 MB; with the in-scan accumulation switched off
(`accumulate.active` returning None) 47.3 MB, so the test still catches a second gradient
buffer. The TPU compiler holds 14.0 MB with 4 microbatches against 13.95 with 1, and 14.3
with the in-scan path off: it adds each layer's gradient into the accumulator as it goes
either way.
"""

import re
from unittest import mock

import pytest

from shardlab.models import registry
from shardlab.parallel import accumulate
from shardlab.plan.compiled import aot
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.training import planner as plan
from shardlab.runtime import hardware
from test_plan_tpu import MODEL  # TPU-friendly dims: tiled layouts add no padding

DEVICES = 4
BATCH = 48  # sequences; the module docstring says why not fewer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("accumulation") / "tpu-small.toml"
  path.write_text(MODEL)
  return str(path)


def request(model_path: str, microbatches: int) -> plan.Request:
  # SGD keeps the compiles short: the optimizer state is the same with 1 or 4 microbatches.
  return plan.Request.of(model=model_path, optimizer="sgd", precision="bf16", global_batch=BATCH,
                         seq_len=32, remat="full", strategy="fsdp", devices=DEVICES,
                         target="tpu-v5e", microbatches=microbatches)


def config(req: plan.Request):
  return plan_compile.run_config(req, plan_compile._spec(req))


def activations(model_path: str, microbatches: int) -> float:
  """The planner's activations of one microbatch, per device."""
  req = request(model_path, microbatches)
  return plan.estimate(req, registry.load(model_path), hardware.get("tpu-v5e"),
                       plan_compile._spec(req)).memory.activations


@pytest.fixture(scope="module")
def cpu_bytes(model_path):
  """Compiled argument + temp bytes per device, by microbatch count."""
  out = {}
  for m in (1, 4):
    r = aot.compile_on_cpu(config(request(model_path, m)), DEVICES)
    out[m] = r.argument_bytes + r.temp_bytes
  return out


def test_cpu_accumulation_within_one_microbatch_of_activations(model_path, cpu_bytes):
  assert cpu_bytes[4] <= cpu_bytes[1] + activations(model_path, 4), cpu_bytes


def test_cpu_accumulation_inside_the_layer_scan_holds_no_second_gradient_nor_working_copy(
    tmp_path):
  """8 layers, 4 microbatches, full remat, bf16 compute over fp32 weights, compiled three
  ways: as shipped (shardlab/parallel/accumulate.py: the layer scan adds each layer's
  gradient into the accumulator in its backward pass, and casts each layer's stored fp32
  weights to bf16 as it runs it); reading the step's bf16 working copy of the whole stack
  instead; and adding each microbatch's whole gradient after it (the in-scan path off).
  Measured 86.3, 105.1 and 112.2 MB, where the working copy's shard is 10.0 MB and one fp32
  gradient shard 19.9 MB: the per-layer cast saves more than the working copy (XLA:CPU
  also held an fp32 copy of it to compute in); XLA:CPU's own copies of the layer's gathered
  weights keep the in-scan sum from saving all of a gradient shard."""
  path = tmp_path / "tpu-small-8.toml"
  path.write_text(MODEL.replace("n_layers = 2", "n_layers = 8"))
  req = request(str(path), 4)

  def compiled() -> int:
    r = aot.compile_on_cpu(config(req), DEVICES)
    return r.argument_bytes + r.temp_bytes

  shipped = compiled()
  with accumulate.reading_the_working_copy():
    working = compiled()
  with mock.patch.object(accumulate, "active", return_value=None):
    after = compiled()
  n_params = registry.load(str(path)).n_params
  bf16_shard, fp32_shard = n_params * 2 / DEVICES, n_params * 4 / DEVICES
  assert shipped <= working - bf16_shard, (shipped, working, bf16_shard)
  assert working <= after - fp32_shard / 4, (working, after, fp32_shard)


def _dump_total(dump) -> int:
  """The TPU compiler's buffer total (a compile-only TPU executable reports no temp bytes
  through memory_analysis; its buffer assignment has them)."""
  report, = dump.glob("*train_step*memory-usage-report.txt")
  return int(report.read_text().split("Total bytes: ")[1].split()[0])


def _bf16_twins_of_the_stack(dump, layers: int) -> tuple[set, set]:
  """(the per-device shapes of the stacked fp32 params that a bf16 array of the same shape
  shadows anywhere in the optimized program — a working copy of the stack —, all the
  stacked fp32 params' shapes), from the entry computation's signature."""
  hlo, = dump.glob("*train_step*after_optimizations.txt")
  text = hlo.read_text()
  signature = next(line for line in text.splitlines() if line.startswith("ENTRY"))
  stacked = {dims for dims in re.findall(r"f32\[(\d+(?:,\d+)+)\]", signature.split("->")[0])
             if int(dims.split(",")[0]) == layers}
  return {dims for dims in stacked if f"bf16[{dims}]" in text}, stacked


@pytest.fixture(scope="module")
def tpu_dumps(model_path, tmp_path_factory):
  """The TPU compiler's dumps of the step with 1 and 4 microbatches."""
  root = tmp_path_factory.mktemp("tpu-accumulation")
  for m in (1, 4):
    aot.compile_on_tpu(config(request(model_path, m)), "v5e", DEVICES, dump=root / str(m))
  return {m: root / str(m) for m in (1, 4)}


needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(),
    reason="libtpu is not installed (pip install 'jax[tpu]==0.10.2'; it needs no TPU)")


@needs_libtpu
def test_tpu_accumulation_within_one_microbatch_of_activations(model_path, tpu_dumps):
  total = {m: _dump_total(d) for m, d in tpu_dumps.items()}
  assert total[4] <= total[1] + activations(model_path, 4), total


@needs_libtpu
def test_tpu_accumulating_layer_scan_holds_no_bf16_copy_of_the_stack(model_path, tpu_dumps):
  """With 4 microbatches the layer scan casts each layer's fp32 weights as it runs it, and
  the TPU compiler keeps it so (it moved a plain cast of each layer's slice onto the whole
  stack, out of both loops: shardlab/parallel/accumulate.py's _cast_in_loop). One
  microbatch reads the step's bf16 working copy, so there every stacked param has its
  bf16 twin: the check finds one where there is one."""
  layers = registry.load(model_path).n_layers
  twins, stacked = _bf16_twins_of_the_stack(tpu_dumps[4], layers)
  assert stacked and not twins, (twins, stacked)
  assert _bf16_twins_of_the_stack(tpu_dumps[1], layers)[0] == stacked
