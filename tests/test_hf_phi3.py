"""Hugging Face Phi-3 against transformers: random small Phi3ForCausalLM models (GQA ratios 2
and 4, windows shorter than the sequence, tied and untied, LongRoPE at a sequence past its
original context and at one within it) import through the fused qkv_proj / gate_up_proj
with transformers' logits (fp32, 1e-4) on one device, under tp and fsdp_tp and over a
context axis; decoding
with the KV cache gives transformers' cached logits step by step (LongRoPE turning to its
long factors mid-decode); export writes the fused tensors back bit for bit and reloads with
identical logits. What models/phi3.py does not compute is refused by field; the preset
counts the released checkpoint's parameters exactly.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers as H
from shardlab.errors import ConfigError
from shardlab.hf import adapter as hf_adapter
from shardlab.hf import config as hf_config
from shardlab.hf import files as hf_files
from shardlab.models import registry
from shardlab.sharding.activations import activation_rules
from shardlab.training import run as run_lib

try:
  import torch
  import transformers
except ImportError:  # the preset and refusal tests need no torch
  torch = transformers = None
needs_hf = pytest.mark.skipif(torch is None, reason="needs the hf extra (pip install -e '.[hf]')")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=None)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
            "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0]}
# GQA 2 and 4 (kv heads divide the placements' tensor axes), windows of 4 and 6 keys,
# tied and untied; LongRoPE past 8 positions (the attention factor derived: sqrt(2)).
VARIANTS = {
    "gqa-window": dict(num_attention_heads=8, num_key_value_heads=4, sliding_window=4),
    "tied-gqa4": dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=6,
                      tie_word_embeddings=True),
    "longrope": dict(num_attention_heads=4, num_key_value_heads=4, rope_scaling=LONGROPE,
                     original_max_position_embeddings=8),
}
PLACEMENTS = {"1 device": ("dp", "data:1"), "tp": ("tp", "data:2,tensor:4"),
              "fsdp_tp": ("fsdp_tp", "fsdp:4,tensor:2"), "context": ("dp", "data:2,context:4")}
# One device, tp and fsdp_tp for one variant, one placement for each other: LongRoPE's with
# its positions zig-zagged over a context axis (the cached decoding test below runs it on
# one device).
CASES = [("gqa-window", p) for p in ("1 device", "tp", "fsdp_tp")] + [
    ("tied-gqa4", "fsdp_tp"), ("longrope", "context")]
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 16)).astype(np.int32)
SHORT = TOKENS[:, :8]  # within LongRoPE's original context: its short factors


def hf_model(variant: str):
  torch.manual_seed(sorted(VARIANTS).index(variant))
  cfg = transformers.Phi3Config(**BASE, **VARIANTS[variant], initializer_range=0.25,
                                attn_implementation="eager")
  model = transformers.Phi3ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
  return model


def hf_logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (HF dir, the HF model), written with save_pretrained once each."""

  @functools.cache
  def get(variant: str):
    model = hf_model(variant)
    directory = tmp_path_factory.mktemp(f"hf-phi3-{variant}")
    model.save_pretrained(directory)
    return directory, model

  return get


def imported(directory):
  from shardlab.hf import convert as hf_convert
  return hf_convert.hf_model_config(directory)


def load(directory, placement: str = "1 device"):
  from shardlab.hf import weights as hf
  cfg, m, r, abstract, sh = H.placed_model(imported(directory), *PLACEMENTS[placement])
  return hf.load_params(directory, cfg.model, abstract, sh), (m, r, abstract, sh)


@needs_hf
@pytest.mark.parametrize("variant,placement", CASES)
def test_import_logits_match_transformers(saved, variant, placement):
  directory, model = saved(variant)
  params, placed = load(directory, placement)
  for tokens in (TOKENS, SHORT) if variant == "longrope" else (TOKENS,):
    expected = hf_logits(model, tokens)
    assert np.abs(expected).max() > 1.0  # not a comparison of near-zero logits
    np.testing.assert_allclose(H.model_logits(params, *placed, tokens), expected, rtol=0,
                               atol=1e-4)


