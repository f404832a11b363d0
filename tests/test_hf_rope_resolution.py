"""RoPE settings read from config.json exactly as transformers 5 resolves them: a legacy
`rope_scaling` block beside `rope_parameters`, a theta in either or at the top level, or
none (the family's default). Compared field by field with transformers' own config."""

import pytest

transformers = pytest.importorskip("transformers")

from shardlab.hf import config as hf_config  # noqa: E402
from shardlab.models import registry  # noqa: E402,F401 (registers the architectures)

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 128}
CASES = {
    # transformers 5 keeps the legacy block and drops rope_parameters (theta 500000 unused)
    "legacy-beside-parameters": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "legacy-beside-parameters-top-theta": {
        "rope_theta": 250000.0, "rope_parameters": {"rope_type": "default",
                                                    "rope_theta": 500000.0},
        "rope_scaling": {"type": "linear", "factor": 4.0}},
    "legacy-block-own-theta": {
        "rope_theta": 250000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 40000.0}},
    "transformers-4": {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}},
    "transformers-5": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                           **LLAMA3}},
    "empty-legacy-block": {"rope_scaling": {}, "rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 20000.0}},
    "nothing": {},
}
OURS = {"none": "default", "linear": "linear", "llama3": "llama3"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_matches_transformers(case):
  hf = {**BASE, **CASES[case]}
  theirs = transformers.LlamaConfig.from_dict(dict(hf)).rope_parameters
  ours = hf_config.to_model(hf, "x")
  assert ours.rope_theta == theirs["rope_theta"], (ours.rope_theta, theirs)
  assert OURS[ours.rope_scaling] == theirs["rope_type"], (ours.rope_scaling, theirs)
  if theirs["rope_type"] != "default":
    assert ours.rope_factor == theirs["factor"]
  if theirs["rope_type"] == "llama3":
    assert (ours.rope_low_freq_factor, ours.rope_high_freq_factor,
            ours.rope_original_max_seq_len) == (
        theirs["low_freq_factor"], theirs["high_freq_factor"],
        theirs["original_max_position_embeddings"])


def test_mixtral_default_theta_matches_transformers():
  hf = {**BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "num_local_experts": 4, "num_experts_per_tok": 2}
  theirs = transformers.MixtralConfig.from_dict(dict(hf)).rope_parameters["rope_theta"]
  assert hf_config.to_model(hf, "x").rope_theta == theirs == 1e6


@pytest.mark.parametrize("top_theta", [None, 250000.0])
def test_phi3_legacy_block_beside_parameters_matches_transformers(top_theta):
  hf = {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rope_scaling": {"rope_type": "default", "partial_rotary_factor": 1.0},
        **({} if top_theta is None else {"rope_theta": top_theta})}
  theirs = transformers.Phi3Config.from_dict(dict(hf)).rope_parameters["rope_theta"]
  assert hf_config.to_model(hf, "x").rope_theta == theirs
