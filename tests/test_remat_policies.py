"""The layer scan's remat policies (shardlab/remat.py), MaxText's named ones included: each
keeps what it names — read off the traced backward's residuals, for every dense family and
a mixture of experts — the planner keeps the same bytes on the device and in host memory,
and every policy computes the same gradients as no remat."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers as H

from shardlab import remat as remat_lib
from shardlab.config import TrainConfig
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.plan.compiled import aot
from shardlab.plan.training import memory as plan_memory
from shardlab.plan.training import recompute
from shardlab.plan.training.activations import ActivationShapes
from shardlab.training import combinations

B, L = 2, 32
FAMILIES = ("tiny", "gpt2-tiny", "gemma2-tiny", "gemma3-tiny", "qwen2-tiny", "phi3-tiny",
            "moe-tiny")
# MaxText's llama3.1-8b recipe on v6e-256 (benchmarks/maxtext_trillium_model_configs.py:
# remat_policy=custom, its decoder input and q/k/v/out projections offloaded), and a custom
# policy that keeps some projections on the device and offloads others.
LLAMA31_8B_V6E = ("custom:layer_input=offload,query_proj=offload,key_proj=offload,"
                  "value_proj=offload,out_proj=offload")
MIXED = "custom:query_proj=device,key_proj=remat,value_proj=offload,mlpwi_0=offload"
REMATTED = (*(r for r in remat_lib.POLICIES if r != "none"), LLAMA31_8B_V6E, MIXED)


def loss_fn(m, remat: str, abstract: bool = False):
  make = lambda: m.make(nnx.Rngs(0), jnp.float32, remat)  # noqa: E731
  graphdef, state = nnx.split(nnx.eval_shape(make) if abstract else make())
  tokens = (jnp.arange(B * L, dtype=jnp.int32).reshape(B, L) * 7) % m.vocab_size

  def loss(state):
    return jnp.mean(nnx.merge(graphdef, state)(tokens).astype(jnp.float32) ** 2)
  return loss, state


def residual_bytes(m, remat: str) -> int:
  """Bytes of every value the backward pass reads (jax.vjp's residuals, as
  jax.ad_checkpoint.print_saved_residuals lists them), the device's and the host's."""
  loss, state = loss_fn(m, remat, abstract=True)
  _, (_, vjp) = jax.make_jaxpr(lambda s: jax.vjp(loss, s), return_shape=True)(state)
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(vjp))


def planned_bytes(m, remat: str) -> float:
  """The planner's device (the layer stack's) plus host bytes, one device, fp32."""
  d, q, kv = B * L * m.d_model, B * L * m.n_heads * m.head_dim, B * L * m.n_kv_heads * m.head_dim
  a = ActivationShapes(d=d, residual=d, q=q, kv=kv, scores=B * m.n_heads * L * L,
                                   mlp=B * L * m.mlp_dim, logits=0, tokens=0, positions=0)
  return (plan_memory.stack_saved_bytes(a, 4, remat, m) +
          plan_memory.offloaded_activation_bytes(m, a, 4, remat))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_policy_keeps_what_the_planner_says(family):
  """Against full remat (the layer inputs alone), each policy's extra residuals are the
  planner's to the byte: the named projections it keeps (the ones the backward reads: not
  llama's down-projection, which nothing below reads; Gemma's, which its post-MLP norm
  does), save-matmul-outputs' every projection, and what offloading policies keep on the
  host. A mixture of experts keeps its attention's projections alone (the experts' matmuls
  are batched) and, under save-matmul-outputs, the router's fp32 logits, which the planner
  leaves out."""
  m = dataclasses.replace(registry.load(family), attention="xla")
  full = residual_bytes(m, "full") - planned_bytes(m, "full")
  router = m.n_layers * B * L * getattr(m, "n_experts", 0) * 4
  for remat in REMATTED:
    extra = router if remat == "save-matmul-outputs" else 0
    assert residual_bytes(m, remat) - full == planned_bytes(m, remat) + extra, remat
  # The named policies keep more than full remat, each what it names (checked above).
  named = {r: planned_bytes(m, r) for r in remat_lib.NAMED}
  assert all(b > planned_bytes(m, "full") for b in named.values()), named


def test_offloading_policies_keep_on_the_host_what_the_others_keep_on_the_device():
  """qkv-proj-offloaded keeps save-qkv-proj's residuals in host memory, minimal-offloaded
  save-matmul-outputs'; on the device each keeps full remat's layer inputs."""
  m = registry.load("tiny")
  a = ActivationShapes(d=100, residual=100, q=60, kv=20, scores=500, mlp=300,
                                   logits=0, tokens=0, positions=0)
  device = {r: plan_memory.layer_saved_bytes(a, 2, r, m) for r in REMATTED}
  host = {r: plan_memory.offloaded_activation_bytes(m, a, 2, r) for r in REMATTED}
  for offloaded, kept in (("qkv-proj-offloaded", "save-qkv-proj"),
                          ("minimal-offloaded", "save-matmul-outputs")):
    assert device[offloaded] == device["full"]
    assert host[offloaded] == m.n_layers * (device[kept] - device["full"]) > 0
  assert host["offload"] == m.n_layers * a.residual * 2 and device["offload"] == 0


def test_named_policies_recompute_the_projections_they_do_not_keep():
  """Backward FLOPs: each policy reruns attention's einsums; full every weight matmul but
  the down projection's (its output is read by no backward); save-qkv-proj all but q, k
  and v too; save-dot-except-mlp all but those and o; the MLP's input projections are
  rerun by all three named device policies."""
  m = registry.load("llama2-7b")
  seq = 4096
  flops = {r: recompute.hardware_flops_per_token(m, seq, r) for r in remat_lib.POLICIES}
  attention = 4 * m.n_layers * m.n_heads * m.head_dim * seq
  d, q, kv = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
  weights = 2 * (m.n_layer_params - m.n_layers * m.mlp_dim * d)
  qkv = 2 * m.n_layers * d * (q + 2 * kv)
  o = 2 * m.n_layers * q * d
  base = flops["none"]
  assert flops["full"] - base == weights + attention
  assert flops["save-matmul-outputs"] - base == attention == flops["minimal-offloaded"] - base
  assert flops["save-qkv-proj"] - base == weights - qkv + attention
  assert flops["qkv-proj-offloaded"] == flops["save-qkv-proj"]
  assert flops["save-dot-except-mlp"] - base == weights - qkv - o + attention
  assert flops["save-dot-except-mlpwi"] == flops["save-dot-except-mlp"]  # mlpwo: not read


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny", "gemma2-tiny"])
def test_planned_recompute_is_the_compiled_steps(name):
  """The planner's extra FLOPs a token under remat against the compiled step's (one CPU
  device, fp32): llama's and GPT-2's recomputed forward leaves out the down projection,
  whose output only joins the residual sum; Gemma's post-MLP norm reads it, so Gemma reruns
  it. Measured 1.002-1.003 (tiny), 1.011-1.020 (gpt2-tiny: the planner's 2 FLOPs a weight
  count its biases and norm scales too) and 1.006-1.009 (gemma2-tiny); counting llama's
  down projection made tiny's 1.30-1.43 and gpt2-tiny's 1.46-1.82."""
  m = dataclasses.replace(registry.load(name), attention="xla")
  seq, tokens = 64, 2 * 64
  flops = {}
  for remat in ("none", "full", "save-dot-except-mlp"):
    cfg = H.make_config("dp", "data:1", m, remat=remat, global_batch=2, seq_len=seq,
                        precision="fp32")
    flops[remat] = aot.compile_on_cpu(cfg, 1).flops
  planned = lambda r: recompute.hardware_flops_per_token(m, seq, r)  # noqa: E731
  for remat in ("full", "save-dot-except-mlp"):
    got = (flops[remat] - flops["none"]) / tokens
    assert planned(remat) - planned("none") == pytest.approx(got, rel=0.025), (remat, got)


def test_a_mixture_of_experts_recomputes_only_the_experts_a_token_runs():
  """Under full remat a token's forward runs again through its own experts, not all of
  them: Mixtral 8x7B reruns 2 of its 8 experts a layer (1.33× the model FLOPs a token, as a
  dense model; counting every expert made it 2.15×)."""
  m = registry.load("mixtral-8x7b")
  seq = 4096
  attention = 4 * m.n_layers * m.n_heads * m.head_dim * seq
  embeddings = 2 * m.vocab_size * m.d_model
  full, none = (recompute.hardware_flops_per_token(m, seq, r) for r in ("full", "none"))
  assert full - none == 2 * (m.n_active_params - embeddings) + attention
  assert full / none == pytest.approx(1.33, abs=0.01)


def test_every_policy_computes_the_same_gradients():
  """tiny in fp32: every policy's gradients are no remat's (offloading ones too: XLA:CPU
  has a pinned_host memory), so a policy changes memory and time, never the update."""
  m = registry.load("tiny")
  losses = {r: loss_fn(m, r) for r in ("none", *REMATTED)}
  state = losses["none"][1]  # one init: the params do not depend on the policy
  grads = jax.jit(lambda s: {r: jax.grad(f)(s) for r, (f, _) in losses.items()})(state)
  for remat in REMATTED:
    for g, w in zip(jax.tree.leaves(grads[remat]), jax.tree.leaves(grads["none"])):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-7,
                                 err_msg=remat)


def test_a_custom_policy_is_the_listed_one_that_keeps_the_same_tensors_in_the_same_place():
  """A custom spec keeps what it names where it says: written out, the listed policies are
  the same Policy (and so the same residuals, plan and program); the recipe above offloads
  its input and four projections, and MIXED's key projection, left to `remat`, is not kept."""
  same = {"custom:layer_input=offload": "offload",
          "custom:query_proj=offload, key_proj=offload ,value_proj=offload": "qkv-proj-offloaded",
          "custom:query_proj=device,key_proj=device,value_proj=device": "save-qkv-proj",
          "custom:out_proj=device,query_proj=device,key_proj=device,value_proj=device,"
          "mlpwi_0=remat": "save-dot-except-mlp"}
  for spec, listed in same.items():
    assert remat_lib.policy(spec) == remat_lib.POLICIES[listed], spec
  p = remat_lib.policy(LLAMA31_8B_V6E)
  assert p.saved == () and set(p.offloaded) == {"layer_input", *remat_lib.QKV, "out_proj"}
  p = remat_lib.policy(MIXED)
  assert p.saved == ("query_proj",) and p.offloaded == ("value_proj", "mlpwi_0")
  assert remat_lib.recomputes_all("custom:layer_input=offload")
  assert not remat_lib.recomputes_all(MIXED)