@needs_hf
def test_longrope_factors_change_the_logits(saved):
  """Each factor list decides the logits where it applies: the first 8 positions of a
  16-token sequence (long factors) differ from the same 8 tokens alone (short factors)."""
  _, model = saved("longrope")
  long_, short = hf_logits(model)[:, :8], hf_logits(model, SHORT)
  assert np.abs(long_ - short).max() > 0.1


@needs_hf
@pytest.mark.parametrize("variant", ["gqa-window", "longrope"])
def test_cached_decoding_matches_transformers_step_by_step(saved, variant):
  """A 6-token prefill, then one token at a time to 16: the window slides over the cache,
  and LongRoPE turns to its long factors at position 8 (keys cached before keep the short
  ones, in both), so cached logits differ from a full forward's there."""
  directory, model = saved(variant)
  params, (m, r, abstract, sh) = load(directory)
  cfg = imported(directory)
  with torch.no_grad():
    out = model(torch.from_numpy(TOKENS[:, :6]).long(), use_cache=True)
    expected = [out.logits.numpy()]
    for i in range(6, 16):
      out = model(torch.from_numpy(TOKENS[:, i:i + 1]).long(),
                  past_key_values=out.past_key_values, use_cache=True)
      expected.append(out.logits.numpy())
  expected = np.concatenate(expected, axis=1)

  @jax.jit
  def extend(p, tokens, cache):
    with activation_rules(m, r):
      return nnx.merge(abstract.graphdef, p).extend(tokens, cache)

  cache = cfg.init_cache(TOKENS.shape[0], 16, jnp.float32)
  logits, cache = extend(params, TOKENS[:, :6], cache)
  steps = [logits]
  for i in range(6, 16):
    logits, cache = extend(params, TOKENS[:, i:i + 1], cache)
    steps.append(logits)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=0, atol=1e-4)
  full = hf_logits(model)
  assert (np.abs(full - expected).max() > 1e-2) == (variant == "longrope")


@needs_hf
@pytest.mark.parametrize("variant", VARIANTS)
def test_export_writes_the_fused_tensors_back(saved, tmp_path, variant):
  """Sharded import → export: the same tensors as save_pretrained wrote (qkv_proj and
  gate_up_proj fused, bit for bit), and from_pretrained gives identical logits."""
  from shardlab.hf import weights as hf
  directory, model = saved(variant)
  params, _ = load(directory, "fsdp_tp")
  hf.export_params(params, imported(directory), tmp_path)
  source, written = hf_files.Reader(directory), hf_files.Reader(tmp_path)
  assert set(written.tensors) == set(source.tensors)
  assert "model.layers.1.self_attn.qkv_proj.weight" in written.tensors
  for name in source.tensors:
    np.testing.assert_array_equal(written.read(name), source.read(name), err_msg=name)
  reloaded = transformers.Phi3ForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert reloaded.config.rope_parameters["rope_type"] == (
      "longrope" if variant == "longrope" else "default")
  np.testing.assert_array_equal(hf_logits(reloaded), hf_logits(model))


@needs_hf
def test_convert_cli_round_trip(saved, tmp_path):
  """from-hf (a checkpoint and its model.toml, LongRoPE's factors in it) → to-hf."""
  from shardlab import cli
  directory, model = saved("longrope")
  ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
  assert cli.main(["convert", "from-hf", str(directory), str(ckpt)]) == 0
  assert registry.load(str(ckpt / "model.toml")) == dataclasses.replace(
      imported(directory), name="model")
  assert cli.main(["convert", "to-hf", str(ckpt), str(out)]) == 0
  reloaded = transformers.Phi3ForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), hf_logits(model))


@needs_hf
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_config_maps_and_counts_exactly(saved, variant):
  directory, model = saved(variant)
  m = imported(directory)
  assert (m.arch, m.sliding_window, m.tie_embeddings) == (
      "phi3", VARIANTS[variant].get("sliding_window") or 0,
      VARIANTS[variant].get("tie_word_embeddings", False))
  assert m.n_params == sum(p.numel() for p in model.parameters())
  if variant == "longrope":
    assert m.longrope == (tuple(LONGROPE["short_factor"]), tuple(LONGROPE["long_factor"]))
    assert (m.rope_original_max_seq_len, m.rope_attention_factor) == (8, math.sqrt(2.0))


# ---- configs, refusals and the preset (no torch) -----------------------------------------

PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 8,
        "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
        "num_attention_heads": 2}  # head_dim 4: two LongRoPE factors


