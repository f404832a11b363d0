"""Hugging Face Mixtral interop against transformers: a random small MixtralForCausalLM
imported on one device and on ep, fsdp and fsdp + ep meshes gives transformers' logits
(fp32, 1e-4), in both dispatch modes; its export reloads in transformers with the same
logits; `convert from-hf` / `to-hf` round-trip it.
"""

import dataclasses

import jax
import numpy as np
import pytest

import helpers as H

try:
  import torch
  import transformers
except ImportError as e:
  pytest.skip(f"needs the hf extra (pip install -e '.[hf]'): {e}", allow_module_level=True)

from shardlab import cli
from shardlab.hf import convert as hf_convert
from shardlab.hf import weights as hf
from shardlab.models import registry
from shardlab.training import checkpoint

# 8 experts (an 8-way expert axis holds one each), 2 per token; d_model divides fsdp:8.
MIXTRAL = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
               max_position_embeddings=64)
PLACEMENTS = {"1 device": ("dp", "data:1"), "ep": ("dp", "expert:8"),
              "fsdp": ("fsdp", "fsdp:-1"), "fsdp+ep": ("fsdp", "fsdp:2,expert:4")}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(8, 16)).astype(np.int32)


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF dir, reference logits) of a random Mixtral with spread router logits (no near
  ties between experts) and norm scales that are not all ones."""
  torch.manual_seed(0)
  cfg = transformers.MixtralConfig(**MIXTRAL, initializer_range=0.25,
                                   attn_implementation="eager")
  model = transformers.MixtralForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
  directory = tmp_path_factory.mktemp("hf-mixtral")
  model.save_pretrained(directory)
  return directory, hf_logits(model)


def placed(directory, placement: str, dispatch: str = "dropless"):
  model = dataclasses.replace(hf_convert.hf_model_config(directory), dispatch=dispatch,
                              capacity_factor=4.0)  # E / K: room for every token
  return H.placed_model(model, *PLACEMENTS[placement])


def logits(params, m, r, abstract, sh) -> np.ndarray:
  return H.model_logits(params, m, r, abstract, sh, TOKENS)


def test_the_config_maps_to_a_moe_model(saved):
  model = hf_convert.hf_model_config(saved[0])
  assert (model.arch, model.n_experts, model.experts_per_token) == ("moe", 8, 2)
  n_hf = sum(p.numel() for p in transformers.MixtralForCausalLM(
      transformers.MixtralConfig(**MIXTRAL)).parameters())
  assert model.n_params == n_hf


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_import_logits_match_transformers(saved, placement, dispatch):
  directory, expected = saved
  cfg, m, r, abstract, sh = placed(directory, placement, dispatch)
  params = hf.load_params(directory, cfg.model, abstract, sh)
  for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(sh.state.params)):
    assert p.sharding == s
  assert np.abs(expected).max() > 1.0
  np.testing.assert_allclose(logits(params, m, r, abstract, sh), expected, rtol=0, atol=1e-4)


def test_export_reloads_with_identical_logits(saved, tmp_path):
  directory, expected = saved
  cfg, m, r, abstract, sh = placed(directory, "fsdp+ep")
  params = hf.load_params(directory, cfg.model, abstract, sh)
  hf.export_params(params, cfg.model, tmp_path)
  reloaded = transformers.MixtralForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


def test_convert_cli_round_trip(saved, tmp_path, capsys):
  directory, expected = saved
  ckpt = tmp_path / "ckpt"
  assert cli.main(["convert", "from-hf", str(directory), str(ckpt),
                   "--mesh", "fsdp:2,expert:4", "--strategy", "fsdp"]) == 0
  assert registry.load(str(ckpt / "model.toml")).n_experts == 8
  _, step = checkpoint.restore_params(ckpt, *placed(directory, "ep")[3:])
  assert step == 0
  out = tmp_path / "exported"
  assert cli.main(["convert", "to-hf", str(ckpt), str(out)]) == 0
  reloaded = transformers.MixtralForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)
