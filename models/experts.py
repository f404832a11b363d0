"""A mixture of SwiGLU experts with a top-k router (Shazeer et al. 2017; Switch, Fedus et al.
2021; Mixtral, Jiang et al. 2024).

The router runs in fp32 on the whole (sharded) batch (shardlab.parallel.route: softmax, top
k, renormalised — Mixtral's rule); its load-balancing and z losses come back per layer
(shardlab.parallel.router_stats). Dispatch, the experts' matmuls and the combine run in
shardlab.parallel.experts, per device, under expert parallelism when the rules say so.
Shape suffixes: B batch, L length, D d_model, E experts, F mlp, K experts per token.
"""

import jax.numpy as jnp
from flax import nnx

from shardlab import parallel
from shardlab.parallel import stacked_param as _param

DISPATCH = parallel.DISPATCH_MODES
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
    weights_BxLxK, experts_BxLxK = self.route(logits_BxLxE)
    stats = parallel.router_stats(logits_BxLxE, experts_BxLxK)
    weights = (self.gate_ExDxF[...], self.up_ExDxF[...], self.down_ExFxD[...])
    y_BxLxD, kept_BxLxK = parallel.experts(x_BxLxD, experts_BxLxK,
                                           weights_BxLxK.astype(x_BxLxD.dtype), weights,
                                           self.mode, self.capacity_factor)
    stats["dropped"] = 1.0 - jnp.mean(kept_BxLxK.astype(jnp.float32))
    return y_BxLxD, stats

  def route(self, logits_BxLxE):
    """(weights, expert ids) B×L×K: Mixtral's rule (renormalised top k); the seam a family
    with another router overrides (Qwen3-MoE's optional renormalisation)."""
    return parallel.route(logits_BxLxE, self.k)
