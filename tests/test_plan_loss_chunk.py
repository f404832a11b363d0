"""The planner under train.loss_chunk (parallel/loss.py: the loss a chunk of positions at a
time, so one chunk's fp32 logits are live): planned against the step XLA:CPU compiles on
simulated devices, with a vocabulary large enough that the logits are the step's largest
buffer (16384 × 256 positions × 2 sequences a device: 33.6 MB of fp32 logits, beside 0.4 MB
a layer of saved inputs).

Not compiled for a TPU here: at d_model 128 the TPU compiler fuses the head's matmul into
the loss's reductions and never writes the logits (its buffer assignment holds 11.7 MB,
chunked or not). Where it writes them (llama3-8b, 4 × 8192 tokens a v6e chip: 19.45 GiB,
7.42 in 2048-position chunks) the planner's TPU branch is checked by `bench/plan_tpu.py
--only llama3_1-8b-8192/v6e-256 [--set train.loss_chunk=2048]`."""

import dataclasses

import pytest

from shardlab.models import registry
from shardlab.plan.compiled import aot
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.training import planner as plan
from shardlab.runtime import hardware

MODEL = """
vocab_size = 16384
d_model = 128
n_layers = 2
n_heads = 4
n_kv_heads = 2
head_dim = 32
mlp_dim = 256
max_seq_len = 512
attention = "xla"
"""
DEVICES, CHUNK = 4, 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("loss-chunk") / "big-vocab.toml"
  path.write_text(MODEL)
  return str(path)


def request(model_path: str, chunk: int, remat: str) -> plan.Request:
  req = plan.Request.of(model=model_path, optimizer="sgd", precision="bf16", global_batch=8,
                        seq_len=256, remat=remat, strategy="fsdp", devices=DEVICES,
                        target="tpu-v5e")
  return dataclasses.replace(req, train=dataclasses.replace(req.train, loss_chunk=chunk))


def planned_and_compiled(model_path: str, chunk: int, remat: str):
  req = request(model_path, chunk, remat)
  spec = plan_compile._spec(req)
  report = aot.compile_on_cpu(plan_compile.run_config(req, spec), DEVICES)
  est = plan.estimate(req, registry.load(model_path), hardware.get("tpu-v5e"), spec,
                      backend="cpu")
  return est.memory.total, report.total_bytes


@pytest.mark.parametrize("remat", ["full", "none"])
def test_a_chunked_loss_is_planned_as_the_cpu_compiler_holds_it(model_path, remat):
  """Within 15% chunked and whole (measured: 0.96 and 1.06 under full remat, 0.88 and
  0.99 without), and the chunks save what the compiler saves to within 15% of the whole
  step: before the planner modelled train.loss_chunk it planned the chunked step as the
  whole one, 1.54× what it holds."""
  chunked, chunked_compiled = planned_and_compiled(model_path, CHUNK, remat)
  whole, whole_compiled = planned_and_compiled(model_path, 0, remat)
  assert chunked / chunked_compiled == pytest.approx(1, abs=0.15), (chunked, chunked_compiled)
  assert whole / whole_compiled == pytest.approx(1, abs=0.15), (whole, whole_compiled)
  saved, saved_compiled = whole - chunked, whole_compiled - chunked_compiled
  assert abs(saved - saved_compiled) <= 0.15 * whole_compiled, (saved, saved_compiled)

