"""Hugging Face Mistral, Gemma 2 and Gemma 3 (text) against transformers: random small models
(GQA and MHA, windows shorter than the sequence, soft-caps that bind, a depth that is not a
multiple of the layer pattern) imported on one device and under tp and fsdp_tp give
transformers' logits (fp32, 1e-4); their export reloads with identical logits; cached
generation equals uncached; a local layer's query sees exactly `window` keys, also under
context parallelism across shard borders.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers as H

try:
  import torch
  import transformers
except ImportError as e:
  pytest.skip(f"needs the hf extra (pip install -e '.[hf]'): {e}", allow_module_level=True)

from shardlab import cli, generate
from shardlab.errors import ConfigError
from shardlab.hf import config as hf_config
from shardlab.hf import convert as hf_convert
from shardlab.hf import weights as hf
from shardlab.models import lm, registry
from shardlab.training import run as run_lib

L, G = "sliding_attention", "full_attention"
CLASSES = {"mistral": ("MistralConfig", "MistralForCausalLM"),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16,
            max_position_embeddings=64, num_attention_heads=8, num_key_value_heads=4)
# Caps low enough to bind: |scores| and |logits| reach several times the cap at these scales.
VARIANTS = {
    "mistral-gqa": ("mistral", dict(num_hidden_layers=2, sliding_window=4, rms_norm_eps=1e-5)),
    "mistral-mha": ("mistral", dict(num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, sliding_window=6)),
    "gemma2-gqa": ("gemma2", dict(num_hidden_layers=3, sliding_window=4,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=1.5)),
    "gemma2-untied": ("gemma2", dict(num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, sliding_window=6,
                                     query_pre_attn_scalar=16, attn_logit_softcapping=3.0,
                                     final_logit_softcapping=2.0, tie_word_embeddings=False)),
    "gemma3-gqa": ("gemma3", dict(num_hidden_layers=5, sliding_window=4,
                                  query_pre_attn_scalar=24, layer_types=[L, L, G, L, L],
                                  rope_parameters={G: {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 10000.0},
                                                   L: {"rope_type": "default",
                                                       "rope_theta": 100.0}})),
    "gemma3-capped": ("gemma3", dict(num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, sliding_window=6,
                                     query_pre_attn_scalar=16, layer_types=[L, G],
                                     final_logit_softcapping=1.5)),
}
PLACEMENTS = {"1 device": ("dp", "data:1"), "tp": ("tp", "data:2,tensor:4"),
              "fsdp_tp": ("fsdp_tp", "fsdp:4,tensor:2")}
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 16)).astype(np.int32)


def hf_class(variant: str):
  return getattr(transformers, CLASSES[VARIANTS[variant][0]][1])


def hf_model(variant: str, **changed):
  family, shape = VARIANTS[variant]
  torch.manual_seed(sorted(VARIANTS).index(variant))
  cfg = getattr(transformers, CLASSES[family][0])(
      **{**BASE, **shape, **changed}, initializer_range=0.25, attn_implementation="eager")
  model = hf_class(variant)(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:  # Gemma scales by (1 + w), Mistral by w: neither all ones
        p.uniform_(-0.5, 0.5) if family != "mistral" else p.uniform_(0.5, 1.5)
  return model


def hf_logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (HF dir, reference logits), written with save_pretrained once each."""

  @functools.cache
  def get(variant: str):
    model = hf_model(variant)
    directory = tmp_path_factory.mktemp(f"hf-{variant}")
    model.save_pretrained(directory)
    return directory, hf_logits(model)

  return get


def placed(directory, placement: str = "1 device", **changed):
  model = dataclasses.replace(hf_convert.hf_model_config(directory), **changed)
  return H.placed_model(model, *PLACEMENTS.get(placement, ("dp", placement)))


def imported_logits(directory, placement: str, tokens=TOKENS, **changed) -> np.ndarray:
  cfg, m, r, abstract, sh = placed(directory, placement, **changed)
  params = hf.load_params(directory, cfg.model, abstract, sh)
  return H.model_logits(params, m, r, abstract, sh, tokens)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_import_logits_match_transformers(saved, variant, placement):
  directory, expected = saved(variant)
  assert np.abs(expected).max() > 1.0
  np.testing.assert_allclose(imported_logits(directory, placement), expected, rtol=0,
                             atol=1e-4)


