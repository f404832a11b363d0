"""The mixture-of-experts model on one device: both dispatch modes equal a direct sum over
every expert, capacity dispatch drops exactly the assignments past an expert's capacity, a
router that picks one expert gives gradients to that expert alone, the router losses reach
the train step's metrics, and the Mixtral preset has the released checkpoint's size.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlab import parallel
from shardlab.errors import ConfigError
from shardlab.models import experts, lm, registry
from shardlab.models.llama import swiglu
from shardlab.models.moe_config import MoEConfig

SMALL = MoEConfig(name="small-moe", vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                  n_kv_heads=1, head_dim=16, mlp_dim=24, n_experts=4, experts_per_token=2,
                  capacity_factor=2.0, max_seq_len=32)


def layer(cfg: MoEConfig, seed: int = 0) -> experts.Experts:
  return experts.Experts(cfg, jnp.float32, nnx.Rngs(seed))


def x_batch(shape=(2, 8, 32), seed: int = 1):
  return jax.random.normal(jax.random.key(seed), shape)


def direct(module: experts.Experts, x_BxLxD):
  """Every expert on every token, weighted by the renormalised top-k router weights."""
  logits = jnp.einsum("bld,de->ble", x_BxLxD, module.router_DxE[...])
  weights, chosen = parallel.route(logits, module.k)
  gate, up, down = module.gate_ExDxF[...], module.up_ExDxF[...], module.down_ExFxD[...]
  h = swiglu(jnp.einsum("bld,edf->blef", x_BxLxD, gate), jnp.einsum("bld,edf->blef", x_BxLxD, up))
  every_BxLxExD = jnp.einsum("blef,efd->bled", h, down)
  picked = jnp.take_along_axis(every_BxLxExD, chosen[..., None], axis=2)
  return jnp.sum(picked * weights[..., None], axis=2)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_dispatch_equals_the_direct_sum_over_experts(dispatch):
  # Capacity factor E / K: room for every token at every expert.
  cfg = dataclasses.replace(SMALL, dispatch=dispatch, capacity_factor=2.0)
  module, x = layer(cfg), x_batch()
  y, stats = module(x)
  np.testing.assert_allclose(y, direct(module, x), rtol=1e-5, atol=1e-6)
  assert float(stats["dropped"]) == 0.0
  assert float(stats["load_balance"]) >= 0.99 * cfg.experts_per_token  # k at perfect balance


def test_capacity_dispatch_drops_what_exceeds_capacity():
  cfg = dataclasses.replace(SMALL, dispatch="capacity", capacity_factor=0.5)
  module, x = layer(cfg), x_batch()
  y, stats = module(x)
  logits = jnp.einsum("bld,de->ble", x, module.router_DxE[...])
  _, chosen = parallel.route(logits, cfg.experts_per_token)
  tokens = x.shape[0] * x.shape[1]
  capacity = cfg.capacity(tokens)
  # First choices of every token in order, then second choices: first come, first served.
  queue = np.asarray(chosen).reshape(tokens, -1).T.reshape(-1)
  seen, kept = {}, []
  for e in queue:
    seen[e] = seen.get(e, 0) + 1
    kept.append(seen[e] <= capacity)
  expected_dropped = 1 - np.mean(kept)
  assert expected_dropped > 0.2
  np.testing.assert_allclose(float(stats["dropped"]), expected_dropped, rtol=1e-6)
  # A token whose every choice was dropped gets no output at all.
  kept_TxK = np.asarray(kept).reshape(-1, tokens).T
  none_kept = ~kept_TxK.any(axis=1)
  assert none_kept.any()
  np.testing.assert_array_equal(np.asarray(y).reshape(tokens, -1)[none_kept], 0.0)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_a_router_forced_to_one_expert_trains_that_expert_only(dispatch):
  cfg = dataclasses.replace(SMALL, dispatch=dispatch, experts_per_token=1, n_experts=4,
                            capacity_factor=4.0)
  model = cfg.make(nnx.Rngs(0), jnp.float32)
  graphdef, params = nnx.split(model, nnx.Param)
  router = params["blocks"]["moe"]["router_DxE"]
  router[...] = jnp.zeros_like(router[...])  # every logit 0: all experts tie ...
  tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, cfg.vocab_size)

  def loss(p):
    return lm.next_token_loss(nnx.merge(graphdef, p), tokens)[0]

  grads = jax.grad(loss)(params)
  # ... and top_k breaks ties toward the lowest index: every token goes to expert 0.
  for name in ("gate_ExDxF", "up_ExDxF", "down_ExFxD"):
    g = np.asarray(grads["blocks"]["moe"][name][...])  # layers × E × ...
    per_expert = np.abs(g).reshape(g.shape[0], g.shape[1], -1).max(axis=2)
    assert (per_expert[:, 1:] == 0).all(), (name, per_expert)
    assert (per_expert[:, 0] > 0).all(), (name, per_expert)


def test_router_losses_reach_the_loss_and_its_metrics():
  cfg = dataclasses.replace(SMALL, router_aux_loss=0.1, router_z_loss=0.01)
  model = cfg.make(nnx.Rngs(0), jnp.float32)
  tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, cfg.vocab_size)
  loss, metrics = lm.next_token_loss(model, tokens)
  want = (metrics["cross_entropy"] + 0.1 * metrics["moe_load_balance"] +
          0.01 * metrics["moe_router_z"])
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  assert set(metrics) == {"cross_entropy", "moe_load_balance", "moe_router_z", "moe_dropped"}


def test_parameter_counts_are_exact():
  mixtral = registry.load("mixtral-8x7b")
  assert mixtral.n_params == 46_702_792_704  # mistralai/Mixtral-8x7B-v0.1
  assert mixtral.n_active_params == 12_879_925_248
  tiny = registry.load("moe-tiny")
  state = nnx.state(nnx.eval_shape(lambda: tiny.make(nnx.Rngs(0), jnp.float32)), nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(state)) == tiny.n_params
  # The same active MLP width as the dense tiny preset.
  dense = registry.load("tiny")
  assert tiny.experts_per_token * tiny.mlp_dim == dense.mlp_dim
  assert tiny.n_active_params - dense.n_params == tiny.n_layers * tiny.d_model * tiny.n_experts


def test_bad_moe_fields_are_refused():
  with pytest.raises(ConfigError, match="experts_per_token"):
    dataclasses.replace(SMALL, experts_per_token=5)
  with pytest.raises(ConfigError, match="model.dispatch"):
    dataclasses.replace(SMALL, dispatch="ragged")
  with pytest.raises(ConfigError, match="capacity_factor"):
    dataclasses.replace(SMALL, capacity_factor=0.0)


def test_decoding_with_the_cache_gives_the_full_forward_logits():
  """What `generate` runs: prefill, then one token at a time through the KV cache."""
  cfg = dataclasses.replace(SMALL, dispatch="capacity", capacity_factor=2.0)
  model = cfg.make(nnx.Rngs(0), jnp.float32)
  tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, cfg.vocab_size)
  full = model(tokens)
  cache = cfg.init_cache(2, 16, jnp.float32)
  first, cache = model.extend(tokens[:, :7], cache)
  steps = [first]
  for i in range(7, 10):
    out, cache = model.extend(tokens[:, i:i + 1], cache)
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
