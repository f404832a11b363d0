"""The model contract (shardlab.models.protocol): every registered architecture keeps it —
its params carry logical names the rules know and sizes axis_sizes gives, n_params counts
them, its KV cache prefills to the plain forward's logits; a config that breaks it is refused
when it registers; the planner refuses a model without what it needs. And its exit test: a
Llama variant with a qkv bias is one new file (tests/data/llama_qkv_bias.py), which trains
under fsdp_tp as on one device."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import helpers as H
import test_layout
from shardlab.config import LoraConfig
from shardlab.errors import ConfigError
from shardlab.models import protocol, registry
from shardlab.models.llama_config import LlamaConfig
from shardlab.plan.training import planner
from shardlab.runtime import hardware
from shardlab.sharding import rules as rules_lib
from shardlab.training import run as run_lib

DATA = Path(__file__).parent / "data"
VARIANT_FILE = DATA / "llama_qkv_bias.py"
VARIANT_TOML = DATA / "llama-qkv-bias.toml"


def import_variant():
  """The variant's file as a module (importing it registers its architecture), once."""
  if "llama_qkv_bias" not in sys.modules:
    spec = importlib.util.spec_from_file_location("llama_qkv_bias", VARIANT_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
  return sys.modules["llama_qkv_bias"]


import_variant()  # before the registry is read below: the variant is checked like the others
# A small model file of each architecture; a newly registered one needs an entry here.
SMALL = {"llama": "tiny", "gpt2": "gpt2-tiny", "moe": "moe-tiny",
         "llama-qkv-bias": str(VARIANT_TOML), "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny",
         "qwen3_moe": "qwen3-moe-tiny", "mistral": "mistral-tiny", "gemma2": "gemma2-tiny",
         "gemma3": "gemma3-tiny", "phi3": "phi3-tiny"}
ARCHS = sorted(registry.ARCHITECTURES)


def small(arch: str):
  assert arch in SMALL, f"architecture {arch!r} has no small model file in SMALL"
  model = registry.load(SMALL[arch])
  assert type(model) is registry.ARCHITECTURES[arch] and model.arch == arch
  return model


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_keeps_the_contract(arch):
  model = small(arch)
  assert protocol.check(registry.ARCHITECTURES[arch]) is registry.ARCHITECTURES[arch]
  assert protocol.check(model) is model and isinstance(model, protocol.ModelConfig)
  abstract = run_lib.abstract_state(H.make_config(model=model))
  names = H.param_names(abstract)
  shapes = {H.dict_path(p): a.shape for p, a in
            jax.tree_util.tree_flatten_with_path(abstract.state.params)[0]}
  assert set(names) == set(shapes)
  sizes = model.axis_sizes()
  for path, axes in names.items():
    assert len(axes) == len(shapes[path]), (path, axes, shapes[path])
    unknown = [a for a in axes if a is not None and a not in rules_lib.BUILTIN_AXES]
    assert not unknown, f"{path}: logical names {unknown} no rules table knows"
    # Every named dim's size is the one axis_sizes gives (the planner and the auto layout
    # size their meshes by it); LoRA's rank is the adapter's, not the model's.
    wrong = [(a, n) for a, n in zip(axes, shapes[path])
             if a is not None and a != "lora_rank" and sizes.get(a) != n]
    assert not wrong, f"{path}: dims {wrong} but axis_sizes() gives {sizes}"
  assert model.n_params == sum(int(np.prod(s)) for s in shapes.values())
  assert 0 < model.n_layer_params < model.n_params
  assert model.flops_per_token(16) > 0 and model.n_lora_params(LoraConfig()) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_runs_forward_and_prefills_its_cache(arch):
  model = small(arch)
  module = model.make(nnx.Rngs(0), jnp.float32, "none")
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, model.vocab_size)
  logits = module(tokens)
  assert logits.shape == (2, 8, model.vocab_size) and bool(jnp.isfinite(logits).all())
  cache = model.init_cache(2, 16, jnp.float32)
  names = model.activations["kv_cache"]
  assert any(leaf.ndim == len(names) for leaf in jax.tree.leaves(cache))
  prefilled, cache = module.extend(tokens, cache)
  np.testing.assert_allclose(prefilled, logits, rtol=1e-5, atol=1e-5)
  assert int(cache.index) == 8