@pytest.mark.parametrize("variant", ["gemma2-gqa", "gemma2-untied", "gemma3-capped"])
def test_soft_caps_bind(saved, variant):
  """The caps change the logits: the final one saturates, the attention one (Gemma 2's)
  matters."""
  _, expected = saved(variant)
  cap = VARIANTS[variant][1]["final_logit_softcapping"]
  assert np.abs(expected).max() > 0.9 * cap
  if variant.startswith("gemma2"):
    uncapped = hf_logits(hf_model(variant, attn_logit_softcapping=None))
    assert np.abs(uncapped - expected).max() > 0.05


def test_the_configs_map_and_count_exactly(saved):
  for variant in VARIANTS:
    model = hf_convert.hf_model_config(saved(variant)[0])
    assert model.arch == VARIANTS[variant][0]
    n_hf = sum(p.numel() for p in hf_model(variant).parameters())
    assert model.n_params == n_hf, variant
  gemma3 = hf_convert.hf_model_config(saved("gemma3-gqa")[0])
  assert (gemma3.sliding_window_pattern, gemma3.rope_scaling, gemma3.rope_factor,
          gemma3.rope_local_theta) == (3, "linear", 2.0, 100.0)


@pytest.mark.parametrize("variant", ["mistral-gqa", "gemma2-untied", "gemma3-gqa"])
def test_export_reloads_with_identical_logits(saved, tmp_path, variant):
  directory, expected = saved(variant)
  cfg, m, r, abstract, sh = placed(directory, "fsdp_tp")
  params = hf.load_params(directory, cfg.model, abstract, sh)
  hf.export_params(params, cfg.model, tmp_path)
  reloaded = hf_class(variant).from_pretrained(tmp_path, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


def test_convert_cli_round_trip(saved, tmp_path):
  directory, expected = saved("gemma2-gqa")
  ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
  assert cli.main(["convert", "from-hf", str(directory), str(ckpt),
                   "--mesh", "fsdp:4,tensor:2", "--strategy", "fsdp_tp"]) == 0
  assert cli.main(["convert", "to-hf", str(ckpt), str(out)]) == 0
  reloaded = transformers.Gemma2ForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


@pytest.mark.parametrize("variant", ["mistral-gqa", "gemma2-gqa", "gemma3-gqa"])
def test_cached_generation_equals_uncached(saved, variant):
  """A 6-token prompt (longer than the window, 4) and a 3-token one (shorter), then new
  tokens up to 16 in all: the local layers' caches are rings of 4 entries, which wrap."""
  directory, _ = saved(variant)
  cfg, m, r, abstract, sh = placed(directory, "tp")
  params = hf.load_params(directory, cfg.model, abstract, sh)
  gen = generate.Generator(cfg, abstract, sh)
  for p in (6, 3):
    s = generate.Sampling(max_new_tokens=16 - p, temperature=1.0, top_k=20, seed=3,
                          num_samples=2, vocab=128)
    prompt = TOKENS[0, :p]
    cached = gen.tokens(params, prompt, s)
    assert cached.shape == (2, 16 - p)
    np.testing.assert_array_equal(cached, gen.tokens(params, prompt, s, use_cache=False))
  cache = jax.eval_shape(lambda: cfg.model.init_cache(2, 16, jnp.float32))
  windows = cfg.model.windows
  local = cache.k_NxBxSxKxE if variant.startswith("mistral") else cache.local_k_NxBxWxKxE
  assert local.shape[:3] == (sum(w is not None for w in windows), 2, 4)
  if not variant.startswith("mistral"):  # the global layers' buffers hold all 16
    assert cache.k_NxBxSxKxE.shape[:3] == (windows.count(None), 2, 16)


WINDOW_MESHES = [("data:1", "all-gather"), ("data:2,context:4", "all-gather"),
                 ("data:2,context:4", "ring")]


@pytest.mark.parametrize("mesh,exchange", WINDOW_MESHES)
@pytest.mark.parametrize("variant", ["mistral-gqa", "gemma2-gqa"])
def test_a_query_sees_exactly_window_keys(saved, tmp_path, variant, mesh, exchange):
  """One local layer: the logits at position i move when token i - window + 1 changes and
  not when token i - window does (context:4 splits 16 tokens into 8 zig-zag chunks of 2,
  so the window crosses shard borders)."""
  model = hf_model(variant, num_hidden_layers=1, layer_types=[L]) \
      if variant.startswith("gemma") else hf_model(variant, num_hidden_layers=1)
  model.save_pretrained(tmp_path)
  window, i = VARIANTS[variant][1]["sliding_window"], 11
  logits = functools.partial(imported_logits, tmp_path, mesh, kv_exchange=exchange)
  base = logits()
  np.testing.assert_allclose(base, hf_logits(model), rtol=0, atol=1e-4)
  for j, moves in ((i - window, False), (i - window + 1, True)):
    tokens = TOKENS.copy()
    tokens[:, j] = (tokens[:, j] + 1) % 128
    change = np.abs(logits(tokens=tokens)[:, i] - base[:, i]).max()
    assert (change > 1e-3) if moves else (change < 1e-5), (j, change)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_activation", "gelu", r"hidden_activation='gelu' is not supported"),
    ("layer_types", [G, L, G], r"layer_types=.* is not supported"),
    ("sliding_window", 0, r"sliding_window=0 is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0},
     r"unsupported rope_parameters type 'yarn'"),
    ("use_bidirectional_attention", True, r"use_bidirectional_attention=True"),
])
def test_unsupported_config_fields_are_refused_by_name(field, value, match):
  hf = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, field: value}
  with pytest.raises(ConfigError, match=match):
    hf_config.to_model(hf)


