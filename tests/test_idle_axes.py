"""A mesh axis no rule splits over is idle: its devices duplicate each other's work. Runs
warn, naming the strategies that would use it."""

import pytest

from shardlab.sharding import idle, rules


@pytest.mark.parametrize("strategy, shape, idle_axes", [
    ("fsdp", {"data": 1, "fsdp": 4, "tensor": 2}, ["tensor"]),  # train.py's cpu-8 mesh
    ("dp", {"data": 2, "fsdp": 1, "tensor": 4}, ["tensor"]),
    ("tp", {"data": 2, "fsdp": 2, "tensor": 2}, []),  # fsdp splits the batch under tp
    ("fsdp_tp", {"data": 1, "fsdp": 4, "tensor": 2}, []),
    ("dp", {"data": 4, "context": 2, "stage": 1}, []),  # context splits the sequence
    ("fsdp", {"fsdp": 4, "stage": 2}, []),  # stage splits the layers in every strategy
])
def test_idle_axes_are_named(strategy, shape, idle_axes):
  lines = idle.warnings(rules.strategy(strategy), shape)
  assert [line.split("mesh axis ")[1].split()[0] for line in lines] == idle_axes


def test_the_warning_says_what_to_do():
  (line,) = idle.warnings(rules.strategy("fsdp"), {"fsdp": 4, "tensor": 2})
  assert line == ("warning: mesh axis tensor (size 2) is split by no rule of strategy fsdp: "
                  "its 2 devices hold the same shards and compute the same values. Drop it "
                  "from the mesh, or use a strategy that splits over it (tp, fsdp_tp, tp_sp, "
                  "fsdp_tp_sp)")
  overridden = rules.strategy("fsdp", {"params": {"mlp": "tensor"}})
  assert idle.warnings(overridden, {"fsdp": 4, "tensor": 2}) == []  # a rule of one's own
