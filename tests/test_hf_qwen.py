"""The Qwen families against transformers: Qwen2/2.5 (q/k/v biases), Qwen3 (q/k head norms,
an explicit head_dim) and Qwen3-MoE (its router's norm_topk_prob, expert widths). Random small
models of each import with transformers' logits (fp32, 1e-4) on one device, under tp and
fsdp_tp (and fsdp + expert for the MoE); `convert from-hf` → `to-hf` → from_pretrained gives
the same logits; cached generation equals uncached. Presets count exactly the released
checkpoints' parameters; what a config asks for that the models do not compute is refused.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import helpers as H
from shardlab.config import LoraConfig
from shardlab.errors import ConfigError
from shardlab.hf import config as hf_config
from shardlab.models import registry
from shardlab.training import run as run_lib

try:
  import torch
  import transformers
except ImportError:  # the preset and refusal tests need no torch
  torch = transformers = None
needs_hf = pytest.mark.skipif(torch is None, reason="needs the hf extra (pip install -e '.[hf]')")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=64, rms_norm_eps=1e-6)
# family -> (HF config and model class names, {variant: its config}). Heads and kv heads
# divide a 4-way tensor axis where they must; GQA and MHA, tied and untied; Qwen3's head_dim
# is not hidden / heads; the MoE's router renormalises its top k or not.
FAMILIES = {
    "qwen2": ("Qwen2", {
        "gqa": dict(num_attention_heads=8, num_key_value_heads=4, rope_theta=1e6),
        "tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)}),
    "qwen3": ("Qwen3", {
        "head_dim": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32),
        "tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                     tie_word_embeddings=True)}),
    "qwen3_moe": ("Qwen3Moe", {
        "norm": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True),
        "raw": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=8,
                    num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
                    tie_word_embeddings=True)}),
}
CASES = [(f, v) for f, (_, variants) in FAMILIES.items() for v in variants]
PLACEMENTS = {"1 device": ("dp", "data:1"), "tp": ("tp", "data:2,tensor:4"),
              "fsdp_tp": ("fsdp_tp", "fsdp:4,tensor:2"), "fsdp+ep": ("fsdp", "fsdp:2,expert:4")}
TOKENS = np.random.default_rng(0).integers(0, 128, size=(8, 16)).astype(np.int32)


def hf_class(family: str, kind: str):
  return getattr(transformers, FAMILIES[family][0] + kind)


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """{(family, variant): (HF dir, reference logits)} of random models whose biases are not
  zero and whose norm scales (q/k head norms too) are not all ones."""
  out = {}
  for i, (family, variant) in enumerate(CASES):
    torch.manual_seed(i)
    cfg = hf_class(family, "Config")(**BASE, **FAMILIES[family][1][variant],
                                     initializer_range=0.25, attn_implementation="eager")
    model = hf_class(family, "ForCausalLM")(cfg).eval()
    with torch.no_grad():
      for name, p in model.named_parameters():
        if "norm" in name:
          p.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
          p.uniform_(-1.0, 1.0)
    directory = tmp_path_factory.mktemp(f"hf-{family}-{variant}")
    model.save_pretrained(directory)
    out[family, variant] = directory, hf_logits(model)
  return out


def imported(directory):
  from shardlab.hf import convert as hf_convert
  return hf_convert.hf_model_config(directory)


@needs_hf
@pytest.mark.parametrize("family,variant", CASES)
def test_the_config_maps_to_the_family(saved, family, variant):
  model = imported(saved[family, variant][0])
  assert model.arch == family
  n_hf = sum(p.numel() for p in hf_class(family, "ForCausalLM").from_pretrained(
      saved[family, variant][0]).parameters())
  assert model.n_params == n_hf


def placements(family: str) -> list[str]:
  return [p for p in PLACEMENTS if family == "qwen3_moe" or p != "fsdp+ep"]


@needs_hf
@pytest.mark.parametrize("family,variant,placement",
                         [(f, v, p) for f, v in CASES for p in placements(f)])
def test_import_logits_match_transformers(saved, family, variant, placement):
  from shardlab.hf import weights as hf
  directory, expected = saved[family, variant]
  cfg, m, r, abstract, sh = H.placed_model(imported(directory), *PLACEMENTS[placement])
  params = hf.load_params(directory, cfg.model, abstract, sh)
  assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
  np.testing.assert_allclose(H.model_logits(params, m, r, abstract, sh, TOKENS), expected,
                             rtol=0, atol=1e-4)


@needs_hf
@pytest.mark.parametrize("family,variant", CASES)
def test_convert_round_trip_reloads_with_identical_logits(saved, tmp_path, family, variant):
  """from-hf → a shardlab checkpoint → to-hf → from_pretrained: transformers' logits."""
  from shardlab import cli
  directory, expected = saved[family, variant]
  ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
  assert cli.main(["convert", "from-hf", str(directory), str(ckpt)]) == 0
  assert type(registry.load(str(ckpt / "model.toml"))) is type(imported(directory))
  assert cli.main(["convert", "to-hf", str(ckpt), str(out)]) == 0
  reloaded = hf_class(family, "ForCausalLM").from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


