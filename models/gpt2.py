"""A GPT-2-family decoder in Flax NNX: learned positions, pre-LayerNorm blocks with biases,
multi-head attention, a GELU (tanh) MLP, and the output head tied to the token embedding.

Parameters are stacked over `layers` and scanned like the llama model's (shardlab.parallel.scan);
the layout matches Hugging Face's GPT2LMHeadModel tensor for tensor (c_attn split into q, k, v).
LoRA adapts q, k, v, o and the MLP's up (fc) and down (proj) projections, as llama's does.
Shape suffixes: B batch, L length, P positions, D d_model, H heads, E head_dim, F mlp, V vocab.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from shardlab import parallel
from shardlab.models.decoder import ACTIVATIONS, Block, KVCache, attend, causal_mask, embed
from shardlab.models.decoder import call_block, logits
from shardlab.models.decoder import scan_blocks
from shardlab.parallel import constrain, reduce_grads_early, stacked_param as _param

# Rank alone would decay these matrices: a stacked norm's scale and bias, and both tables.
NO_WEIGHT_DECAY = ("scale", "bias", "wte_VxD", "wpe_PxD")


class LayerNorm(nnx.Module):

  def __init__(self, cfg, dtype, stack=()):
    self.scale = _param(None, (cfg.d_model,), ("embed",), "ones", dtype, stack)
    self.bias = _param(None, (cfg.d_model,), ("embed",), "zeros", dtype, stack)
    self.eps = cfg.norm_eps

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(var + self.eps)
    x = x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return x.astype(x_BxLxD.dtype)


class Attention(nnx.Module):

  BIASES = {"q": "q_bias_HxE", "k": "k_bias_HxE", "v": "v_bias_HxE", "o": "o_bias_D"}

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    d, h, e = cfg.d_model, cfg.n_heads, cfg.head_dim
    qkv = ("embed", "heads", "head_dim")
    self.q_DxHxE = _param(rngs, (d, h, e), qkv, d, dtype, stack)
    self.k_DxHxE = _param(rngs, (d, h, e), qkv, d, dtype, stack)
    self.v_DxHxE = _param(rngs, (d, h, e), qkv, d, dtype, stack)
    self.q_bias_HxE = _param(rngs, (h, e), qkv[1:], "zeros", dtype, stack)
    self.k_bias_HxE = _param(rngs, (h, e), qkv[1:], "zeros", dtype, stack)
    self.v_bias_HxE = _param(rngs, (h, e), qkv[1:], "zeros", dtype, stack)
    # GPT-2 scales the residual projections by 1/sqrt(2·layers) at init.
    fan_in = h * e * 2 * cfg.n_layers
    self.o_HxExD = _param(rngs, (h, e, d), ("heads", "head_dim", "embed"), fan_in, dtype, stack)
    self.o_bias_D = _param(rngs, (d,), ("embed",), "zeros", dtype, stack)
    self.impl, self.scores = cfg.attention, cfg.attention_scores
    if lora_cfg is not None:
      self.lora_q, self.lora_k, self.lora_v, self.lora_o = (
          _adapter(lora_cfg, t, getattr(self, LORA_WEIGHTS[t]), dtype, lora_rngs, stack)
          for t in ("q", "k", "v", "o"))

  def __call__(self, x_BxLxD, mask_LxM, index, cache_kv=None):
    q, k, v = (self.project(t, x_BxLxD) for t in ("q", "k", "v"))
    out, cache_kv = attend(q, k, v, mask_LxM, cache_kv, index, self.impl, scores=self.scores)
    return self.project("o", out), cache_kv

  def project(self, target: str, x):
    """One projection ("q", "k", "v" or "o") of x with its bias and its adapter's update."""
    bias = getattr(self, self.BIASES[target])[...]
    return _project(self, target, x, getattr(self, LORA_WEIGHTS[target])[...]) + bias