def test_the_typed_protocol_lists_the_required_members():
  typed = set(protocol.ModelConfig.__annotations__) | {
      k for k, v in vars(protocol.ModelConfig).items() if callable(v) and not k.startswith("_")}
  assert typed == set(protocol.REQUIRED) and set(protocol.SIGNATURES) <= typed
  assert not set(protocol.REQUIRED) & set(protocol.OPTIONAL)


def test_the_registry_is_a_read_only_view():
  with pytest.raises(TypeError):
    registry.ARCHITECTURES["mine"] = LlamaConfig
  assert {"llama", "gpt2", "moe"} <= set(registry.ARCHITECTURES)
  assert protocol.register("llama")(LlamaConfig) is LlamaConfig  # the same class again: fine


def minimal(without=(), **changed) -> type:
  """A config class with exactly the required members (less `without`), or `changed` ones."""
  members = dict(
      name="m", arch="minimal", vocab_size=8, max_seq_len=8, n_layers=1, d_model=1,
      n_heads=1, n_kv_heads=1, head_dim=1, mlp_dim=1, tie_embeddings=True, activations={},
      no_weight_decay=(), remat_policies=("none",), n_params=0, n_layer_params=0,
      lora_targets=(), lora_weights={},
      make=lambda self, rngs, param_dtype, remat="none", lora=None, unroll=1: None,
      init_cache=lambda self, batch, length, dtype: None, axis_sizes=lambda self: {},
      flops_per_token=lambda self, seq_len: 0.0, n_lora_params=lambda self, lora: 0)
  assert set(members) == set(protocol.REQUIRED)
  members.update(changed)
  return type("Minimal", (), {k: v for k, v in members.items() if k not in without})


def test_register_refuses_a_config_that_breaks_the_contract():
  assert protocol.check(minimal()) is not None
  for member in ("flops_per_token", "n_layer_params", "lora_weights", "name"):
    with pytest.raises(ConfigError, match=rf"Minimal does not keep .*\n  missing {member}: "):
      protocol.register("minimal")(minimal(without=(member,)))
  with pytest.raises(ConfigError, match=r"make\(self, rngs, param_dtype, remat\).*cannot be "
                                        r"called as make\(None, None, 'none', lora=None, "
                                        r"unroll=1\)"):
    protocol.register("minimal")(minimal(make=lambda self, rngs, param_dtype, remat: None))
  with pytest.raises(ConfigError, match="n_params must be a value or a property"):
    protocol.register("minimal")(minimal(n_params=lambda self: 0))
  with pytest.raises(ConfigError, match="missing experts_per_token: a mixture of experts"):
    protocol.register("minimal")(minimal(n_experts=4))
  with pytest.raises(ConfigError, match="registers as 'other' but its arch defaults to "
                                        "'minimal'"):
    protocol.register("other")(minimal())
  with pytest.raises(ConfigError, match="'llama' is already registered by "
                                        "shardlab.models.llama_config.LlamaConfig"):
    protocol.register("llama")(minimal(arch="llama"))
  assert "minimal" not in registry.ARCHITECTURES and "other" not in registry.ARCHITECTURES


def test_optional_members_have_stated_meanings():
  gpt2, moe = small("gpt2"), small("moe")
  assert protocol.get(gpt2, "eos_ids") == () and protocol.get(small("llama"), "eos_ids")
  assert protocol.get(gpt2, "n_active_params") == gpt2.n_params
  assert protocol.get(moe, "n_active_params") < moe.n_params
  assert protocol.has(moe, "n_experts") and not protocol.has(gpt2, "n_experts")
  assert set(protocol.EXPERTS) - set(protocol.OPTIONAL) <= set(dir(moe))
  with pytest.raises(KeyError, match="not an optional member"):
    protocol.has(gpt2, "n_params")