@pytest.mark.parametrize("spec, message", [
    ("custom:", r"'' is not NAME=WHERE"),
    ("custom:query_proj", r"'query_proj' is not NAME=WHERE with NAME one of layer_input"),
    ("custom:decoder_layer_input=offload", r"NAME one of layer_input, query_proj"),
    ("custom:query_proj=host", r"WHERE one of device, offload, remat"),
    ("custom:query_proj=device,query_proj=offload", r"places query_proj twice"),
    ("custom:layer_input=device", r"layer_input=device is what every policy does"),
    ("custom query_proj=device", r"unknown train.remat.*valid: custom:NAME="),
])
def test_a_malformed_custom_policy_is_refused_naming_what_is_valid(spec, message):
  with pytest.raises(ConfigError, match=message):
    TrainConfig(remat=spec)


def test_a_custom_policy_runs_on_a_model_that_runs_what_it_builds_on():
  """A module offering only full and offload (it names no projections) runs a custom
  policy that offloads its input, and refuses one that names a projection, saying why."""
  accepted = ("none", "full", "offload")
  assert remat_lib.offered("custom:layer_input=offload", accepted)
  assert not remat_lib.offered("custom:layer_input=offload", ("none", "full"))
  assert not remat_lib.offered(MIXED, accepted)
  assert remat_lib.offered(MIXED, tuple(remat_lib.POLICIES))
  cfg = types.SimpleNamespace(model=types.SimpleNamespace(name="mine", remat_policies=accepted),
                              train=types.SimpleNamespace(remat=MIXED),
                              lora=types.SimpleNamespace(rank=0))
  with pytest.raises(ConfigError, match=r"not offered by model mine; valid: none, full, "
                                         r"offload \(a custom policy .* naming projections"):
    combinations.check_model_settings(cfg)


def test_a_policy_is_named_as_train_remat_or_refused_naming_the_valid_ones():
  assert TrainConfig(remat="save-dot-except-mlpwi").remat == "save-dot-except-mlpwi"
  with pytest.raises(ConfigError, match=r"train.remat.*save_dot_except_mlpwi.*"
                                         r"save-dot-except-mlpwi"):
    TrainConfig(remat="save_dot_except_mlpwi")
  for family in FAMILIES:
    assert set(registry.load(family).remat_policies) == set(remat_lib.POLICIES), family
