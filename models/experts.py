"""A mixture of SwiGLU experts with a top-k router (Shazeer et al. 2017; Switch, Fedus et al.
2021; Mixtral, Jiang et al. 2024).

The router runs in fp32 on the whole (sharded) batch: softmax over the experts, the top k
kept and renormalised to sum to 1 (Mixtral's rule). Its statistics give the load-balancing
loss E · Σ_e f_e · P_e (f_e: the fraction of token-choices that picked e, summed over the k
choices; P_e: the mean router probability of e; k at perfect balance, as Hugging Face's
Mixtral computes it) and the router z-loss mean(logsumexp(logits)²) (ST-MoE, Zoph et al.
2022). Both are global over the batch, so they are the same on every mesh. Dispatch, the
experts' matmuls and the combine run in models/dispatch.py, per device.
Shape suffixes: B batch, L length, D d_model, E experts, F mlp, K experts per token.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shardlab.models import dispatch
from shardlab.models.decoder import stacked_param as _param

DISPATCH = dispatch.MODES
ROUTER_NAMES = ("embed", None)  # the router's expert dim is small: never split
EXPERT_NAMES = {"in": ("experts", "embed", "mlp"), "out": ("experts", "mlp", "embed")}
STATS = ("load_balance", "router_z", "dropped")  # per layer, summed over layers by the model


class Experts(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=()):
    d, f, e = cfg.d_model, cfg.mlp_dim, cfg.n_experts
    self.router_DxE = _param(rngs, (d, e), ROUTER_NAMES, d, dtype, stack)
    self.gate_ExDxF = _param(rngs, (e, d, f), EXPERT_NAMES["in"], d, dtype, stack)
    self.up_ExDxF = _param(rngs, (e, d, f), EXPERT_NAMES["in"], d, dtype, stack)
    self.down_ExFxD = _param(rngs, (e, f, d), EXPERT_NAMES["out"], f, dtype, stack)
    self.k, self.mode, self.capacity_factor = (cfg.experts_per_token, cfg.dispatch,
                                               cfg.capacity_factor)

  def __call__(self, x_BxLxD):
    """(output B×L×D, {load_balance, router_z, dropped fraction}) of this layer."""
    logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32),
                              self.router_DxE[...].astype(jnp.float32))
    weights_BxLxK, experts_BxLxK = route(logits_BxLxE, self.k)
    stats = router_stats(logits_BxLxE, experts_BxLxK)
    weights = (self.gate_ExDxF[...], self.up_ExDxF[...], self.down_ExFxD[...])
    y_BxLxD, kept_BxLxK = dispatch.run(x_BxLxD, experts_BxLxK,
                                       weights_BxLxK.astype(x_BxLxD.dtype), weights,
                                       self.mode, self.capacity_factor)
    stats["dropped"] = 1.0 - jnp.mean(kept_BxLxK.astype(jnp.float32))
    return y_BxLxD, stats


def route(logits_BxLxE, k: int):
  """(weights, expert ids), B×L×K each: the top k of the softmax, renormalised."""
  probs = jax.nn.softmax(logits_BxLxE, axis=-1)
  top_p, top_e = jax.lax.top_k(probs, k)
  return top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_e.astype(jnp.int32)


def router_stats(logits_BxLxE, experts_BxLxK) -> dict:
  n_experts = logits_BxLxE.shape[-1]
  probs_E = jnp.mean(jax.nn.softmax(logits_BxLxE, axis=-1), axis=(0, 1))
  chosen = jax.nn.one_hot(experts_BxLxK, n_experts, dtype=jnp.float32)
  fraction_E = jnp.sum(jnp.mean(chosen, axis=(0, 1)), axis=0)
  z = jax.nn.logsumexp(logits_BxLxE, axis=-1)
  return {"load_balance": n_experts * jnp.sum(fraction_E * probs_E),
          "router_z": jnp.mean(z * z)}