@needs_hf
@pytest.mark.parametrize("family,variant,placement", [
    ("qwen2", "gqa", "fsdp_tp"), ("qwen3", "head_dim", "tp"),
    ("qwen3_moe", "raw", "fsdp+ep")])
def test_cached_generation_equals_uncached(saved, family, variant, placement):
  from shardlab import generate
  from shardlab.hf import weights as hf
  directory = saved[family, variant][0]
  run = H.run(*PLACEMENTS[placement], model=imported(directory))
  params = hf.load_params(directory, run.cfg.model, run.abstract, run.sh)
  gen = generate.Generator(run.cfg, run.abstract, run.sh)
  s = generate.Sampling(max_new_tokens=6, temperature=1.0, top_k=20, seed=3, num_samples=2,
                        vocab=128)
  prompt = TOKENS[0, :5]
  cached = gen.tokens(params, prompt, s)
  assert cached.shape == (2, 6)
  np.testing.assert_array_equal(cached, gen.tokens(params, prompt, s, use_cache=False))


# ---- presets and refusals (no torch) ----------------------------------------------------

RELEASED = {"qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
            "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("preset", RELEASED)
def test_presets_count_the_released_parameters(preset):
  """By the config's formula and by summing the abstract state (shapes only)."""
  model = registry.load(preset)
  assert model.n_params == RELEASED[preset]
  abstract = run_lib.abstract_state(H.make_config(model=model))
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract.state.params)) == \
      RELEASED[preset]


SHAPE = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
         "num_attention_heads": 2}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SHAPE}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SHAPE}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **SHAPE,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4}


@pytest.mark.parametrize("hf,pattern", [
    ({**QWEN2, "use_sliding_window": True},
     r"use_sliding_window=True is not supported \(attention is full causal\); valid: False"),
    ({**QWEN2, "layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types holds 'sliding_attention', which is not supported"),
    ({**QWEN2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"unsupported rope_scaling type 'yarn'"),
    ({**QWEN2, "hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({**QWEN3, "attention_bias": True}, r"attention_bias=True is not supported"),
    ({**QWEN3, "use_sliding_window": True}, r"use_sliding_window=True is not supported"),
    ({**MOE, "mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
    ({**MOE, "decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported.*valid: 1"),
    ({**MOE, "attention_bias": True}, r"attention_bias=True is not supported"),
])
def test_what_the_models_do_not_compute_is_refused_by_field(hf, pattern):
  with pytest.raises(ConfigError, match=pattern):
    hf_config.to_model(hf, "m", "config.json")


def test_configs_map_to_their_family():
  q3 = hf_config.to_model({**QWEN3, "head_dim": 16})
  assert (q3.arch, q3.head_dim) == ("qwen3", 16)
  moe = hf_config.to_model(MOE)
  assert (moe.arch, moe.mlp_dim, moe.n_experts, moe.norm_topk_prob) == ("qwen3_moe", 4, 4,
                                                                         False)
  assert hf_config.to_model(QWEN2).arch == "qwen2"


@pytest.mark.parametrize("preset,targets", [("qwen2-tiny", "q,k,v,o,gate,up,down"),
                                            ("qwen3-tiny", "q,v,down"),
                                            ("qwen3-moe-tiny", "q,k,v,o")])
def test_lora_adapts_the_offered_targets(preset, targets):
  """The adapters counted by n_lora_params are the ones the module makes; B is zero at init,
  so the adapted model computes the base one's logits."""
  model, lora = registry.load(preset), LoraConfig(rank=2, targets=targets)
  assert set(lora.target_names) <= set(model.lora_targets)
  assert set(model.lora_weights) == set(model.lora_targets)
  adapted = model.make(nnx.Rngs(0), np.float32, lora=lora)
  params = nnx.state(adapted, nnx.Param)
  n_adapter = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                  if any("lora_" in str(k) for k in p))
  assert n_adapter == model.n_lora_params(lora) > 0
  tokens = TOKENS[:2, :8]
  base = model.make(nnx.Rngs(0), np.float32)
  np.testing.assert_allclose(adapted(tokens), base(tokens), rtol=1e-5, atol=1e-5)


def test_qwen3_moe_refuses_lora_on_its_experts():
  with pytest.raises(ConfigError, match=r"adapts only q, k, v, o with LoRA"):
    registry.load("qwen3-moe-tiny").make(nnx.Rngs(0), np.float32,
                                         lora=LoraConfig(rank=2, targets="q,gate"))
