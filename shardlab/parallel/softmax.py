"""Dense softmax attention over a given mask (the `xla` path), with its gradient written out.

FlashAttention's backward, unblocked: fp32 scores and softmax, of which only the
probabilities in the compute dtype are kept for the backward (autodiff keeps the fp32
softmax too, and rebuilds an fp32 cotangent of it). `scores="compute"` keeps the scores, the
softmax and their gradients in the inputs' dtype instead, as MaxText does by default
(`float32_qk_product=False`, `float32_logits=False`): less HBM traffic and memory, at bf16's
8 bits of mantissa in the probabilities' normaliser.
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


SCORES = ("fp32", "compute")  # a model's attention_scores


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def softmax_attention(q_BxLxKxGxE, k_BxMxKxE, v_BxMxKxE, mask_LxM, softcap=None,
                      scores="fp32"):
  """B×L×K×G×E: query (l, k, g) attends to the keys of kv head k that `mask_LxM` (L×M, or
  anything that broadcasts to B×K×G×L×M) lets it see; `softcap` caps the scaled scores;
  `scores`: "fp32" or "compute" (the inputs' dtype), the scores' and softmax's dtype."""
  return _forward(q_BxLxKxGxE, k_BxMxKxE, v_BxMxKxE, mask_LxM, softcap, scores)[0]


def check_scores(scores: str) -> None:
  if scores not in SCORES:
    raise ValueError(f"attention scores {scores!r}; valid: {', '.join(SCORES)}")


def _dtype(q, scores: str):
  check_scores(scores)
  return jnp.float32 if scores == "fp32" else q.dtype


def _scores(q, k, scores: str):
  dt = _dtype(q, scores)
  return dot.einsum("blkge,bmke->bkglm", q, k, dt) * jnp.asarray(q.shape[-1]**-0.5, dt)


def _forward(q, k, v, mask_LxM, softcap=None, scores="fp32"):
  s = cap(_scores(q, k, scores), softcap)
  s = jnp.where(mask_LxM, s, jnp.finfo(s.dtype).min)
  probs = jax.nn.softmax(s, axis=-1).astype(q.dtype)
  return dot.einsum("bkglm,bmke->blkge", probs, v), (q, k, v, mask_LxM, probs)


def _backward(softcap, scores, residuals, d_out):
  q, k, v, mask_LxM, probs = residuals
  dt = _dtype(q, scores)
  d_out = d_out.astype(q.dtype)
  d_v = dot.einsum("bkglm,blkge->bmke", probs, d_out)
  d_probs = dot.einsum("blkge,bmke->bkglm", d_out, v).astype(dt)
  p = probs.astype(dt)
  d_scores = p * (d_probs - jnp.sum(p * d_probs, axis=-1, keepdims=True))
  if softcap is not None:  # the scores are recomputed, not saved: one L×M array fewer
    d_scores = cap_grad(d_scores, _scores(q, k, scores), softcap)
  d_scores = (d_scores * jnp.asarray(q.shape[-1]**-0.5, dt)).astype(q.dtype)
  d_q = dot.einsum("bkglm,bmke->blkge", d_scores, k)
  d_k = dot.einsum("bkglm,blkge->bmke", d_scores, q)
  return d_q, d_k, d_v, None


softmax_attention.defvjp(_forward, _backward)
