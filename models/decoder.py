"""Pieces every bundled decoder shares: stacked params, causal attention over an optional KV
cache, the scan over layers with remat, and the activation names they constrain.

Shape suffixes: B batch, L length, M attended length, D d_model, H heads, K kv heads, G heads
per kv head, E head_dim, N layers, S cache length.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx, struct

from shardlab.errors import ConfigError
from shardlab.models import attention, context, dot, pipeline
from shardlab.sharding.activations import constrain, pipeline_schedule, platform, scan_unroll
from shardlab.sharding.params import param

# The logical axes of every activation a decoder constrains: the one list that the model,
# generation (the KV cache) and `shardlab inspect --activations` share.
ACTIVATIONS = {
    "residual": ("batch", "residual_length", "embed"),
    "queries": ("batch", "length", "heads", "head_dim"),  # also the attention output
    "keys_values": ("batch", "length", "kv_heads", "head_dim"),
    "mlp_hidden": ("batch", "length", "mlp"),
    "logits": ("batch", "length", "vocab"),
    "kv_cache": ("layers", "batch", "length", "kv_heads", "head_dim"),
}

LAYER_INPUT = "layer_input"  # the checkpoint_name of a block's input (remat "offload")

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep weight-matmul outputs, recompute the rest (norms, activations, attention).
    "save-matmul-outputs": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Recompute like "full", but keep each layer's input in host memory instead of on the
    # device: the layers × B×L×D stack that full remat holds is what dominates at large
    # batches (MaxText's offloaded decoder_layer_input).
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host"),
}


def stacked_param(rngs: nnx.Rngs, shape, names, init: str | int, dtype, stack=()):
  """A Param of `stack + shape` named `("layers",) * len(stack) + names`. `init`: "ones",
  "zeros", or a fan-in n for normal(0, n^-1/2)."""
  shape = tuple(stack) + tuple(shape)
  names = ("layers",) * len(stack) + tuple(names)
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = jax.random.normal(rngs.params(), shape, dtype) * init**-0.5
  return param(value, names)


@struct.dataclass
class KVCache:
  """Keys and values of every layer for `index` tokens so far, in buffers of length S."""
  k_NxBxSxKxE: jax.Array
  v_NxBxSxKxE: jax.Array
  index: jax.Array  # int32 scalar: the position the next token takes

  @classmethod
  def zeros(cls, n_layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
            dtype) -> "KVCache":
    shape = (n_layers, batch, length, kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def causal_mask(length: int, cache: KVCache | None, start):
  """L×M: query i (at start + i) sees positions up to its own (all cached ones when M = S)."""
  if cache is None:
    return jnp.tril(jnp.ones((length, length), bool))
  s = cache.k_NxBxSxKxE.shape[2]
  return jnp.arange(s)[None, :] <= start + jnp.arange(length)[:, None]


def attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask_LxM, cache_kv=None, index=None,
           impl: str = "xla", doc=None, exchange: str = "all-gather"):
  """Grouped-query attention (fp32 scores and softmax). With `cache_kv` (this layer's
  B×S×K×E key and value buffers) the new keys and values are written at `index`, the
  queries attend over the buffers, and the updated buffers are returned too. Without a
  cache, `impl` (model.attention) may pick the platform's flash kernel (models/attention).
  `doc` (positions, segment ids; B×L each) masks by document and is what context
  parallelism needs (models/context; `exchange` is model.kv_exchange)."""
  dt = q_BxLxHxE.dtype
  q = constrain(q_BxLxHxE, ACTIVATIONS["queries"])
  k = constrain(k_BxLxKxE, ACTIVATIONS["keys_values"])
  v = constrain(v_BxLxKxE, ACTIVATIONS["keys_values"])
  if cache_kv is None and (doc is not None or context.split(attention.QUERIES, q.shape)):
    if doc is None:
      raise ValueError("the rules split `length` (context parallelism) but this model passes "
                       "no positions to attention; it supports neither context parallelism "
                       "nor packed documents")
    out = context.attend(q, k, v, *doc, impl=impl, exchange=exchange,
                         dense=_softmax_attention, platform=platform())
    return constrain(out, ACTIVATIONS["queries"]), None
  if cache_kv is not None:
    k, v = (constrain(jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), index,
                                                          axis=1), ACTIVATIONS["kv_cache"][1:])
            for buf, new in zip(cache_kv, (k, v)))
    cache_kv = (k, v)
  elif attention.resolve(impl, where := platform()) == "flash":
    return constrain(attention.causal(q, k, v, where), ACTIVATIONS["queries"]), None
  b, l, h, e = q.shape
  kv = k.shape[2]
  # Query head i attends with kv head i // G (the layout of HF's repeat_kv).
  q_BxLxKxGxE = q.reshape(b, l, kv, h // kv, e)
  out = _softmax_attention(q_BxLxKxGxE, k.astype(dt), v.astype(dt), mask_LxM)
  out = out.reshape(b, l, h, e)
  return constrain(out, ACTIVATIONS["queries"]), cache_kv


# Softmax attention with its gradient written out (FlashAttention's backward, unblocked):
# fp32 scores and softmax, of which only the probabilities in the compute dtype are kept for
# the backward (autodiff keeps the fp32 softmax too, and rebuilds an fp32 cotangent of it).
@jax.custom_vjp
def _softmax_attention(q_BxLxKxGxE, k_BxMxKxE, v_BxMxKxE, mask_LxM):
  return _attention_forward(q_BxLxKxGxE, k_BxMxKxE, v_BxMxKxE, mask_LxM)[0]


def _attention_forward(q, k, v, mask_LxM):
  scores = dot.einsum("blkge,bmke->bkglm", q, k, jnp.float32) * q.shape[-1]**-0.5
  scores = jnp.where(mask_LxM, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return dot.einsum("bkglm,bmke->blkge", probs, v), (q, k, v, mask_LxM, probs)


def _attention_backward(residuals, d_out):
  q, k, v, mask_LxM, probs = residuals
  d_out = d_out.astype(q.dtype)
  d_v = dot.einsum("bkglm,blkge->bmke", probs, d_out)
  d_probs = dot.einsum("blkge,bmke->bkglm", d_out, v).astype(jnp.float32)
  p = probs.astype(jnp.float32)
  d_scores = p * (d_probs - jnp.sum(p * d_probs, axis=-1, keepdims=True))
  d_scores = (d_scores * q.shape[-1]**-0.5).astype(q.dtype)
  d_q = dot.einsum("bkglm,bmke->blkge", d_scores, k)
  d_k = dot.einsum("bkglm,blkge->bmke", d_scores, q)
  return d_q, d_k, d_v, None


_softmax_attention.defvjp(_attention_forward, _attention_backward)


class Block(nnx.Module):
  """One pre-norm layer: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)). The attention takes
  the layer's extra inputs (position tables, mask, cache index, this layer's cache) and
  returns (output, updated cache)."""

  def __init__(self, attn_norm, attn, mlp_norm, mlp):
    self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

  def __call__(self, x_BxLxD, *attn_inputs):
    # Every use reads the named copy, so under remat "offload" the input itself is no
    # residual: only its host copy is.
    x_BxLxD = checkpoint_name(x_BxLxD, LAYER_INPUT)
    y, cache_kv = self.attn(self.attn_norm(x_BxLxD), *attn_inputs)
    x = x_BxLxD + y
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ACTIVATIONS["residual"]), cache_kv


def scan_blocks(blocks: nnx.Module, x_BxLxD, cache: KVCache | None, remat: str, *args):
  """Applies the stacked `blocks` layer by layer with lax.scan (compile time independent of
  depth, unless the step unrolls it: train.scan_unroll); each layer is called as
  block(x, *args, layer_kv) -> (x, layer_kv). When the rules split `layers` over a mesh axis
  (`stage`), a training forward runs the pipeline schedule (models/pipeline.py) instead; args
  leading with the batch are split into its microbatches."""
  graphdef, stacked = nnx.split(blocks)
  cache_kv = None if cache is None else (cache.k_NxBxSxKxE, cache.v_NxBxSxKxE)
  where = pipeline.stages(jax.tree.leaves(stacked)[0].shape[0])
  if cache is None and where is not None:  # the rules split `layers` over `stage`
    def stage_layer(x, layer_state, layer_args):
      return nnx.merge(graphdef, layer_state)(x, *layer_args, None)[0]

    if remat == "offload":  # XLA:CPU aborts compiling host transfers in the pipeline loop
      raise ConfigError("train.remat=offload does not run in a pipeline (layers split over "
                        "`stage`); use train.remat=full there")
    if remat != "none":
      stage_layer = jax.checkpoint(stage_layer, policy=REMAT_POLICIES[remat],
                                   prevent_cse=False)
    return pipeline.run(stage_layer, stacked, x_BxLxD, args, where,
                        *pipeline_schedule()), None

  def layer(x, inputs):
    layer_state, layer_kv = inputs
    return nnx.merge(graphdef, layer_state)(x, *args, layer_kv)

  if remat != "none":
    layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
  return jax.lax.scan(layer, x_BxLxD, (stacked, cache_kv), unroll=scan_unroll())


def logits(x_BxLxD, head_DxV):
  """fp32 logits B×L×V (fp32 accumulation of compute-dtype operands)."""
  out = dot.einsum("bld,dv->blv", x_BxLxD, head_DxV, jnp.float32)
  return constrain(out, ACTIVATIONS["logits"])


def embed(table_VxD, tokens_BxL):
  # Look rows up where the table is stored (embed-sharded under FSDP): XLA gathers the token
  # ids and trades rows with one all-to-all, and the gradient is scattered into the local
  # shard, rather than gathering the V×D table and all-reducing a V×D gradient.
  x = jnp.take(table_VxD, tokens_BxL, axis=0)
  return constrain(x, ACTIVATIONS["residual"])
