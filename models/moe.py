"""A Mixtral-style decoder: llama's attention, and a mixture of SwiGLU experts in place of
every MLP (models/experts.py).

The blocks are the decoder's (models/decoder.Block with the experts as its feed-forward),
scanned by the same layer scan, which carries the router statistics (load balance, z-loss,
dropped fraction) summed over the layers besides the residual stream;
`hidden_and_losses` returns them as the auxiliary loss and metrics that
models/lm.next_token_loss adds to the cross-entropy. A pipeline does not carry those
statistics, so a mesh that splits `layers` over `stage` is refused for it.
Shape suffixes as in models/llama.py.
"""

import jax.numpy as jnp
from flax import nnx

from shardlab.models import experts
from shardlab.models.decoder import Block, KVCache, scan_blocks
from shardlab.models.llama import Attention, Llama, RMSNorm
from shardlab.parallel import stacked_param as _param


class MoEBlock(Block):
  """x + attn(norm(x)), then + experts(norm(x)); also returns the layer's router stats."""

  FFN = "moe"

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=()):
    self.attn_norm = RMSNorm(cfg, dtype, rngs, stack)
    self.attn = Attention(cfg, dtype, rngs, stack)
    self.mlp_norm = RMSNorm(cfg, dtype, rngs, stack)
    self.moe = experts.Experts(cfg, dtype, rngs, stack)


class MoE(Llama):
  """Decoder-only Transformer with mixture-of-experts MLPs (the Llama interface, plus
  `hidden_and_losses`)."""

  # No 1F1B: its layers return router statistics, which no pipeline carries (refused at setup
  # with the same message as GPipe's).
  pipeline_parts = None

  def __init__(self, cfg, rngs: nnx.Rngs, param_dtype=jnp.float32, remat: str = "none",
               unroll: int = 1):
    self.cfg = cfg
    self.remat, self.unroll = remat, unroll  # the layer scan's settings
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
    zeros = {k: 0.0 for k in experts.STATS}
    (x, totals), cache_kv = scan_blocks(self.blocks, x, cache, self.remat, *layer_args,
                                        stats=zeros, unroll=self.unroll)
    x = restore(self.final_norm(x))
    return x, None if cache is None else KVCache(*cache_kv, end), totals
