"""A llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Every parameter carries logical axis names and key activations are constrained by name
(shardlab.parallel.constrain); which mesh axes those names mean is decided by the
strategy, never here. The blocks' parameters are stacked along a leading `layers` axis and
applied with the layer scan (shardlab.parallel.scan), so compile time does not grow with depth.
Shape suffixes: B batch, L length, D d_model, H heads, K kv heads, E head_dim, F mlp,
V vocab, N layers.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from shardlab import parallel
from shardlab.models import rope
from shardlab.models.decoder import ACTIVATIONS, Block, KVCache, attend, causal_mask, embed
from shardlab.models.decoder import call_block, logits, token_layout
from shardlab.models.decoder import scan_blocks
from shardlab.parallel import constrain, reduce_grads_early, stacked_param as _param
from shardlab.parallel import swiglu  # noqa: F401 (models.llama.swiglu, as before)

# Decayed by rank alone these would be: norm scales are 2-D once stacked, the table a matrix.
NO_WEIGHT_DECAY = ("scale", "embed_VxD")


class RMSNorm(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=()):
    self.scale = _param(rngs, (cfg.d_model,), ("embed",), "ones", dtype, stack)
    self.eps = cfg.norm_eps

  def __call__(self, x_BxLxD):
    return rms_norm(x_BxLxD, self.scale[...], self.eps)


# RMSNorm with its gradient written out: the backward keeps the input (compute dtype) and one
# fp32 scalar per position, where autodiff keeps fp32 copies of the input and x·rsqrt.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x_BxLxD, scale_D, eps: float):
  return _rms_norm_forward(x_BxLxD, scale_D, eps)[0]


def _rms_norm_forward(x_BxLxD, scale_D, eps):
  x = x_BxLxD.astype(jnp.float32)
  r_BxLx1 = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  y = (x * r_BxLx1 * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)
  return y, (x_BxLxD, scale_D, r_BxLx1)


def _rms_norm_backward(eps, residuals, d_y):
  x_BxLxD, scale_D, r = residuals
  n = x_BxLxD.astype(jnp.float32) * r
  d = d_y.astype(jnp.float32)
  d_scale = jnp.sum(d * n, axis=tuple(range(d.ndim - 1)))
  d_n = d * scale_D.astype(jnp.float32)
  d_x = r * (d_n - n * jnp.mean(d_n * n, axis=-1, keepdims=True))
  return d_x.astype(x_BxLxD.dtype), d_scale.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


def rope_tables(positions_BxL, head_dim: int, theta: float, inv_freq=None):
  """cos/sin of shape B×L×E in the rotate-half layout that Hugging Face Llama uses;
  `inv_freq` (E/2, models/rope.py) replaces the plain frequencies of `theta`."""
  if inv_freq is None:
    inv_freq = theta ** -(jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x_BxLxHxE):
  """Hugging Face Llama's rotate_half R, (x1, x2) → (−x2, x1); its transpose is −R."""
  half = x_BxLxHxE.shape[-1] // 2
  return jnp.concatenate([-x_BxLxHxE[..., half:], x_BxLxHxE[..., :half]], axis=-1)


# RoPE with its gradient written out, the halves swapped in x's dtype (a swap and a negation
# are exact) and only the multiply-adds in fp32: the values autodiff of the fp32 formula gives,
# bit for bit, but the TPU compiler no longer writes out and reads back fp32 halves, forward
# or backward (llama2-7b on v5e-256: 1.044 s of compute a step against 1.085;
# tests/test_rope.py).
@jax.custom_vjp
def apply_rope(x_BxLxHxE, cos_BxLxE, sin_BxLxE):
  """x rotated by the tables of `rope_tables`, whose two halves are equal (frequency i at
  i and at i + E/2): the gradient relies on it."""
  return _rope_forward(x_BxLxHxE, cos_BxLxE, sin_BxLxE)[0]


def _rope_forward(x_BxLxHxE, cos_BxLxE, sin_BxLxE):
  x, rotated = x_BxLxHxE.astype(jnp.float32), _rotate_half(x_BxLxHxE).astype(jnp.float32)
  out = x * cos_BxLxE[:, :, None, :] + rotated * sin_BxLxE[:, :, None, :]
  return out.astype(x_BxLxHxE.dtype), (x_BxLxHxE, cos_BxLxE, sin_BxLxE)


