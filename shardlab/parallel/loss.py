"""The fused, chunked cross-entropy of a final hidden state against an output projection:
the logits are never kept in fp32 for the backward, and with `chunk` only one chunk's logits
exist at a time.
Shape suffixes: B batch, L length, C chunk, D d_model, V vocab.
"""

import jax
import jax.numpy as jnp

import shardlab.parallel.dot as dot
from shardlab.parallel.early_grads import reduce_grads_early
from shardlab.parallel.names import ACTIVATIONS
from shardlab.sharding.activations import constrain


def cross_entropy(x_BxLxD, head_DxV, targets_BxL, chunk: int = 0, weights_BxL=None):
  """Mean cross-entropy of the logits x·head, `chunk` positions at a time (0: all at once);
  with `weights_BxL`, the weighted mean.

  Chunks are rematerialised, so only one chunk's fp32 B×chunk×V logits are ever live —
  with a large vocabulary these dominate activation memory — at the cost of computing the
  logits twice."""
  # The head's gradient reduced before the layers' backward starts (parallel/early_grads.py).
  x_BxLxD, (head_DxV,) = reduce_grads_early(x_BxLxD, head_DxV, names=[("embed", "vocab")])
  b, l, _ = x_BxLxD.shape
  count = b * l if weights_BxL is None else jnp.maximum(weights_BxL.sum(), 1.0)
  if chunk <= 0:
    return _summed(x_BxLxD, head_DxV, targets_BxL, weights_BxL) / count
  if l % chunk:
    raise ValueError(f"loss chunk {chunk} does not divide the sequence length {l}")

  @jax.checkpoint
  def add_chunk(total, inputs):
    return total + _summed(*inputs[:1], head_DxV, *inputs[1:]), None

  split = lambda a: a.reshape(b, l // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)
  weights = None if weights_BxL is None else split(weights_BxL)
  total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32),
                          (split(x_BxLxD), split(targets_BxL), weights))
  return total / count


# The summed cross-entropy with its gradient written out. The forward keeps the softmax in the
# compute dtype, not the fp32 logits: the backward's softmax − one-hot is cast to that dtype
# for the two gradient matmuls anyway, so this halves the largest residual under bf16 and
# spares the backward a second exp over B×C×V (autodiff would also scatter a one-hot and
# carry an fp32 cotangent of that size).
@jax.custom_vjp
def _summed(x_BxCxD, head_DxV, t_BxC, w_BxC=None):
  return _summed_forward(x_BxCxD, head_DxV, t_BxC, w_BxC)[0]


def _summed_forward(x_BxCxD, head_DxV, t_BxC, w_BxC=None):
  # copies=False: an fp32 copy of the gathered V×D head (or of B×C×V logits' gradient)
  # would be the step's largest buffer.
  logits = constrain(dot.einsum("bcd,dv->bcv", x_BxCxD, head_DxV, jnp.float32, copies=False),
                     ACTIVATIONS["logits"])
  lse_BxC = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - lse_BxC[..., None]).astype(x_BxCxD.dtype)
  target = jnp.take_along_axis(logits, t_BxC[..., None], axis=-1)[..., 0]
  loss = lse_BxC - target if w_BxC is None else (lse_BxC - target) * w_BxC
  return jnp.sum(loss), (x_BxCxD, head_DxV, t_BxC, w_BxC, probs)


def _summed_backward(residuals, g):
  x_BxCxD, head_DxV, t_BxC, w_BxC, probs = residuals
  onehot = t_BxC[..., None] == jax.lax.broadcasted_iota(t_BxC.dtype, probs.shape, 2)
  if w_BxC is not None:
    g = g * w_BxC[..., None]
  d_logits = ((probs.astype(jnp.float32) - onehot) * g).astype(x_BxCxD.dtype)
  d_logits = constrain(d_logits, ACTIVATIONS["logits"])
  d_x = dot.einsum("bcv,dv->bcd", d_logits, head_DxV, copies=False)
  d_head = dot.einsum("bcd,bcv->dv", x_BxCxD, d_logits, copies=False)
  return d_x, d_head.astype(head_DxV.dtype), None, None if w_BxC is None else 0 * w_BxC


_summed.defvjp(_summed_forward, _summed_backward)
