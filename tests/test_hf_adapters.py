"""The Hugging Face adapter contract (shardlab/hf/adapter.py). Its exit test: a Llama variant
with a q/k/v bias is one model file (tests/data/llama_qkv_bias.py) plus one adapter file
(tests/data/llama_qkv_bias_hf.py), and then a transformers Qwen2ForCausalLM (Llama with
q/k/v biases) imports into the variant, explicitly (the bundled qwen2 family is what a bare
`convert from-hf` picks), with transformers' logits, and exports back. And the registry's
errors.
"""

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import helpers as H
from shardlab.errors import ConfigError
from shardlab.hf import config as hf_config
from shardlab.hf import adapter as adapter_lib
from shardlab.hf import families
from shardlab.hf.adapter import ADAPTERS, adapter
from shardlab.hf.llama import LlamaAdapter
from shardlab.hf.qwen2 import Qwen2Adapter
from shardlab.models import registry

DATA = Path(__file__).parent / "data"


def import_file(name: str):
  """tests/data/<name>.py as module `name` (importing it registers what it declares), once."""
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


VARIANT = import_file("llama_qkv_bias")
VARIANT_HF = import_file("llama_qkv_bias_hf")


def test_unknown_architecture_lists_the_supported_ones():
  with pytest.raises(ConfigError, match=r"x.json: unsupported architecture 'GPTJForCausalLM'; "
                                        r"supported: LlamaForCausalLM, MixtralForCausalLM.* "
                                        r"\(model_type 'llama', 'mixtral'"):
    hf_config.to_model({"architectures": ["GPTJForCausalLM"], "model_type": "gptj"}, "m",
                       "x.json")
  with pytest.raises(ConfigError, match=r"unsupported architecture \"model_type 'gptj'\""):
    hf_config.to_model({"model_type": "gptj"})


def test_a_second_adapter_for_one_arch_is_refused():
  with pytest.raises(ConfigError, match=r"architecture 'llama' already has a Hugging Face "
                                        r"adapter, shardlab.hf.llama.LlamaAdapter"):
    @adapter("llama")
    class Another(LlamaAdapter):
      pass
  assert type(ADAPTERS["llama"]) is LlamaAdapter
  with pytest.raises(ConfigError, match=r"not a subclass of shardlab.hf.adapter.Adapter"):
    adapter("other")(object)


def test_a_model_without_an_adapter_is_refused_by_name():
  # Every bundled arch has one: a user's model config (what for_model reads of it).
  mine = types.SimpleNamespace(name="mine", arch="mine")
  with pytest.raises(ConfigError, match=r"arch 'mine'\) has no Hugging Face adapter; "
                                        r"architectures with one: llama, ") as e:
    families.for_model(mine)
  assert "moe" in str(e.value) and "llama-qkv-bias" in str(e.value)


def test_each_config_goes_to_its_adapter():
  llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
  qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
  assert type(families.for_hf(llama)) is LlamaAdapter
  assert type(families.for_hf({"model_type": "llama"})) is LlamaAdapter
  # The variant's adapter reads Qwen2 configs too; the bundled family, named as the config's
  # model_type, is the one picked, unless the run's model is the variant.
  assert VARIANT_HF.QKVBiasAdapter().claims(qwen2)
  assert type(families.for_hf(qwen2)) is Qwen2Adapter
  variant = registry.load(str(DATA / "llama-qkv-bias.toml"))
  assert type(families.for_dir(qwen2, variant)) is VARIANT_HF.QKVBiasAdapter
  shape = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 1}
  with pytest.raises(ConfigError, match=r"attention_bias=True is not supported"):
    hf_config.to_model({**llama, **shape, "attention_bias": True})
  with pytest.raises(ConfigError, match=r"use_sliding_window=True is not supported \(attention "
                                        r"is full causal\); valid: False"):
    hf_config.to_model({**qwen2, **shape, "use_sliding_window": True})
  with pytest.raises(ConfigError, match=r"layer_types holds 'sliding_attention'"):
    hf_config.to_model({**qwen2, **shape, "layer_types": ["sliding_attention"]})
  assert type(hf_config.to_model({**qwen2, **shape})).__name__ == "Qwen2Config"
  assert type(ADAPTERS["llama-qkv-bias"].to_model({**qwen2, **shape})) is VARIANT.QKVBiasConfig


def test_where_several_adapters_claim_a_config(monkeypatch):
  """A variant's adapter over its base's; then the one named as the config's model_type;
  else a clear error naming them."""
  class Base(LlamaAdapter):
    architectures, model_types = ("XForCausalLM",), ("x",)
  class Variant(Base):
    pass
  class Family(LlamaAdapter):
    architectures, model_types = ("XForCausalLM",), ("x",)
  for arch, cls in (("x-base", Base), ("x-variant", Variant), ("x-family", Family)):
    monkeypatch.setitem(adapter_lib._ADAPTERS, arch, cls())
    monkeypatch.setattr(cls, "arch", arch)
  hf = {"architectures": ["XForCausalLM"]}
  with pytest.raises(ConfigError, match=r"adapters of several architectures read it: "
                                        r"x-variant, x-family"):
    families.for_hf(hf)
  monkeypatch.setattr(Family, "arch", "x")
  assert type(families.for_hf({**hf, "model_type": "x"})) is Family
  monkeypatch.delitem(adapter_lib._ADAPTERS, "x-family")
  assert type(families.for_hf(hf)) is Variant


# ---- the exit test: transformers' Qwen2 (Llama with q/k/v biases) ↔ the variant --------

try:
  import torch
  import transformers
except ImportError:  # the tests above need no torch
  torch = transformers = None
needs_hf = pytest.mark.skipif(torch is None, reason="needs the hf extra (pip install -e '.[hf]')")
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 16)).astype(np.int32)


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF dir, reference logits) of a random Qwen2ForCausalLM whose q/k/v biases are not
  zero (HF's init zeroes them) and whose norm scales are not all ones."""
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, initializer_range=0.25, attn_implementation="eager")
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      elif name.endswith("bias"):
        p.uniform_(-1.0, 1.0)
  directory = tmp_path_factory.mktemp("hf-qkv-bias")
  model.save_pretrained(directory)
  return directory, hf_logits(model)


def variant_model(directory):
  """The variant's config of a Qwen2 directory, by its own adapter."""
  return ADAPTERS["llama-qkv-bias"].to_model(hf_config.read(directory), "qkv-bias")


@needs_hf
def test_the_config_maps_to_the_variant(saved):
  model = variant_model(saved[0])
  assert type(model) is VARIANT.QKVBiasConfig and model.arch == "llama-qkv-bias"
  n_hf = sum(p.numel() for p in transformers.Qwen2ForCausalLM.from_pretrained(
      saved[0]).parameters())
  assert model.n_params == n_hf


@needs_hf
def test_import_and_export_match_transformers(saved, tmp_path):
  """The HF weights imported into the variant: transformers' logits on one device (fp32,
  1e-4); exported → from_pretrained: the same logits again."""
  from shardlab.hf import weights as hf
  directory, expected = saved
  cfg, m, r, abstract, sh = H.placed_model(variant_model(directory), "dp", "data:1")
  params = hf.load_params(directory, cfg.model, abstract, sh)
  assert np.abs(np.asarray(params["blocks"]["attn"]["k_bias_KxE"])).max() > 0
  assert np.abs(expected).max() > 1.0
  np.testing.assert_allclose(H.model_logits(params, m, r, abstract, sh, TOKENS), expected,
                             rtol=0, atol=1e-4)

  out = tmp_path / "exported"
  hf.export_params(params, cfg.model, out)
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)