def _rope_backward(residuals, d_out):
  """out = x·cos + R(x)·sin, so d_x = d·cos + Rᵀ(d·sin) = d·cos − R(d)·sin, the table's
  halves being equal: the products and sums of autodiff's fp32 transpose. (Swapping the
  table's halves instead would cost 6 ms a step on the TPU compile above.)"""
  x_BxLxHxE, cos_BxLxE, sin_BxLxE = residuals
  d = d_out.astype(jnp.float32)
  rotated = _rotate_half(d_out).astype(jnp.float32)
  d_x = d * cos_BxLxE[:, :, None, :] - rotated * sin_BxLxE[:, :, None, :]
  # The tables' cotangents (summed over heads, and over a batch they were broadcast along);
  # nothing differentiates the tables in training, and XLA drops what nothing reads.
  d_cos = jnp.sum(d * x_BxLxHxE.astype(jnp.float32), axis=2)
  d_sin = jnp.sum(d * _rotate_half(x_BxLxHxE).astype(jnp.float32), axis=2)
  d_cos, d_sin = (jnp.sum(t, axis=0, keepdims=True) if cos_BxLxE.shape[0] == 1 else t
                  for t in (d_cos, d_sin))
  return (d_x.astype(x_BxLxHxE.dtype), d_cos.astype(cos_BxLxE.dtype),
          d_sin.astype(sin_BxLxE.dtype))


apply_rope.defvjp(_rope_forward, _rope_backward)


class Attention(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    d, h, k, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.q_DxHxE = _param(rngs, (d, h, e), ("embed", "heads", "head_dim"), d, dtype, stack)
    self.k_DxKxE = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), d, dtype, stack)
    self.v_DxKxE = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), d, dtype, stack)
    self.o_HxExD = _param(rngs, (h, e, d), ("heads", "head_dim", "embed"), h * e, dtype, stack)
    self.impl, self.exchange, self.scores = cfg.attention, cfg.kv_exchange, cfg.attention_scores
    if lora_cfg is not None:
      self.lora_q, self.lora_k, self.lora_v, self.lora_o = (
          _adapter(lora_cfg, t, getattr(self, w), dtype, lora_rngs, stack)
          for t, w in (("q", "q_DxHxE"), ("k", "k_DxKxE"), ("v", "v_DxKxE"), ("o", "o_HxExD")))

  def __call__(self, x_BxLxD, cos, sin, mask_LxM, index, doc=None, cache_kv=None):
    """Attention output (and, with `cache_kv`, this layer's updated key/value buffers).
    `doc`: (positions, segment ids) for document masks and context parallelism."""
    q, k, v = (self.project(t, x_BxLxD) for t in ("q", "k", "v"))
    out, cache_kv = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask_LxM,
                           cache_kv, index, self.impl, doc, self.exchange, scores=self.scores)
    return self.project("o", out), cache_kv

  def project(self, target: str, x):
    """One projection ("q", "k", "v" or "o") of x, with its LoRA adapter's update: the seam a
    variant overrides (a bias, a norm on q and k)."""
    return _project(self, target, x, getattr(self, LORA_WEIGHTS[target])[...])


