"""state.init_state compiles the initialiser at a lower LLVM optimisation level on CPU (it
runs once, and optimising its code took longer than running it): the state it makes is the
default-level compile's, bit for bit, for each family's initialisers, dtypes and optimizers."""

import pytest

import helpers as H
from shardlab.models import registry
from shardlab.sharding import mesh as mesh_lib
from shardlab.training import run as run_lib
from shardlab.training import state as state_lib

# XLA's own default LLVM level (xla/debug_options_flags.cc), asked for by name: the suite's
# XLA_FLAGS lower it for every other compile (shardlab/testing/fast_compile.py).
XLA_DEFAULT = {"cpu": {"xla_backend_optimization_level": 3}}


@pytest.mark.parametrize("model, strategy, train", [
    (H.MICRO, "fsdp_tp", {}),
    (H.MICRO, "zero1", {"precision": "bf16", "optimizer": "adafactor"}),
    ("gpt2-tiny", "fsdp", {}),
    ("moe-tiny", "fsdp", {"precision": "bf16"}),
    ("gemma2-tiny", "dp", {}),
])
def test_init_is_the_default_level_compile_bit_for_bit(model, strategy, train, monkeypatch):
  model = registry.load(model) if isinstance(model, str) else model
  cfg = H.make_config(strategy, H.MESHES[strategy], model=model, **train)
  abstract = run_lib.abstract_state(cfg)
  shardings = run_lib.shardings(cfg, abstract, mesh_lib.build(mesh_lib.parse_inline(cfg.mesh)))
  assert state_lib.INIT_COMPILER_OPTIONS["cpu"]  # what this test holds to the default
  shipped = state_lib.init_state(abstract, shardings)
  monkeypatch.setattr(state_lib, "INIT_COMPILER_OPTIONS", XLA_DEFAULT)
  H.assert_trees_equal(shipped, state_lib.init_state(abstract, shardings), model.name)
