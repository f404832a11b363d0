"""Hugging Face GPT-2 against transformers: random small GPT2LMHeadModels (fused, Conv1D-laid
c_attn with biases that are not zero, LayerNorms that are not the identity) import with
transformers' logits (fp32, 1e-4) on one device and under tp and fsdp_tp; their export is
the original checkpoint tensor for tensor and reloads with identical logits; the released
base-model layout (no `transformer.` prefix, mask buffers) reads the same; --init-from hf:
refuses a --model that computes otherwise; cached generation equals uncached; what
models/gpt2.py does not compute is refused by field and value.
"""

import dataclasses
import json

import numpy as np
import pytest

import helpers as H

try:
  import torch
  import transformers
  from safetensors.numpy import load_file, save_file
except ImportError as e:
  pytest.skip(f"needs the hf extra (pip install -e '.[hf]'): {e}", allow_module_level=True)

from shardlab import cli, generate
from shardlab.errors import ConfigError
from shardlab.hf import config as hf_config
from shardlab.hf import convert as hf_convert
from shardlab.hf import families
from shardlab.hf import weights as hf
from shardlab.models import registry

# Heads and vocab divide a 4-way tensor axis, d_model a 4-way fsdp one. "wide" spells out
# what "small" leaves to defaults, in the other accepted forms (n_inner = 4·n_embd, GELU by
# another tanh name, the fp32 scores reorder_and_upcast_attn asks for).
VARIANTS = {
    "small": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "wide": dict(vocab_size=512, n_embd=64, n_layer=3, n_head=8, n_positions=32, n_inner=256,
                 layer_norm_epsilon=1e-6, activation_function="gelu_pytorch_tanh",
                 reorder_and_upcast_attn=True),
}
PLACEMENTS = {"1 device": ("dp", "data:1"), "tp": ("tp", "data:2,tensor:4"),
              "fsdp_tp": ("fsdp_tp", "fsdp:4,tensor:2")}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(8, 16)).astype(np.int32)


def hf_model(variant: str) -> "transformers.GPT2LMHeadModel":
  torch.manual_seed(sorted(VARIANTS).index(variant))
  cfg = transformers.GPT2Config(**VARIANTS[variant], initializer_range=0.25,
                                bos_token_id=None, eos_token_id=None,
                                attn_implementation="eager")
  model = transformers.GPT2LMHeadModel(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):  # q, k, v biases that differ: a misplaced split shows
        p.uniform_(-0.5, 0.5)
      elif ".ln_" in name:
        p.uniform_(0.5, 1.5)
  return model


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


def as_exported(directory) -> np.ndarray:
  """transformers' logits of `directory` under the names to-hf writes (gelu_new for any tanh
  GELU, no reorder_and_upcast_attn): the same function, each in its own float rounding."""
  return hf_logits(transformers.GPT2LMHeadModel.from_pretrained(
      directory, activation_function="gelu_new", reorder_and_upcast_attn=False,
      attn_implementation="eager").eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """{variant: (HF dir, reference logits)} written with save_pretrained (fp32)."""
  out = {}
  for variant in VARIANTS:
    model = hf_model(variant)
    directory = tmp_path_factory.mktemp(f"hf-gpt2-{variant}")
    model.save_pretrained(directory)
    out[variant] = directory, hf_logits(model)
  return out


def placed(directory, placement: str = "1 device"):
  return H.placed_model(hf_convert.hf_model_config(directory), *PLACEMENTS[placement])


def imported(directory, placement: str = "1 device"):
  cfg, m, r, abstract, sh = placed(directory, placement)
  params = hf.load_params(directory, cfg.model, abstract, sh)
  return cfg, params, H.model_logits(params, m, r, abstract, sh, TOKENS)


def test_the_configs_map_and_count_exactly(saved):
  for variant, (directory, _) in saved.items():
    model = hf_convert.hf_model_config(directory)
    assert (model.arch, model.vocab_size, model.n_layers, model.max_seq_len) == (
        "gpt2", VARIANTS[variant]["vocab_size"], VARIANTS[variant]["n_layer"],
        VARIANTS[variant]["n_positions"])
    assert model.norm_eps == VARIANTS[variant].get("layer_norm_epsilon", 1e-5)
    n_hf = sum(p.numel() for p in hf_model(variant).parameters())  # the tied head once
    assert model.n_params == n_hf


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_import_logits_match_transformers(saved, variant, placement):
  directory, expected = saved[variant]
  cfg, params, actual = imported(directory, placement)
  assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
  np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_the_checkpoint_and_reloads_with_identical_logits(saved, tmp_path, variant):
  """From fsdp_tp-sharded params: every tensor bit-identical to save_pretrained's (c_attn
  concatenated back from q, k and v), and transformers' logits exactly."""
  directory, _ = saved[variant]
  cfg, m, r, abstract, sh = placed(directory, "fsdp_tp")
  hf.export_params(hf.load_params(directory, cfg.model, abstract, sh), cfg.model, tmp_path)
  original, exported = (load_file(d / "model.safetensors") for d in (directory, tmp_path))
  assert sorted(exported) == sorted(original)
  for name in original:
    np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), as_exported(directory))


def test_convert_cli_round_trip(saved, tmp_path):
  directory, _ = saved["wide"]
  ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
  assert cli.main(["convert", "from-hf", str(directory), str(ckpt),
                   "--mesh", "fsdp:4,tensor:2", "--strategy", "fsdp_tp"]) == 0
  assert dataclasses.replace(registry.load(str(ckpt / "model.toml")), name="m") == \
      dataclasses.replace(hf_convert.hf_model_config(directory), name="m")
  assert cli.main(["convert", "to-hf", str(ckpt), str(out)]) == 0
  written = json.loads((out / "config.json").read_text())
  assert (written["n_inner"], written["layer_norm_epsilon"]) == (None, 1e-6)
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), as_exported(directory))


