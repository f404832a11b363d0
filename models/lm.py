"""What every bundled language model shares: the next-token loss over a B×(L+1) token batch.

A bundled LM module has `hidden(tokens_BxL) -> B×L×D` (the final-normed residual stream)
and `output_head() -> D×V`; its config has the protocol described in models/__init__.py.
"""

import jax
import jax.numpy as jnp

from shardlab.models import dot
from shardlab.models.decoder import ACTIVATIONS
from shardlab.sharding.activations import constrain


def next_token_loss(model, tokens_BxL1, chunk: int = 0):
  """Mean next-token cross-entropy (fp32) of a B×(L+1) token batch."""
  x_BxLxD = model.hidden(tokens_BxL1[:, :-1])
  return cross_entropy(x_BxLxD, model.output_head(), tokens_BxL1[:, 1:], chunk)


def cross_entropy(x_BxLxD, head_DxV, targets_BxL, chunk: int = 0):
  """Mean cross-entropy of the logits x·head, `chunk` positions at a time (0: all at once).

  Chunks are rematerialised, so only one chunk's fp32 B×chunk×V logits are ever live —
  with a large vocabulary these dominate activation memory — at the cost of computing the
  logits twice."""
  b, l, _ = x_BxLxD.shape
  if chunk <= 0:
    return _summed(x_BxLxD, head_DxV, targets_BxL) / (b * l)
  if l % chunk:
    raise ValueError(f"loss chunk {chunk} does not divide the sequence length {l}")

  @jax.checkpoint
  def add_chunk(total, x_and_t):
    x_BxCxD, t_BxC = x_and_t
    return total + _summed(x_BxCxD, head_DxV, t_BxC), None

  split = lambda a: a.reshape(b, l // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)
  total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32),
                          (split(x_BxLxD), split(targets_BxL)))
  return total / (b * l)


# The summed cross-entropy with its gradient written out. The forward keeps the softmax in the
# compute dtype, not the fp32 logits: the backward's softmax − one-hot is cast to that dtype
# for the two gradient matmuls anyway, so this halves the largest residual under bf16 and
# spares the backward a second exp over B×C×V (autodiff would also scatter a one-hot and
# carry an fp32 cotangent of that size).
@jax.custom_vjp
def _summed(x_BxCxD, head_DxV, t_BxC):
  return _summed_forward(x_BxCxD, head_DxV, t_BxC)[0]


def _summed_forward(x_BxCxD, head_DxV, t_BxC):
  logits = constrain(dot.einsum("bcd,dv->bcv", x_BxCxD, head_DxV, jnp.float32),
                     ACTIVATIONS["logits"])
  lse_BxC = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - lse_BxC[..., None]).astype(x_BxCxD.dtype)
  target = jnp.take_along_axis(logits, t_BxC[..., None], axis=-1)[..., 0]
  return jnp.sum(lse_BxC - target), (x_BxCxD, head_DxV, t_BxC, probs)


def _summed_backward(residuals, g):
  x_BxCxD, head_DxV, t_BxC, probs = residuals
  onehot = t_BxC[..., None] == jax.lax.broadcasted_iota(t_BxC.dtype, probs.shape, 2)
  d_logits = ((probs.astype(jnp.float32) - onehot) * g).astype(x_BxCxD.dtype)
  d_logits = constrain(d_logits, ACTIVATIONS["logits"])
  d_x = dot.einsum("bcv,dv->bcd", d_logits, head_DxV)
  d_head = dot.einsum("bcd,bcv->dv", x_BxCxD, d_logits)
  return d_x, d_head.astype(head_DxV.dtype), None


_summed.defvjp(_summed_forward, _summed_backward)