@pytest.mark.parametrize("hf,pattern", [
    ({**PHI3, "partial_rotary_factor": 0.75},
     r"partial_rotary_factor=0.75 is not supported \(RoPE turns every dim.*valid: 1.0"),
    ({**PHI3, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     r"rope_parameters.partial_rotary_factor=0.5 is not supported"),
    ({**PHI3, "attention_bias": True}, r"attention_bias=True is not supported"),
    ({**PHI3, "resid_pdrop": 0.1}, r"resid_pdrop=0.1 is not supported \(shardlab has no"),
    ({**PHI3, "embd_pdrop": 0.1}, r"embd_pdrop=0.1 is not supported"),
    ({**PHI3, "attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported"),
    ({**PHI3, "hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({**PHI3, "sliding_window": -1}, r"sliding_window=-1 is not supported"),
    ({**PHI3, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     r"unsupported rope_scaling type 'linear'; shardlab's Phi-3 supports 'default', "
     r"'longrope'"),
    ({**PHI3, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     r"unsupported rope_parameters type 'dynamic'"),
    ({**PHI3, "rope_scaling": {"type": "longrope", "long_factor": [1.0, 2.0]}},
     r"rope_scaling.short_factor=None is not supported; valid: a list"),
    ({**PHI3, "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                               "long_factor": [1.0, 2.0]}},
     r"model.rope_short_factor must hold head_dim / 2 = 2 numbers > 0"),
])
def test_what_phi3_does_not_compute_is_refused_by_field(hf, pattern):
  with pytest.raises(ConfigError, match=pattern):
    hf_config.to_model(hf, "m", "config.json")


def test_longrope_configs_map_as_transformers_reads_them():
  """Type "su" is longrope (older configs); the top-level original context wins; an explicit
  attention factor is kept, an absent one derived from max / original positions."""
  rope = {"type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
  m = hf_config.to_model({**PHI3, "rope_scaling": rope, "max_position_embeddings": 131072,
                          "original_max_position_embeddings": 4096})
  assert m.longrope == ((1.0, 2.0), (3.0, 4.0)) and m.rope_original_max_seq_len == 4096
  assert m.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
  m = hf_config.to_model({**PHI3, "rope_parameters": {
      **rope, "type": "longrope", "attention_factor": 1.25, "rope_theta": 5e5,
      "original_max_position_embeddings": 16}})
  assert (m.rope_attention_factor, m.rope_theta, m.rope_original_max_seq_len) == (1.25, 5e5,
                                                                                  4096)
  plain = hf_config.to_model(PHI3)
  assert (plain.longrope, plain.norm_eps, plain.max_seq_len) == (None, 1e-5, 4096)


def test_a_table_that_fuses_part_of_a_tensor_is_refused():
  from shardlab.hf import phi3
  from shardlab.hf import weights as hf

  class MissingV(phi3.Phi3Adapter):  # not registered: its table only
    def attention_tensors(self, m):
      return [t for t in super().attention_tensors(m) if "v_DxKxE" not in t.param]

  with pytest.raises(ConfigError, match=r"MissingV.tensors maps model.layers.\{i\}.self_attn"
                                        r".qkv_proj.weight to blocks.attn.q_DxHxE, "
                                        r"blocks.attn.k_DxKxE: .*fused from each of its parts"):
    hf.tensor_table(MissingV(), registry.load("phi3-tiny"))
  q = hf_adapter.Mapping(("q",), "qkv", ("HE", "D"), "DHE")
  with pytest.raises(ConfigError, match=r"cannot fuse \('k',\) .* along dim 0"):
    hf_adapter.fuse(q, hf_adapter.Mapping(("k",), "qkv", ("KE", "E"), "EKE"))


# microsoft/Phi-3-mini-4k-instruct: model.safetensors.index.json's total / 2 (bf16).
RELEASED = {"phi3-mini": 3_821_079_552}


@pytest.mark.parametrize("preset", RELEASED)
def test_presets_count_the_released_parameters(preset):
  """By the config's formula and by summing the abstract state (shapes only)."""
  model = registry.load(preset)
  assert model.n_params == RELEASED[preset]
  abstract = run_lib.abstract_state(H.make_config(model=model))
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract.state.params)) == \
      RELEASED[preset]