class MLP(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    d, f = cfg.d_model, cfg.mlp_dim
    self.fc_DxF = _param(rngs, (d, f), ("embed", "mlp"), d, dtype, stack)
    self.fc_bias_F = _param(rngs, (f,), ("mlp",), "zeros", dtype, stack)
    self.proj_FxD = _param(rngs, (f, d), ("mlp", "embed"), f * 2 * cfg.n_layers, dtype, stack)
    self.proj_bias_D = _param(rngs, (d,), ("embed",), "zeros", dtype, stack)
    if lora_cfg is not None:
      self.lora_up, self.lora_down = (
          _adapter(lora_cfg, t, getattr(self, LORA_WEIGHTS[t]), dtype, lora_rngs, stack)
          for t in ("up", "down"))

  def __call__(self, x_BxLxD):
    # As Llama's MLP: each weight gradient reduced before the backward goes on below it.
    x, (w_fc,) = reduce_grads_early(x_BxLxD, self.fc_DxF)
    h = _project(self, "up", x, w_fc) + self.fc_bias_F[...]
    h_BxLxF = constrain(jax.nn.gelu(h, approximate=True), ACTIVATIONS["mlp_hidden"])
    h_BxLxF, (w_proj,) = reduce_grads_early(h_BxLxF, self.proj_FxD)
    return _project(self, "down", h_BxLxF, w_proj) + self.proj_bias_D[...]


# LoRA (shardlab.parallel.lora_adapter): each target's projection einsum and the weight it
# adapts. Targets are named by role as llama's are: c_fc is the MLP's up, c_proj its down.
LORA_SPECS = {"q": "bld,dhe->blhe", "k": "bld,dhe->blhe", "v": "bld,dhe->blhe",
              "o": "blhe,hed->bld", "up": "bld,df->blf", "down": "blf,fd->bld"}
LORA_WEIGHTS = {"q": "q_DxHxE", "k": "k_DxHxE", "v": "v_DxHxE", "o": "o_HxExD",
                "up": "fc_DxF", "down": "proj_FxD"}


# The target's projection of x (with its adapter's update, if any), and its adapter.
_project = functools.partial(parallel.lora_project_target, LORA_SPECS)
_adapter = functools.partial(parallel.lora_for_weight, LORA_SPECS)


def block(cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None) -> Block:
  """One layer (stacked over `stack`); with `lora_cfg` (a LoraConfig) its targets get
  adapters, drawn from their own stream so the base init is the same with or without."""
  extra = ({} if lora_cfg is None else
           {"lora_cfg": lora_cfg, "lora_rngs": parallel.adapter_rngs(rngs)})
  return Block(LayerNorm(cfg, dtype, stack), Attention(cfg, dtype, rngs, stack, **extra),
               LayerNorm(cfg, dtype, stack), MLP(cfg, dtype, rngs, stack, **extra))


class GPT2(nnx.Module):
  """GPT-2 language model. `param_dtype` is the storage dtype of the parameters;
  `lora_cfg` (a LoraConfig with rank > 0) adds adapters to its targets (parallel/lora.py)."""

  def __init__(self, cfg, rngs: nnx.Rngs, param_dtype=jnp.float32,
               remat: str = "none", lora_cfg=None, unroll: int = 1):
    self.cfg = cfg
    self.remat, self.unroll = remat, unroll  # the layer scan's settings
    d = cfg.d_model
    self.wte_VxD = _param(rngs, (cfg.vocab_size, d), ("vocab", "embed"), d, param_dtype)
    self.wpe_PxD = _param(rngs, (cfg.max_seq_len, d), (None, "embed"), 10_000, param_dtype)
    self.blocks = block(cfg, param_dtype, rngs, stack=(cfg.n_layers,), lora_cfg=lora_cfg)
    self.final_norm = LayerNorm(cfg, param_dtype)

  def __call__(self, tokens_BxL):
    """fp32 logits B×L×V. Parameters are used in their stored dtype (the caller casts)."""
    return logits(self.hidden(tokens_BxL), self.output_head())

  def hidden(self, tokens_BxL):
    """The final-normed residual stream B×L×D, before the output projection."""
    return self._forward(tokens_BxL, None)[0]

  def output_head(self):
    return self.wte_VxD[...].T

  def extend(self, tokens_BxL, cache: KVCache):
    """Logits of L tokens that follow the cache's `index` tokens, and the extended cache."""
    x, cache = self._forward(tokens_BxL, cache)
    return logits(x, self.output_head()), cache

  def pipeline_parts(self, tokens_BxL):
    """What shardlab.parallel.pipeline_1f1b_loss runs (train.pipeline_schedule=1f1b): the
    embedded tokens and positions, the blocks and their inputs, the head (final norm, the
    tied output projection)."""
    x = self._embed(tokens_BxL, 0)
    args = (causal_mask(tokens_BxL.shape[1], None, 0), 0)
    output = lambda head, y_BxLxD: (head[0](y_BxLxD), head[1][...].T)
    return parallel.PipelineParts(x, self.blocks, args, call_block,
                                  (self.final_norm, self.wte_VxD), output, self.remat,
                                  self.unroll)

  def _embed(self, tokens_BxL, start):
    positions_L = jax.lax.dynamic_slice_in_dim(self.wpe_PxD[...], start, tokens_BxL.shape[1])
    return embed(self.wte_VxD[...], tokens_BxL) + positions_L[None]

  def _forward(self, tokens_BxL, cache: KVCache | None):
    l = tokens_BxL.shape[1]
    start = 0 if cache is None else cache.index
    x = self._embed(tokens_BxL, start)
    x, cache_kv = scan_blocks(self.blocks, x, cache, self.remat, causal_mask(l, cache, start),
                              start, unroll=self.unroll)
    x = self.final_norm(x)
    return x, None if cache is None else KVCache(*cache_kv, start + l)