class MLP(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    d, f = cfg.d_model, cfg.mlp_dim
    self.gate_DxF = _param(rngs, (d, f), ("embed", "mlp"), d, dtype, stack)
    self.up_DxF = _param(rngs, (d, f), ("embed", "mlp"), d, dtype, stack)
    self.down_FxD = _param(rngs, (f, d), ("mlp", "embed"), f, dtype, stack)
    if lora_cfg is not None:
      self.lora_gate, self.lora_up, self.lora_down = (
          _adapter(lora_cfg, t, getattr(self, w), dtype, lora_rngs, stack)
          for t, w in (("gate", "gate_DxF"), ("up", "up_DxF"), ("down", "down_FxD")))

  def __call__(self, x_BxLxD):
    # Each weight gradient reduced to its shard before the backward goes on below the matmul
    # that uses it: XLA would hold the whole-size sums through the attention's backward
    # (shardlab/parallel/early_grads.py; the attention's own made no difference, measured).
    x, (w_gate, w_up) = reduce_grads_early(x_BxLxD, self.gate_DxF, self.up_DxF)
    gate = _project(self, "gate", x, w_gate)
    up = _project(self, "up", x, w_up)
    h_BxLxF = constrain(swiglu(gate, up), ACTIVATIONS["mlp_hidden"])
    h_BxLxF, (w_down,) = reduce_grads_early(h_BxLxF, self.down_FxD)
    return _project(self, "down", h_BxLxF, w_down)


# LoRA (shardlab.parallel.lora_adapter): each target's projection einsum and the weight it adapts.
LORA_SPECS = {"q": "bld,dhe->blhe", "k": "bld,dke->blke", "v": "bld,dke->blke",
              "o": "blhe,hed->bld", "gate": "bld,df->blf", "up": "bld,df->blf",
              "down": "blf,fd->bld"}
LORA_WEIGHTS = {"q": "q_DxHxE", "k": "k_DxKxE", "v": "v_DxKxE", "o": "o_HxExD",
                "gate": "gate_DxF", "up": "up_DxF", "down": "down_FxD"}


# The target's projection of x (with its adapter's update, if any), and its adapter.
_project = functools.partial(parallel.lora_project_target, LORA_SPECS)
_adapter = functools.partial(parallel.lora_for_weight, LORA_SPECS)


def block(cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, attention=None) -> Block:
  """One layer (stacked over `stack`); with `lora_cfg` (a LoraConfig) its targets get
  adapters, drawn from their own stream so the base init is the same with or without.
  `attention`: the attention class (default Attention; a variant passes its subclass)."""
  extra = ({} if lora_cfg is None else
           {"lora_cfg": lora_cfg, "lora_rngs": parallel.adapter_rngs(rngs)})
  attn = (attention or Attention)(cfg, dtype, rngs, stack, **extra)
  return Block(RMSNorm(cfg, dtype, rngs, stack), attn, RMSNorm(cfg, dtype, rngs, stack),
               MLP(cfg, dtype, rngs, stack, **extra))


class Llama(nnx.Module):
  """Decoder-only Transformer. `param_dtype` is the storage dtype of the parameters;
  `lora_cfg` (a LoraConfig with rank > 0) adds adapters to its targets (parallel/lora.py);
  `remat` and `unroll` are its layer scan's settings (shardlab.parallel.scan)."""

  ATTENTION = Attention  # a variant's own attention class (a subclass overriding `project`)

  def __init__(self, cfg, rngs: nnx.Rngs, param_dtype=jnp.float32,
               remat: str = "none", lora_cfg=None, unroll: int = 1):
    self.cfg = cfg
    self.remat, self.unroll = remat, unroll
    d, v = cfg.d_model, cfg.vocab_size
    # Tied: the table is also the output projection, so it is scaled like one (logits ~ 1).
    self.embed_VxD = _param(rngs, (v, d), ("vocab", "embed"), d, param_dtype)
    self.blocks = block(cfg, param_dtype, rngs, stack=(cfg.n_layers,), lora_cfg=lora_cfg,
                        attention=self.ATTENTION)
    self.final_norm = RMSNorm(cfg, param_dtype, rngs)
    if not cfg.tie_embeddings:
      self.head_DxV = _param(rngs, (d, v), ("embed", "vocab"), d, param_dtype)

  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """fp32 logits B×L×V. Parameters are used in their stored dtype (the caller casts)."""
    return logits(self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL),
                  self.output_head())

  def hidden(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """The final-normed residual stream B×L×D, before the output projection. With
    `segment_ids_BxL` (packed documents) a token attends only within its document, and
    `positions_BxL` should restart per document (context.document_positions)."""
    return self._forward(tokens_BxL, positions_BxL, None, segment_ids_BxL)[0]

  def output_head(self):
    """The D×V output projection: the embedding table, transposed, when tied."""
    return self.embed_VxD[...].T if self.cfg.tie_embeddings else self.head_DxV[...]

  def extend(self, tokens_BxL, cache: KVCache):
    """Logits of L tokens that follow the cache's `index` tokens, and the extended cache
    (prefill with the whole prompt, then decode one token at a time)."""
    x, cache = self._forward(tokens_BxL, None, cache)
    return logits(x, self.output_head()), cache

  def pipeline_parts(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """What shardlab.parallel.pipeline_1f1b_loss runs (train.pipeline_schedule=1f1b, which
    owns the loss): the embedded tokens, the blocks and their inputs, and the head (final
    norm, output projection). Same inputs as `hidden`."""
    x, layer_args, restore, _ = self._inputs(tokens_BxL, positions_BxL, None, segment_ids_BxL)
    tied = self.cfg.tie_embeddings
    weight = self.embed_VxD if tied else self.head_DxV

    def output(head, y_BxLxD):
      norm, w = head
      return restore(norm(y_BxLxD)), w[...].T if tied else w[...]

    return parallel.PipelineParts(x, self.blocks, layer_args, call_block,
                                  (self.final_norm, weight), output, self.remat, self.unroll)

  def _forward(self, tokens_BxL, positions_BxL, cache: KVCache | None, segments_BxL=None):
    x, layer_args, restore, end = self._inputs(tokens_BxL, positions_BxL, cache, segments_BxL)
    x, cache_kv = scan_blocks(self.blocks, x, cache, self.remat, *layer_args,
                              unroll=self.unroll)
    x = restore(self.final_norm(x))
    return x, None if cache is None else KVCache(*cache_kv, end)

  def _inputs(self, tokens_BxL, positions_BxL, cache: KVCache | None, segments_BxL):
    """(embedded tokens, the layers' extra inputs, the undo of context parallelism's
    reordering, the cache index after these tokens)."""
    l = tokens_BxL.shape[1]
    tokens_BxL, positions_BxL, doc, restore, start = token_layout(
        tokens_BxL, positions_BxL, cache, segments_BxL, self.cfg.d_model)
    x = embed(self.embed_VxD[...], tokens_BxL)
    scaled = getattr(self.cfg, "rope_scaling", "none") != "none"
    cos, sin = rope_tables(positions_BxL, self.cfg.head_dim, self.cfg.rope_theta,
                           rope.inverse_frequencies(self.cfg) if scaled else None)
    mask = None if doc else causal_mask(l, cache, start)
    return x, (cos, sin, mask, start, doc), restore, start + l
