"""The TOML readers fuzzed: target (runtime/hardware.py), mesh (sharding/mesh.py), model
(models/registry.py) and run (cli/run_config.py) files. Each input is accepted, and then
holds only valid values, or refused by a ConfigError naming the file (tests/fuzz_harness.py)."""

import math

import pytest
from hypothesis import given, strategies as st

from fuzz_harness import _count_inputs, damaged, mutations, outcome, to_toml, write  # noqa: F401
from shardlab import cli
from shardlab.cli import run_config
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib

TARGET = {"base": "a100-80g", "peak_flops": 1e14, "hbm_bytes": 2**34, "hbm_bw": 1e12,
          "ici_bw": 1e11, "dcn_bw": 1e10, "ici_domain": 8, "reserve_bytes": 2**30,
          "kind": "gpu", "efficiency": 0.5, "host_bw": 3e10}
MESH = {"description": "fuzzed", "accelerator": "cpu", "ici": {"fsdp": 4, "tensor": 2},
        "dcn": {"data": 1}}
MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "head_dim": 16, "mlp_dim": 128, "max_seq_len": 64, "norm_eps": 1e-5,
         "rope_theta": 10000.0}
RUN = {"model": "tiny", "strategy": "fsdp", "mesh": "cpu-8", "seed": 0,
       "train": {"steps": 2, "lr": 1e-3, "global_batch": 8, "seq_len": 32}}


def _target_ok(acc: hardware.Accelerator) -> None:
  """What an accepted target must hold: the planner divides by these."""
  for f in ("peak_flops", "hbm_bytes", "hbm_bw", "ici_bw", "dcn_bw", "host_bw",
            "reserve_bytes", "efficiency"):
    v = getattr(acc, f)
    assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (f, v)
  assert 0 < acc.efficiency <= 1 and acc.host_bw > 0 and acc.reserve_bytes >= 0
  assert isinstance(acc.ici_domain, int) and acc.ici_domain >= 1
  assert acc.kind in ("gpu", "tpu", "cpu")


def test_valid_target_reads(tmp_path):
  _target_ok(hardware.from_file(str(write(tmp_path / "t.toml", to_toml(TARGET)))))


@given(fields=mutations(TARGET))
def test_target_fields(tmp_path_factory, fields):
  path = write(tmp_path_factory.mktemp("t") / "target.toml", to_toml(fields))
  acc = outcome(lambda: hardware.from_file(str(path)), "target.toml")
  if acc is not None:
    _target_ok(acc)


@given(raw=damaged(to_toml(TARGET).encode()))
def test_target_bytes(tmp_path_factory, raw):
  path = write(tmp_path_factory.mktemp("t") / "target.toml", raw)
  acc = outcome(lambda: hardware.from_file(str(path)), "target.toml")
  if acc is not None:
    _target_ok(acc)


def _mesh_ok(spec) -> None:
  for part in (spec.ici, spec.dcn):
    assert all(type(s) is int and (s >= 1 or s == -1) for s in part.values()), part


@given(fields=st.one_of(mutations(MESH), mutations(MESH["ici"]).map(
    lambda ici: {**MESH, "ici": ici})))
def test_mesh_fields(tmp_path_factory, fields):
  path = write(tmp_path_factory.mktemp("m") / "mymesh.toml", to_toml(fields))
  spec = outcome(lambda: mesh_lib.load(str(path)), "mymesh")
  if spec is not None:
    _mesh_ok(spec)


@given(raw=damaged(to_toml(MESH).encode()))
def test_mesh_bytes(tmp_path_factory, raw):
  path = write(tmp_path_factory.mktemp("m") / "mymesh.toml", raw)
  spec = outcome(lambda: mesh_lib.load(str(path)), "mymesh")
  if spec is not None:
    _mesh_ok(spec)


def _model_ok(m) -> None:
  for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
            "mlp_dim", "max_seq_len"):
    assert type(getattr(m, f)) is int and getattr(m, f) >= 1, (f, getattr(m, f))
  assert math.isfinite(m.norm_eps) and m.norm_eps > 0 and math.isfinite(m.rope_theta)


@given(fields=mutations(MODEL))
def test_model_fields(tmp_path_factory, fields):
  path = write(tmp_path_factory.mktemp("mo") / "mymodel.toml", to_toml(fields))
  m = outcome(lambda: registry.load(str(path)), "mymodel.toml")
  if m is not None:
    _model_ok(m)


@given(raw=damaged(to_toml(MODEL).encode()))
def test_model_bytes(tmp_path_factory, raw):
  path = write(tmp_path_factory.mktemp("mo") / "mymodel.toml", raw)
  m = outcome(lambda: registry.load(str(path)), "mymodel.toml")
  if m is not None:
    _model_ok(m)


@given(fields=st.one_of(mutations(RUN), mutations(RUN["train"]).map(
    lambda train: {**RUN, "train": train})))
def test_run_fields(tmp_path_factory, fields):
  path = write(tmp_path_factory.mktemp("r") / "myrun.toml", to_toml(fields))
  cfg = outcome(lambda: run_config.load(str(path)), "myrun.toml")
  if cfg is not None:
    assert math.isfinite(cfg.train.lr) and cfg.train.steps >= 0


@given(raw=damaged(to_toml(RUN).encode()))
def test_run_bytes(tmp_path_factory, raw):
  path = write(tmp_path_factory.mktemp("r") / "myrun.toml", raw)
  outcome(lambda: run_config.load(str(path)), "myrun.toml")


@pytest.mark.parametrize("field,value,says", [
    ("hbm_bw", "fast", "hbm_bw = 'fast' is not valid; valid: a finite number >= 1"),
    ("efficiency", 0, "efficiency = 0 is not valid; valid: a finite number >= 1e-06 and <= 1"),
    ("efficiency", -0.4, "efficiency = -0.4 is not valid"),
    ("dcn_bw", 0, "dcn_bw = 0 is not valid"),
    ("ici_bw", math.inf, "ici_bw = inf is not valid"),
    ("kind", "fpu", "kind = 'fpu' is not valid; valid: one of gpu, tpu"),
    ("ici_domain", 2.5, "ici_domain = 2.5 is not valid; valid: an integer >= 1"),
])
def test_target_cases_exit_2_naming_file_and_field(tmp_path, capsys, field, value, says):
  """The target files that once divided by zero, raised a TypeError or planned with a
  negative efficiency: `shardlab plan` exits 2 naming the file, the field and what is valid."""
  path = write(tmp_path / "target.toml", to_toml({"base": "h100-80g", field: value}))
  if field != "efficiency":  # the reader's message (the CLI's, once: it plans for seconds)
    with pytest.raises(ConfigError) as e:
      hardware.get(str(path))
    assert str(path) in str(e.value) and says in str(e.value), e.value
    return
  assert cli.main(["plan", "--model", "tiny", "--target", str(path)]) == 2
  err = capsys.readouterr().err
  assert str(path) in err and says in err and "Traceback" not in err, err