def test_the_released_base_model_layout_reads_the_same(saved, tmp_path):
  """As openai-community/gpt2 stores it: no `transformer.` prefix, each layer's causal-mask
  buffers `attn.bias` / `attn.masked_bias`, and the tied head's copy."""
  directory, expected = saved["small"]
  tensors = {k.removeprefix("transformer."): v
             for k, v in load_file(directory / "model.safetensors").items()}
  p = VARIANTS["small"]["n_positions"]
  for i in range(VARIANTS["small"]["n_layer"]):
    tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, p, p), np.float32))
    tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
  tensors["lm_head.weight"] = tensors["wte.weight"]
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((directory / "config.json").read_text())
  np.testing.assert_allclose(imported(tmp_path, "tp")[2], expected, rtol=0, atol=1e-4)
  tensors["h.0.attn.c_attn.extra"] = np.zeros(2, np.float32)  # still no weight dropped
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            tmp_path / "model.safetensors")
  with pytest.raises(ConfigError, match=r"transformer.h.0.attn.c_attn.extra: not part of a "
                                        r"GPT-2 model"):
    imported(tmp_path)


def test_cached_generation_equals_uncached(saved):
  directory = saved["small"][0]
  run = H.run(*PLACEMENTS["tp"], model=hf_convert.hf_model_config(directory))
  params = hf.load_params(directory, run.cfg.model, run.abstract, run.sh)
  gen = generate.Generator(run.cfg, run.abstract, run.sh)
  s = generate.Sampling(max_new_tokens=8, temperature=1.0, top_k=20, seed=3, num_samples=2,
                        vocab=256)
  prompt = TOKENS[0, :5]
  cached = gen.tokens(params, prompt, s)
  assert cached.shape == (2, 8)
  np.testing.assert_array_equal(cached, gen.tokens(params, prompt, s, use_cache=False))


def test_a_model_that_computes_otherwise_is_refused(saved):
  """What --init-from hf: checks before any device work (the loader is the one tested
  above): the run's model against config.json, max_seq_len too (the position table's rows)."""
  directory, _ = saved["small"]
  cfg, m, r, abstract, sh = placed(directory)
  for field, value, hf_field in (("norm_eps", 1e-6, "layer_norm_epsilon = 1e-05"),
                                 ("max_seq_len", 32, "n_positions = 64")):
    model = dataclasses.replace(cfg.model, **{field: value})
    with pytest.raises(ConfigError, match=rf"model.{field} = {value!r}, but {hf_field}"):
      hf.load_params(directory, model, abstract, sh)


# ---- config mapping and refusals (no weights) -------------------------------------------

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}


@pytest.mark.parametrize("field,value,pattern", [
    ("activation_function", "gelu", r"activation_function='gelu' is not supported \(the "
                                    r"MLP's GELU is the tanh approximation\); valid: 'gelu_new'"),
    ("activation_function", "relu", r"activation_function='relu' is not supported"),
    ("n_inner", 128, r"n_inner=128 is not supported \(the MLP is 4·n_embd wide\); "
                     r"valid: null or 256"),
    ("scale_attn_weights", False, r"scale_attn_weights=False is not supported.*valid: True"),
    ("scale_attn_by_inverse_layer_idx", True,
     r"scale_attn_by_inverse_layer_idx=True is not supported.*valid: False"),
    ("add_cross_attention", True, r"add_cross_attention=True is not supported"),
    ("tie_word_embeddings", False, r"tie_word_embeddings=False is not supported \(the output "
                                   r"head is the token embedding\)"),
])
def test_what_the_model_does_not_compute_is_refused_by_field(field, value, pattern):
  with pytest.raises(ConfigError, match=r"config.json: " + pattern):
    hf_config.to_model({**GPT2, field: value})


def test_what_it_computes_is_read():
  """The transformers aliases of the shape fields, dropout (training only), the released
  config's extra fields; a missing shape field is named."""
  released = {"model_type": "gpt2", "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
              "n_ctx": 64, "resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1,
              "activation_function": "gelu_new", "summary_type": "cls_index"}
  assert hf_config.to_model(released, "m") == hf_config.to_model(GPT2, "m")
  with pytest.raises(ConfigError, match=r"config.json lacks n_embd; a GPT-2 config needs"):
    hf_config.to_model({k: v for k, v in GPT2.items() if k != "n_embd"})


@pytest.mark.parametrize("preset", ["gpt2-tiny", "gpt2-124m"])
def test_the_presets_write_configs_transformers_builds_back(preset):
  """to_hf → transformers' GPT2Config → to_model: the same model, with the released
  checkpoint's 124,439,808 parameters for gpt2-124m."""
  model = registry.load(preset)
  written = families.for_model(model).to_hf(model, "float32")
  cfg = transformers.GPT2Config(**{k: v for k, v in written.items()
                                   if k not in ("dtype", "torch_dtype")})
  back = hf_config.to_model(cfg.to_dict(), model.name)
  assert back == dataclasses.replace(model, attention="xla")  # no attention kernel in HF's
  if preset == "gpt2-124m":
    assert written["eos_token_id"] == 50256
    with torch.device("meta"):
      n = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
    assert n == model.n_params == 124_439_808
