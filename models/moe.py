"""A Mixtral-style decoder: llama's attention, and a mixture of SwiGLU experts in place of
every MLP (models/experts.py).

The layers are scanned as llama's are, carrying the router statistics (load balance,
z-loss, dropped fraction) summed over the layers besides the residual stream;
`hidden_and_losses` returns them as the auxiliary loss and metrics that
models/lm.next_token_loss adds to the cross-entropy. Pipeline stages are not offered.
Shape suffixes as in models/llama.py.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from shardlab.models import experts
from shardlab.models.decoder import ACTIVATIONS, KVCache, LAYER_INPUT, REMAT_POLICIES
from shardlab.models.decoder import stacked_param as _param
from shardlab.models.llama import Attention, Llama, RMSNorm
from shardlab.sharding.activations import constrain, scan_unroll


class MoEBlock(nnx.Module):
  """x + attn(norm(x)), then + experts(norm(x)); also returns the layer's router stats."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=()):
    self.attn_norm = RMSNorm(cfg, dtype, rngs, stack)
    self.attn = Attention(cfg, dtype, rngs, stack)
    self.mlp_norm = RMSNorm(cfg, dtype, rngs, stack)
    self.moe = experts.Experts(cfg, dtype, rngs, stack)

  def __call__(self, x_BxLxD, *attn_inputs):
    x_BxLxD = checkpoint_name(x_BxLxD, LAYER_INPUT)
    y, cache_kv = self.attn(self.attn_norm(x_BxLxD), *attn_inputs)
    x = x_BxLxD + y
    y, stats = self.moe(self.mlp_norm(x))
    return constrain(x + y, ACTIVATIONS["residual"]), cache_kv, stats


def scan_blocks(blocks: nnx.Module, x_BxLxD, cache: KVCache | None, remat: str, *args):
  """decoder.scan_blocks with the router stats summed over the layers in the carry."""
  graphdef, stacked = nnx.split(blocks)
  cache_kv = None if cache is None else (cache.k_NxBxSxKxE, cache.v_NxBxSxKxE)

  def layer(carry, inputs):
    x, totals = carry
    layer_state, layer_kv = inputs
    x, layer_kv, stats = nnx.merge(graphdef, layer_state)(x, *args, layer_kv)
    return (x, {k: totals[k] + stats[k] for k in totals}), layer_kv

  if remat != "none":
    layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
  zeros = {k: jnp.zeros((), jnp.float32) for k in experts.STATS}
  return jax.lax.scan(layer, (x_BxLxD, zeros), (stacked, cache_kv), unroll=scan_unroll())


class MoE(Llama):
  """Decoder-only Transformer with mixture-of-experts MLPs (the Llama interface, plus
  `hidden_and_losses`)."""

  def __init__(self, cfg, rngs: nnx.Rngs, param_dtype=jnp.float32, remat: str = "none"):
    self.cfg = cfg
    self.remat = remat
    d, v = cfg.d_model, cfg.vocab_size
    self.embed_VxD = _param(rngs, (v, d), ("vocab", "embed"), d, param_dtype)
    self.blocks = MoEBlock(cfg, param_dtype, rngs, stack=(cfg.n_layers,))
    self.final_norm = RMSNorm(cfg, param_dtype, rngs)
    if not cfg.tie_embeddings:
      self.head_DxV = _param(rngs, (d, v), ("embed", "vocab"), d, param_dtype)

  def hidden_and_losses(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """(final-normed residual stream, auxiliary loss, metrics): the router losses weighted
    by model.router_aux_loss and model.router_z_loss, and each one's mean over layers."""
    x, _, totals = self._run(tokens_BxL, positions_BxL, None, segment_ids_BxL)
    mean = {k: v / self.cfg.n_layers for k, v in totals.items()}
    aux = (self.cfg.router_aux_loss * mean["load_balance"] +
           self.cfg.router_z_loss * mean["router_z"])
    return x, aux, {"moe_load_balance": mean["load_balance"],
                    "moe_router_z": mean["router_z"], "moe_dropped": mean["dropped"]}

  def _forward(self, tokens_BxL, positions_BxL, cache: KVCache | None, segments_BxL=None):
    return self._run(tokens_BxL, positions_BxL, cache, segments_BxL)[:2]

  def _run(self, tokens_BxL, positions_BxL, cache, segments_BxL):
    x, layer_args, restore, end = self._inputs(tokens_BxL, positions_BxL, cache, segments_BxL)
    (x, totals), cache_kv = scan_blocks(self.blocks, x, cache, self.remat, *layer_args)
    x = restore(self.final_norm(x))
    return x, None if cache is None else KVCache(*cache_kv, end), totals
