"""The compiled-step report against collectives derived by hand for the micro model (fp32,
8 simulated CPU devices; XLA:CPU lowers a reduce-scatter as all-reduce + slice)."""

import math

import jax
import pytest

import helpers
from shardlab.observe import hlo_groups, step_report

F32 = 4


def param_bytes(run, where=lambda names: True) -> int:
  names = helpers.param_names(run.abstract)
  leaves = jax.tree_util.tree_flatten_with_path(run.abstract.state.params)[0]
  return sum(math.prod(a.shape) * F32 for p, a in leaves if where(names[helpers.dict_path(p)]))


def test_fsdp_gathers_weights_and_reduces_gradients_over_fsdp():
  run = helpers.run("fsdp")  # fsdp:8
  r = step_report.report(run.compiled_step, run.mesh).by_kind()
  assert set(r) == {"all-gather", "all-reduce", "all-to-all"}
  assert set(r["all-gather"]) == set(r["all-reduce"]) == set(r["all-to-all"]) == {"fsdp"}
  # Each scanned layer's weights are gathered in the forward and again in the backward; the
  # head and final norm once (the gathered copy is kept for the backward). The embedding is
  # looked up where it is stored: its rows travel (the all-to-all), not the table.
  table = lambda names: tuple(names) == ("vocab", "embed")
  stacked = param_bytes(run, lambda names: names[0] == "layers")
  unstacked = param_bytes(run, lambda names: names[0] != "layers" and not table(names))
  assert r["all-gather"]["fsdp"] == pytest.approx(2 * stacked + unstacked, rel=0.01)
  # Every other gradient is summed over the 8 batch shards (plus a few scalars: the loss);
  # the lookup's is scattered into each device's own shard of the table.
  assert r["all-reduce"]["fsdp"] == pytest.approx(param_bytes(run, lambda n: not table(n)),
                                                  rel=0.01)


def test_tp_reduces_activations_over_tensor_and_gradients_over_data():
  run = helpers.run("tp")  # data:2 × tensor:4
  m, t = run.cfg.model, run.cfg.train
  r = step_report.report(run.compiled_step, run.mesh).by_kind()
  assert set(r) == {"all-reduce"}
  assert set(r["all-reduce"]) == {"tensor", "data"}
  # Megatron: per layer, the row-parallel o and down projections reduce their B×L×D output
  # in the forward, and the five column-parallel input projections (q, k, v, gate, up) their
  # input gradient in the backward; plus the vocab-sharded embedding lookup and the head's
  # input gradient. B is the per-replica batch (data = 2).
  residual = t.global_batch // run.mesh.shape["data"] * t.seq_len * m.d_model * F32
  assert r["all-reduce"]["tensor"] == pytest.approx((7 * m.n_layers + 2) * residual, rel=0.01)
  # Gradients are summed over data, each device holding its tensor shard of them.
  shards = run.mesh.shape["tensor"]
  replicated = param_bytes(run, lambda names: set(names) <= {"layers", "embed"})
  per_device = (param_bytes(run) - replicated) / shards + replicated
  assert r["all-reduce"]["data"] == pytest.approx(per_device, rel=0.01)


def test_report_memory_and_render():
  run = helpers.run("fsdp")
  rep = step_report.report(run.compiled_step, run.mesh)
  assert rep.argument_bytes > 0 and rep.temp_bytes > 0
  assert rep.total_bytes == rep.argument_bytes + rep.output_bytes - rep.alias_bytes + \
      rep.temp_bytes
  text = "\n".join(step_report.render(rep))
  assert "all-gather" in text and "over fsdp" in text and "temporaries" in text


def test_replica_group_forms():
  mesh = helpers.run("tp").mesh  # data:2 × tensor:4, devices in row-major order

  def mesh_axes(attrs: str) -> str:  # what the report labels a collective with these groups
    return ",".join(hlo_groups.mesh_axes(hlo_groups.replica_groups(attrs, mesh.size), mesh))

  assert mesh_axes("replica_groups={{0,1,2,3},{4,5,6,7}}") == "tensor"
  assert mesh_axes("replica_groups=[4,2]<=[2,4]T(1,0)") == "data"
  assert mesh_axes("replica_groups={}") == "data,tensor"
  assert mesh_axes(
      "replica_groups=mesh['a'=2,'b'=4] {'b'}") == "tensor"
  assert mesh_axes("source_target_pairs={{0,4},{4,0}}") == "data"