def test_mistral_refuses_a_bad_window_and_local_rope_scaling_is_refused():
  mistral = {"architectures": ["MistralForCausalLM"], "vocab_size": 128, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
  with pytest.raises(ConfigError, match=r"sliding_window=-1 is not supported"):
    hf_config.to_model({**mistral, "sliding_window": -1})
  with pytest.raises(ConfigError, match=r"hidden_act='gelu' is not supported"):
    hf_config.to_model({**mistral, "hidden_act": "gelu"})
  gemma3 = {**mistral, "architectures": ["Gemma3ForCausalLM"],
            "rope_parameters": {L: {"rope_type": "linear", "factor": 2.0}, G: {}}}
  with pytest.raises(ConfigError, match=r"sliding_attention.rope_type='linear'"):
    hf_config.to_model(gemma3)
  with pytest.raises(ConfigError, match=r"attn_logit_softcapping=50.0 is not supported"):
    hf_config.to_model({**gemma3, "attn_logit_softcapping": 50.0})


def test_the_loss_is_taken_on_the_capped_logits(saved):
  """Training sees the final soft-cap: the next-token loss is transformers' (labels=)."""
  directory, _ = saved("gemma2-gqa")
  cfg, m, r, abstract, sh = placed(directory)
  module = nnx.merge(abstract.graphdef, hf.load_params(directory, cfg.model, abstract, sh))
  tokens = torch.from_numpy(TOKENS).long()
  with torch.no_grad():
    expected = hf_model("gemma2-gqa")(tokens, labels=tokens).loss.item()
  assert float(lm.next_token_loss(module, jnp.asarray(TOKENS))) == pytest.approx(expected,
                                                                                 rel=1e-5)


# Mistral-7B-v0.3 and Gemma-2-9B: model.safetensors.index.json totals (tied embeddings once);
# Gemma-3-12B's text decoder: by the formula from its text_config (48 layers, d 3840, mlp
# 15360, 16 heads, 8 kv heads, head_dim 256, vocab 262208, tied, q/k norms).
RELEASED = {"mistral-7b": 7_248_023_552, "gemma2-9b": 9_241_705_984,
            "gemma3-12b": 11_766_034_176}


@pytest.mark.parametrize("preset", RELEASED)
def test_presets_count_the_released_parameters(preset):
  """By the config's formula and by summing the abstract state (shapes only)."""
  model = registry.load(preset)
  assert model.n_params == RELEASED[preset]
  abstract = run_lib.abstract_state(H.make_config(model=model))
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract.state.params)) == \
      RELEASED[preset]
