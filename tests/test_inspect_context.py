"""`shardlab inspect --activations` shows the sequence split: context parallelism puts the
`context` mesh axis on every activation's length dim, Megatron sequence parallelism puts
`tensor` on the residual stream's (and only there), and the per-device shapes divide the
length accordingly. The rows are read from `--json`; nothing is compiled."""

import json

import pytest

from shardlab.cli import inspect as inspect_cli

SEQ, BATCH = 1024, 8
SETTINGS = [f"train.seq_len={SEQ}", f"model.max_seq_len={SEQ}", f"train.global_batch={BATCH}"]
D, H, K, E, F = 128, 4, 2, 32, 384  # tiny: d_model, heads, kv heads, head_dim, mlp

# strategy, mesh -> {activation: (spec, per-device shape)}
CASES = {
    # Context parallelism alone: batch over data (2), every length over context (4).
    ("dp", "data:2,context:4"): {
        "residual": ("(data, context)", [4, SEQ // 4, D]),
        "queries": ("(data, context)", [4, SEQ // 4, H, E]),
        "keys_values": ("(data, context)", [4, SEQ // 4, K, E]),
        "mlp_hidden": ("(data, context)", [4, SEQ // 4, F]),
    },
    # Sequence parallelism: only the residual stream's length goes over tensor; attention
    # and the MLP see the whole sequence and split heads / mlp instead.
    ("fsdp_tp_sp", "fsdp:4,tensor:2"): {
        "residual": ("(fsdp, tensor)", [2, SEQ // 2, D]),
        "queries": ("(fsdp, *, tensor)", [2, SEQ, H // 2, E]),
        "keys_values": ("(fsdp, *, tensor)", [2, SEQ, K // 2, E]),
        "mlp_hidden": ("(fsdp, *, tensor)", [2, SEQ, F // 2]),
    },
    # Both (3-D): the residual stream's length over context × tensor, the rest over context.
    ("fsdp_tp_sp", "fsdp:2,context:2,tensor:2"): {
        "residual": ("(fsdp, context×tensor)", [4, SEQ // 4, D]),
        "queries": ("(fsdp, context, tensor)", [4, SEQ // 2, H // 2, E]),
        "keys_values": ("(fsdp, context, tensor)", [4, SEQ // 2, K // 2, E]),
        "mlp_hidden": ("(fsdp, context, tensor)", [4, SEQ // 2, F // 2]),
    },
}


def inspect_json(capsys, strategy: str, mesh: str) -> dict:
  args = ["--model", "tiny", "--mesh", mesh, "--strategy", strategy, "--activations", "--json"]
  assert inspect_cli.inspect_main(args + [a for s in SETTINGS for a in ("--set", s)]) == 0
  return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_activation_rows_show_the_sequence_split(capsys, case):
  out = inspect_json(capsys, *case)
  rows = {r["path"]: r for r in out["activations"]}
  for what, (spec, local_shape) in CASES[case].items():
    row = rows[what]
    assert (row["spec"], row["local_shape"]) == (spec, local_shape), row
    assert row["shape"][:2] == [BATCH, SEQ], row
  assert rows["residual"]["names"] == ["batch", "residual_length", "embed"]
  assert rows["queries"]["names"] == ["batch", "length", "heads", "head_dim"]
  assert not out["warnings"]


def test_dp_replicates_the_state_over_context(capsys):
  """Under dp the context axis splits only activations: parameters and optimizer state are
  replicated over it, so data:2,context:4 holds per device what data:8 does."""
  with_context = inspect_json(capsys, "dp", "data:2,context:4")
  data_only = inspect_json(capsys, "dp", "data:8")
  assert with_context["bytes_per_device"] == data_only["bytes_per_device"]
  assert all("context" not in r["spec"] for r in with_context["params"])
