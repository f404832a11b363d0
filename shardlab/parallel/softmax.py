"""Dense softmax attention over a given mask (the `xla` path), with its gradient written out.

FlashAttention's backward, unblocked: fp32 scores and softmax, of which only the
probabilities in the compute dtype are kept for the backward (autodiff keeps the fp32
softmax too, and rebuilds an fp32 cotangent of it).
Shape suffixes: B batch, L length, M attended length, K kv heads, G heads per kv head,
E head_dim.
"""

import functools

import jax
import jax.numpy as jnp

import shardlab.parallel.dot as dot


def cap(scores, softcap: float | None):
  """Gemma 2's logit soft-capping, softcap · tanh(scores / softcap), on the already scaled
  scores (Hugging Face's Gemma2 eager attention: scale, then cap, then mask); the identity
  when `softcap` is None."""
  return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def cap_grad(d_capped, scores, softcap: float | None):
  """The cotangent of the uncapped scores: d/ds c·tanh(s/c) = 1 - tanh²(s/c)."""
  if softcap is None:
    return d_capped
  return d_capped * (1 - jnp.square(jnp.tanh(scores / softcap)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def softmax_attention(q_BxLxKxGxE, k_BxMxKxE, v_BxMxKxE, mask_LxM, softcap=None):
  """B×L×K×G×E: query (l, k, g) attends to the keys of kv head k that `mask_LxM` (L×M, or
  anything that broadcasts to B×K×G×L×M) lets it see; `softcap` caps the scaled scores."""
  return _forward(q_BxLxKxGxE, k_BxMxKxE, v_BxMxKxE, mask_LxM, softcap)[0]


def _scores(q, k):
  return dot.einsum("blkge,bmke->bkglm", q, k, jnp.float32) * q.shape[-1]**-0.5


def _forward(q, k, v, mask_LxM, softcap=None):
  scores = cap(_scores(q, k), softcap)
  scores = jnp.where(mask_LxM, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return dot.einsum("bkglm,bmke->blkge", probs, v), (q, k, v, mask_LxM, probs)


def _backward(softcap, residuals, d_out):
  q, k, v, mask_LxM, probs = residuals
  d_out = d_out.astype(q.dtype)
  d_v = dot.einsum("bkglm,blkge->bmke", probs, d_out)
  d_probs = dot.einsum("blkge,bmke->bkglm", d_out, v).astype(jnp.float32)
  p = probs.astype(jnp.float32)
  d_scores = p * (d_probs - jnp.sum(p * d_probs, axis=-1, keepdims=True))
  if softcap is not None:  # the scores are recomputed, not saved: one L×M array fewer
    d_scores = cap_grad(d_scores, _scores(q, k), softcap)
  d_scores = (d_scores * q.shape[-1]**-0.5).astype(q.dtype)
  d_q = dot.einsum("bkglm,bmke->blkge", d_scores, k)
  d_k = dot.einsum("bkglm,blkge->bmke", d_scores, q)
  return d_q, d_k, d_v, None


softmax_attention.defvjp(_forward, _backward)
