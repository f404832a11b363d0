"""Llama 3.1-style checkpoints against transformers: rope_scaling (llama3, linear) in the
model and through from-hf / to-hf, at a length where the scaling changes the logits, and
the original bos/eos/pad ids written back on export."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

try:
  import torch
  import transformers
except ImportError as e:
  pytest.skip(f"needs the hf extra (pip install -e '.[hf]'): {e}", allow_module_level=True)

from shardlab import config
from shardlab.hf import convert as hf_convert
from shardlab.hf import weights as hf
from shardlab.models import rope
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules
from shardlab.sharding.activations import activation_rules
from shardlab.training import run as run_lib
from shardlab.training import state

LENGTH = 256  # > 8 × the original context below: the scaled frequencies decide the logits
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "linear": {"rope_type": "linear", "factor": 4.0},
}
IDS = dict(bos_token_id=250, eos_token_id=[251, 252, 253], pad_token_id=254)  # Llama 3.1 style


def hf_model(scaling: str):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
      rope_scaling=dict(SCALINGS[scaling], rope_theta=500000.0),
      max_position_embeddings=1024, initializer_range=0.25, attn_implementation="eager", **IDS)
  return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def saved(request, tmp_path_factory):
  model = hf_model(request.param)
  directory = tmp_path_factory.mktemp(f"hf-{request.param}")
  model.save_pretrained(directory)
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, LENGTH)).astype(np.int32)
  with torch.no_grad():
    expected = model(torch.from_numpy(tokens).long()).logits.float().numpy()
  return request.param, directory, tokens, expected


def _logits(directory, tokens, model=None, params=None):
  model = model or hf_convert.hf_model_config(directory)
  cfg = config.Config(model=model, mesh="data:1", strategy="dp")
  mesh = mesh_lib.build(mesh_lib.parse_inline("data:1"), devices=jax.devices()[:1])
  r = rules.strategy("dp")
  abstract = run_lib.abstract_state(cfg)
  sh = state.shardings(abstract, r, mesh)
  if params is None:
    params = hf.load_params(directory, model, abstract, sh)

  def forward(p, t):
    with activation_rules(mesh, r):
      return nnx.merge(abstract.graphdef, p)(t)
  return params, model, np.asarray(jax.jit(forward)(params, tokens))


def test_scaled_rope_logits_match_transformers(saved):
  scaling, directory, tokens, expected = saved
  model = hf_convert.hf_model_config(directory)
  assert model.rope_scaling == scaling and model.rope_factor == SCALINGS[scaling]["factor"]
  params, _, actual = _logits(directory, tokens, model)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)
  # The scaling matters at this length: the same weights under plain RoPE are far off.
  plain_model = dataclasses.replace(model, rope_scaling="none")
  _, _, plain = _logits(directory, tokens, plain_model, params)
  assert np.abs(plain - expected).max() > 1e-2


def test_inverse_frequencies_match_transformers(saved):
  scaling, directory, _, _ = saved
  hf_cfg = transformers.AutoConfig.from_pretrained(directory)
  kind = SCALINGS[scaling]["rope_type"]
  inv, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
  np.testing.assert_allclose(rope.inverse_frequencies(hf_convert.hf_model_config(directory)),
                             inv.numpy(), rtol=1e-6)


def test_export_keeps_rope_scaling_and_token_ids(saved, tmp_path):
  scaling, directory, tokens, expected = saved
  params, model, _ = _logits(directory, tokens)
  assert (model.bos_token_id, model.eos_ids, model.pad_token_id) == (
      250, (251, 252, 253), 254)
  hf.export_params(params, model, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  generation = json.loads((tmp_path / "generation_config.json").read_text())
  for file in (written, generation):
    assert {k: file[k] for k in IDS} == IDS
  assert written["rope_scaling"]["rope_type"] == scaling
  reloaded = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert reloaded.generation_config.eos_token_id == IDS["eos_token_id"]
  with torch.no_grad():
    again = reloaded(torch.from_numpy(tokens).long()).logits.float().numpy()
  np.testing.assert_allclose(again, expected, rtol=0, atol=1e-4)
