"""bench/plan_tpu.py's MaxText recipes say the same thing to both tools: shardlab's remat
policy keeps, offloads and recomputes what MaxText's keys ask for, and MaxText is named the
model and attention the recipe runs. The compiles themselves (minutes each, MaxText in its
own venv) are the benchmark's; this checks what it hands them."""

import sys
from pathlib import Path

import pytest

from shardlab import remat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import plan_tpu  # noqa: E402

# MaxText's remat_policy names and the shardlab policy each is (docs/remat.md).
NAMED = {"full": "full", "minimal": "save-matmul-outputs",
         "save_dot_except_mlpwi": "save-dot-except-mlpwi",
         "qkv_proj_offloaded": "qkv-proj-offloaded"}


def maxtext_policy(keys: dict) -> remat.Policy:
  """The Policy MaxText's keys describe: a named policy, or `custom` with per-name keys
  (its decoder_layer_input is shardlab's layer_input)."""
  if keys["remat_policy"] != "custom":
    return remat.POLICIES[NAMED[keys["remat_policy"]]]
  where = {("layer_input" if k == "decoder_layer_input" else k): v for k, v in keys.items()
           if k in (*remat.CUSTOM_NAMES, "decoder_layer_input")}
  return remat.Policy(saved=tuple(n for n in remat.CUSTOM_NAMES if where.get(n) == "device"),
                      offloaded=tuple(n for n in remat.CUSTOM_NAMES
                                      if where.get(n) == "offload"))


@pytest.mark.parametrize("name", plan_tpu.RECIPES)
def test_each_recipe_runs_maxtexts_policy_model_and_attention(name):
  recipe = plan_tpu.RECIPES[name]
  keys = dict(k.split("=", 1) for k in plan_tpu.maxtext_keys(name, None, []))
  assert remat.policy(recipe.remat) == maxtext_policy(keys), name
  assert keys["model_name"].replace("3.1", "3") == recipe.model, name
  assert keys["attention"] == "flash" and recipe.attention == "flash"
  assert int(keys["per_device_batch_size"]) == recipe.per_chip
  assert int(keys["max_target_length"]) == recipe.seq_len


def test_the_llama31_recipes_offload_what_maxtext_publishes():
  """benchmarks/maxtext_trillium_model_configs.py: llama3_1_8b_8192 offloads the decoder
  input and the q, k, v and out projections; llama3_1_70b_8192 the same but out_proj."""
  qkv = {"query_proj", "key_proj", "value_proj"}
  for name, offloaded in (("llama3_1-8b-8192/v6e-256", {"layer_input", *qkv, "out_proj"}),
                          ("llama3_1-70b-8192/v6e-256", {"layer_input", *qkv})):
    p = remat.policy(plan_tpu.RECIPES[name].remat)
    assert set(p.offloaded) == offloaded and not p.saved, name
