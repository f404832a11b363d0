"""What every bundled language model shares: the next-token loss over a B×(L+1) token batch.

A bundled LM module has `hidden(tokens_BxL) -> B×L×D` (the final-normed residual stream)
and `output_head() -> D×V`; its config has the protocol described in models/__init__.py.
A batch is the B×(L+1) token array, or a dict with `tokens` and, for packed documents,
`segment_ids` (B×(L+1), 0 for padding) and optionally `positions` (restarting per document;
derived from the segment ids when absent). Then `hidden` also takes positions and segment
ids, and a target in another document than its input (or padding) does not count.
A model with `hidden_and_losses` (same inputs; returns the stream, an auxiliary loss and a
dict of metrics: models/moe.py) has its auxiliary loss added, and the loss comes back as
(loss, metrics) with the cross-entropy among the metrics.
"""

import inspect

import jax
import jax.numpy as jnp

from shardlab.errors import ConfigError
from shardlab.models import context, dot
from shardlab.models.decoder import ACTIVATIONS
from shardlab.sharding.activations import constrain
from shardlab.sharding.early_grads import reduce_grads_early

BATCH_KEYS = ("tokens", "segment_ids", "positions")


def next_token_loss(model, batch, chunk: int = 0):
  """Mean next-token cross-entropy (fp32) over the counted targets of a batch (plus the
  model's auxiliary loss, if it has one)."""
  if not hasattr(model, "hidden_and_losses"):
    return _cross_entropy_loss(model, model.hidden, batch, chunk)
  extra = []

  def hidden(*args):
    x_BxLxD, aux, metrics = model.hidden_and_losses(*args)
    extra.append((aux, metrics))
    return x_BxLxD

  loss = _cross_entropy_loss(model, hidden, batch, chunk)
  aux, metrics = extra[0]
  return loss + aux, {"cross_entropy": loss, **metrics}


def _cross_entropy_loss(model, hidden, batch, chunk: int):
  if not isinstance(batch, dict):
    x_BxLxD = hidden(batch[:, :-1])
    return cross_entropy(x_BxLxD, model.output_head(), batch[:, 1:], chunk)
  extra = set(batch) - set(BATCH_KEYS)
  if extra or "tokens" not in batch:
    raise ConfigError(f"a batch dict has keys {sorted(batch)}; valid: 'tokens' (required), "
                      f"'segment_ids', 'positions'")
  tokens, segments = batch["tokens"], batch.get("segment_ids")
  if segments is None:
    return _cross_entropy_loss(model, hidden, tokens, chunk)
  if "segment_ids_BxL" not in inspect.signature(model.hidden).parameters:
    raise ConfigError(f"the batch has segment_ids (packed documents) but "
                      f"{type(model).__name__}.hidden takes none; this model cannot mask "
                      f"attention by document")
  positions = batch.get("positions")
  if positions is None:
    positions = context.document_positions(segments)
  x_BxLxD = hidden(tokens[:, :-1], positions[:, :-1], segments[:, :-1])
  counted = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
  return cross_entropy(x_BxLxD, model.output_head(), tokens[:, 1:], chunk,
                       counted.astype(jnp.float32))


def cross_entropy(x_BxLxD, head_DxV, targets_BxL, chunk: int = 0, weights_BxL=None):
  """Mean cross-entropy of the logits x·head, `chunk` positions at a time (0: all at once);
  with `weights_BxL`, the weighted mean.

  Chunks are rematerialised, so only one chunk's fp32 B×chunk×V logits are ever live —
  with a large vocabulary these dominate activation memory — at the cost of computing the
  logits twice."""
  # The head's gradient reduced before the layers' backward starts (sharding.early_grads).
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