def test_optional_module_members_have_stated_meanings():
  """pipeline_parts (train.pipeline_schedule=1f1b): llama, its variants and GPT-2 give it; a
  mixture of experts opts out (a pipeline does not carry its router statistics)."""
  made = {arch: type(nnx.eval_shape(lambda: small(arch).make(nnx.Rngs(0), jnp.float32)))
          for arch in SMALL}
  offered = {a for a, cls in made.items() if protocol.module_has(cls, "pipeline_parts")}
  assert {"llama", "gpt2", "llama-qkv-bias"} <= offered, offered
  assert not {a for a in made if protocol.has(small(a), "n_experts")} & offered, offered
  assert not set(protocol.MODULE_OPTIONAL) & (set(protocol.OPTIONAL) | set(protocol.REQUIRED))
  with pytest.raises(KeyError, match="not an optional module member"):
    protocol.module_has(made["llama"], "hidden")


class Lacking:
  """A model config without some members (as a new architecture might be)."""

  def __init__(self, model, *lacking):
    self._model, self._lacking = model, lacking

  def __getattr__(self, name):
    if name in self._lacking:
      raise AttributeError(name)
    return getattr(self._model, name)


@pytest.mark.parametrize("member", ["saved_activations", "attention"])
def test_the_planner_refuses_a_model_without_what_it_needs(member):
  req = planner.Request.of(model="tiny", strategy="fsdp", devices=8, global_batch=8,
                           seq_len=64)
  model = Lacking(small("llama"), member)
  acc = hardware.get(req.target)
  with pytest.raises(ConfigError, match=rf"the analytic planner needs model\.{member} .*"
                                        rf"compile the step instead \(--compile\)"):
    planner.estimate(req, model, acc, planner.resolve_mesh(req, model, acc))


# ---- the exit test: a Llama variant with a qkv bias is one new file ----------------------

def test_the_variant_file_imports_only_public_names():
  assert test_layout.private_imports(VARIANT_FILE) == []


BIASES = {"q_bias_HxE": ("layers", "heads", "head_dim"),
          "k_bias_KxE": ("layers", "kv_heads", "head_dim"),
          "v_bias_KxE": ("layers", "kv_heads", "head_dim")}


def test_a_llama_variant_with_a_qkv_bias_trains_sharded_as_on_one_device():
  model = registry.load(str(VARIANT_TOML))
  assert type(model) is import_variant().QKVBiasConfig
  # No warmup: the first step already moves the weights (warmup starts the rate at 0).
  sharded = H.run("fsdp_tp", model=model, warmup_steps=0)
  one = H.run("dp", "data:1", model=model, warmup_steps=0)
  names = H.param_names(sharded.abstract)
  for bias, axes in BIASES.items():
    assert names[("blocks", "attn", bias)] == axes
  losses, final = {}, {}
  for r in (sharded, one):
    state, batch, losses[r] = r.fresh_state(), r.batch(0), []
    for _ in range(2):  # the same batch twice: the second loss must be lower
      state, metrics = r.compiled_step(state, batch)
      losses[r].append(float(metrics["loss"]))
    assert np.isfinite(losses[r]).all() and losses[r][1] < losses[r][0], losses[r]
    final[r] = state.params["blocks"]["attn"]
  np.testing.assert_allclose(losses[sharded], losses[one], rtol=1e-5)
  # The biases trained (they are in the loss's path) and are placed as the rules say:
  # heads and kv_heads over `tensor`, replicated over `fsdp` (no `embed` dim).
  for bias, axes in BIASES.items():
    leaf = final[sharded][bias]
    assert np.abs(np.asarray(leaf)).max() > 0, bias
    want = rules_lib.spec(axes, leaf.shape, sharded.rules.params, sharded.mesh, bias)
    assert want == P(None, "tensor") and leaf.sharding.spec == want, (bias, leaf.sharding)
    # Two Adam steps of lr 1e-2 move each element up to 0.02; reduction order moves an element
    # with a near-zero gradient by a little of that, and how much depends on the host's fp32
    # summation order (seen: 3.6e-6 on an Intel AVX-512 host; 1.55e-5, one element of 64, on
    # an AMD EPYC one). A bias that missed its reduction or its update would be ~1e-2 off.
    np.testing.assert_allclose(leaf, final[one][bias], rtol=1e-4, atol=5e-5)
