"""`shardlab inspect`: per-device bytes add up to the state, specs match the rules, large
replicated parameters are reported."""

import dataclasses
import json
import math

import jax
import pytest

import helpers
from shardlab.cli import inspect as inspect_cli
from shardlab.plan.training import layout as inspect_state
from shardlab.sharding import mesh as mesh_lib
from shardlab.plan.training import planner as plan
from shardlab.sharding import rules as rules_lib
from shardlab.training import state as state_lib
from shardlab.training import run as run_lib


def layout_for(strategy: str, mesh: str):
  run = helpers.run(strategy, mesh)
  abstract = run_lib.abstract_state(run.cfg)
  spec = mesh_lib.load(mesh).resolve(8)
  sh = state_lib.shardings(abstract, run.rules, plan.abstract_mesh(spec))
  return run, abstract, sh, inspect_state.layout(run.cfg, abstract, sh)


@pytest.mark.parametrize("strategy", ["fsdp", "tp", "zero1"])
def test_bytes_add_up_to_the_state(strategy):
  run, abstract, sh, lay = layout_for(strategy, helpers.MESHES[strategy])
  # Every leaf's shards cover it: per-device bytes × shards = its global bytes.
  for row in lay.params + lay.opt_state:
    shards = math.prod(row.shape) // max(math.prod(row.local_shape), 1)
    itemsize = row.local_bytes // max(math.prod(row.local_shape), 1)
    assert row.local_bytes * shards == math.prod(row.shape) * itemsize, row
  global_bytes = sum(leaf.size * leaf.dtype.itemsize
                     for leaf in jax.tree.leaves(abstract.state.params))
  assert sum(r.size * r.local_bytes // math.prod(r.local_shape)
             for r in lay.params) == global_bytes
  if strategy == "zero1":  # stored (master) weights and optimizer state split 8 ways
    assert lay.bytes_per_device()["params"] == global_bytes // 8
    assert lay.bytes_per_device()["opt_state"] < global_bytes / 2
    return  # (the compiled comparison below is made for fsdp and tp, compiled anyway)
  # And the per-device total is what XLA allocates for the state argument of the real step.
  t = run.cfg.train
  batch_shards = math.prod(run.mesh.shape.get(a, 1) for a in run.rules.batch_axes)
  batch_bytes = t.global_batch * (t.seq_len + 1) * 4 // batch_shards
  compiled = run.compiled_step.memory_analysis().argument_size_in_bytes
  assert lay.bytes_per_device()["state"] + batch_bytes == compiled


def test_specs_and_per_device_shapes_follow_the_rules():
  _, _, _, lay = layout_for("fsdp_tp", "fsdp:4,tensor:2")
  rows = {r.path: r for r in lay.params}
  q = rows["blocks.attn.q_DxHxE"]
  assert q.names == ("layers", "embed", "heads", "head_dim")
  assert tuple(q.spec) == (None, "fsdp", "tensor")
  assert q.local_shape == (2, 32, 4, 16)
  acts = {r.path: r for r in lay.activations}
  assert tuple(acts["residual"].spec) == ("fsdp",)
  assert tuple(acts["queries"].spec) == ("fsdp", None, "tensor")
  assert tuple(acts["kv_cache"].spec) == (None, "fsdp", None, "tensor")
  assert acts["logits"].dtype == "float32"


def test_warns_about_large_replicated_parameters():
  cfg = dataclasses.replace(helpers.make_config("tp", "data:2,tensor:4"),
                            rules={"params": {"mlp": None}})
  abstract = run_lib.abstract_state(cfg)
  sh = state_lib.shardings(abstract, rules_lib.strategy("tp", cfg.rules),
                           plan.abstract_mesh(mesh_lib.load(cfg.mesh)))
  lay = inspect_state.layout(cfg, abstract, sh)
  warned = " ".join(lay.warnings)
  for name in ("gate_DxF", "up_DxF", "down_FxD"):
    assert f"blocks.mlp.{name}" in warned
  assert "attn" not in warned  # still sharded over tensor
  assert not layout_for("fsdp", "fsdp:-1")[3].warnings
  assert not layout_for("dp", "data:-1")[3].warnings  # replicated by design


def test_cli_table_and_json(capsys):
  args = ["--model", "125m", "--mesh", "v5e-256", "--strategy", "fsdp_tp", "--activations",
          "--set", "train.global_batch=256"]
  assert inspect_cli.inspect_main(args) == 0
  out = capsys.readouterr().out
  assert "blocks.mlp.down_FxD" in out and "PartitionSpec" in out and "kv_cache" in out
  assert "per device:" in out
  assert inspect_cli.inspect_main(args + ["--json"]) == 0
  data = json.loads(capsys.readouterr().out)
  assert data["bytes_per_device"]["state"] > 0 and data["activations"]
  assert inspect_cli.inspect_main(["--strategy", "nope"]) == 2
  assert "unknown strategy 'nope'" in capsys.readouterr().err


def test_cli_compiles_and_lists_collectives(tmp_path, capsys):
  m = helpers.MICRO
  model = tmp_path / "micro.toml"
  model.write_text("\n".join(f"{f} = {getattr(m, f)}" for f in (
      "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
      "max_seq_len")))
  t = helpers.TRAIN  # the settings of helpers.run("fsdp"): XLA's cache holds that compile
  sets = [f"train.{k}={getattr(t, k)}" for k in ("steps", "global_batch", "seq_len", "lr",
                                                   "warmup_steps", "seed")]
  args = ["--model", str(model), "--mesh", "fsdp:-1", "--strategy", "fsdp", "--collectives",
          "--set", "train.precision='fp32'"] + [a for s in sets for a in ("--set", s)]
  assert inspect_cli.inspect_main(args) == 0
  out = capsys.readouterr().out
  assert "compiled train step on 8 cpu device(s)" in out
  assert "all-gather" in out and "over fsdp" in out
  assert inspect_cli.inspect_main(["--mesh", "v5e-256", "--model", "125m", "--collectives",
                                   "--set", "train.global_batch=256"]) == 2
  assert "--simulate-devices 256" in capsys.readouterr().err
