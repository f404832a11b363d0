"""Long context, compiled: sequence parallelism turns tensor parallelism's all-reduces into
reduce-scatter + all-gather (TPU topology) and lowers activation bytes per device (CPU);
context parallelism lowers them as the context axis grows."""

import dataclasses
import functools
import importlib.util

import jax
import pytest

from shardlab import config
from shardlab.models import registry
from shardlab.observe.step_report import StepReport
from shardlab.plan.compiled import aot

MiB = 2**20


def tiny(seq: int, **model):
  return dataclasses.replace(registry.load("tiny"), max_seq_len=seq, **model)


@functools.cache
def compiled(strategy: str, mesh: str, seq: int, backend: str = "cpu", devices: int = 8,
             batch: int = 8, **model) -> StepReport:
  cfg = config.Config(model=tiny(seq, **dict(model)), mesh=mesh, strategy=strategy,
                      train=config.TrainConfig(global_batch=batch, seq_len=seq,
                                               precision="bf16", remat="none"))
  if backend == "tpu":
    if importlib.util.find_spec("libtpu") is None:
      pytest.skip("libtpu is not installed (pip install 'jax[tpu]'; compiling needs no TPU)")
    return aot.compile_step(cfg, list(aot.tpu_devices("v5e", 8)[0]), "tpu v5e:2x4")
  return aot.compile_step(cfg, jax.devices()[:devices], f"cpu x{devices}")


def count(report, kind):
  return report.kinds().get(kind, {}).get("count", 0)


def nbytes(report, kind):
  return report.kinds().get(kind, {}).get("bytes", 0)


def test_sequence_parallel_swaps_all_reduces_for_reduce_scatter_and_all_gather_on_tpu():
  """tiny (4 layers) on data:4 × tensor:2: TP all-reduces each block's output (twice a layer
  forward, more backward); with SP each becomes a reduce-scatter onto the sequence shards
  and an all-gather before the next block, and what is left all-reduced is small (the
  weight gradients' and the loss's)."""
  tp = compiled("tp", "data:4,tensor:2", 256, "tpu")
  sp = compiled("tp_sp", "data:4,tensor:2", 256, "tpu")
  layers = registry.load("tiny").n_layers
  assert count(tp, "reduce-scatter") == 0 and count(tp, "all-gather") == 0
  assert count(tp, "all-reduce") >= 4 * layers
  assert count(sp, "reduce-scatter") >= 4 * layers and count(sp, "all-gather") >= 4 * layers
  assert nbytes(sp, "all-reduce") < nbytes(tp, "all-reduce") / 3


def test_sequence_parallel_lowers_activation_bytes_on_cpu():
  """XLA:CPU forms no reduce-scatter (it all-reduces and slices), but it does all-gather the
  sequence shards over `tensor`, and each layer's norm inputs and outputs (4 B×L×D tensors a
  layer, 2 MiB at bf16 here) are kept at half size: at least 4 MiB less."""
  tp = compiled("tp", "data:4,tensor:2", 1024, attention="flash")
  sp = compiled("tp_sp", "data:4,tensor:2", 1024, attention="flash")
  assert count(tp, "all-gather") == 0 and count(sp, "all-gather") > 0
  m = registry.load("tiny")
  norm_tensors = m.n_layers * 4 * 2 * 1024 * m.d_model * 2
  assert sp.temp_bytes <= tp.temp_bytes - norm_tensors / 2, (tp.temp_bytes / MiB,
                                                              sp.temp_bytes / MiB)


@pytest.mark.slow
def test_activation_bytes_fall_as_the_context_axis_grows():
  """tiny at 2048 tokens, 2 sequences, ring attention: the compiled temporaries per device
  on 1, 2, 4 and 8 devices of a context axis (seen: 192, 170, 136, 66 MiB)."""
  temps = [compiled("dp", f"context:{c}", 2048, devices=c, batch=2, attention="flash",
                    kv_exchange="ring").temp_bytes for c in (1, 2, 4, 8)]
  assert all(a > b for a, b in zip(temps, temps[1:])), [t / MiB for t in temps]
  assert temps[-1] < temps[0] / 2
