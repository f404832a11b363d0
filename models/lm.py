"""What every bundled language model shares: the next-token loss over a B×(L+1) token batch.

A bundled LM module has `hidden(tokens_BxL) -> B×L×D` (the final-normed residual stream)
and `output_head() -> D×V`; its config keeps the contract of models/protocol.py.
A batch is the B×(L+1) token array, or a dict with `tokens` and, for packed documents,
`segment_ids` (B×(L+1), 0 for padding) and optionally `positions` (restarting per document;
derived from the segment ids when absent). Then `hidden` also takes positions and segment
ids, and a target in another document than its input (or padding) does not count.
Chat data adds `loss_mask` (B×(L+1), 1 on assistant tokens: data/chat.py): a target counts
only where the mask is 1, and the loss is the mean over the counted targets (their weights'
sum; a batch with none has loss 0 and zero gradients).
A model with `hidden_and_losses` (same inputs; returns the stream, an auxiliary loss and a
dict of metrics: models/moe.py) has its auxiliary loss added, and the loss comes back as
(loss, metrics) with the cross-entropy among the metrics.
Under train.pipeline_schedule=1f1b the schedule owns the loss: the module's optional
`pipeline_parts` (same inputs as `hidden`) hands it the embedded tokens, the layer stack and
the head (shardlab.parallel.pipeline_1f1b_loss).
"""

import inspect

import jax
import jax.numpy as jnp

from shardlab.errors import ConfigError
from shardlab.models.decoder import logits as logits_of
from shardlab.parallel import cross_entropy, document_positions
from shardlab.parallel import constrain, pipeline_1f1b_active, pipeline_1f1b_loss

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def next_token_loss(model, batch, chunk: int = 0):
  """Mean next-token cross-entropy (fp32) over the counted targets of a batch (plus the
  model's auxiliary loss, if it has one)."""
  if pipeline_1f1b_active():
    return _pipelined_loss(model, batch, chunk)
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
  # The shifted views stay whole along the sequence, as the token batch is: split there (the
  # residual stream's layout under sequence parallelism), `batch[:, 1:]` would cost a halo
  # exchange between neighbouring devices; whole, each device slices its part where used.
  whole = lambda x: None if x is None else constrain(x, ("batch", None))
  inputs, targets_BxL, weights_BxL = jax.tree.map(whole, _unpack(model, batch),
                                                  is_leaf=lambda x: x is None)
  cap = getattr(model, "final_softcap", None)
  if cap:  # the fused loss has no place for a soft-cap between the matmul and the softmax
    return _capped_cross_entropy(hidden(*inputs), model.output_head(), cap, targets_BxL,
                                 weights_BxL)
  return cross_entropy(hidden(*inputs), model.output_head(), targets_BxL, chunk, weights_BxL)


def _capped_cross_entropy(x_BxLxD, head_DxV, cap: float, targets_BxL, weights_BxL):
  """The (weighted) mean cross-entropy of cap·tanh(x·head / cap) (Gemma 2's final-logit
  soft-cap, a module's `final_softcap`): what the model is evaluated with is what it trains
  on. The fp32 B×L×V logits are whole here (no chunks, autodiff's residuals)."""
  logits = logits_of(x_BxLxD, head_DxV)
  logits = cap * jnp.tanh(logits / cap)
  target = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  nll = jax.nn.logsumexp(logits, axis=-1) - target
  if weights_BxL is None:
    return nll.mean()
  return (nll * weights_BxL).sum() / jnp.maximum(weights_BxL.sum(), 1.0)


def _unpack(model, batch):
  """(the model's inputs: tokens, and for packed documents positions and segment ids; the
  targets B×L; their weights B×L, None when every target counts)."""
  if not isinstance(batch, dict):
    return (batch[:, :-1],), batch[:, 1:], None
  extra = set(batch) - set(BATCH_KEYS)
  if extra or "tokens" not in batch:
    raise ConfigError(f"a batch dict has keys {sorted(batch)}; valid: 'tokens' (required), "
                      f"'segment_ids', 'positions', 'loss_mask'")
  mask = batch.get("loss_mask")
  if mask is not None:  # a target counts where its token is trained on (chat: assistant turns)
    inputs, targets_BxL, weights_BxL = _unpack(model, {k: v for k, v in batch.items()
                                                       if k != "loss_mask"})
    counted_BxL = mask[:, 1:].astype(jnp.float32)
    return inputs, targets_BxL, (counted_BxL if weights_BxL is None
                                 else weights_BxL * counted_BxL)
  tokens, segments = batch["tokens"], batch.get("segment_ids")
  if segments is None:
    return _unpack(model, tokens)
  if "segment_ids_BxL" not in inspect.signature(model.hidden).parameters:
    raise ConfigError(f"the batch has segment_ids (packed documents) but "
                      f"{type(model).__name__}.hidden takes none; this model cannot mask "
                      f"attention by document")
  positions = batch.get("positions")
  if positions is None:
    positions = document_positions(segments)
  counted = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
  return ((tokens[:, :-1], positions[:, :-1], segments[:, :-1]), tokens[:, 1:],
          counted.astype(jnp.float32))


def _pipelined_loss(model, batch, chunk: int):
  """The loss by the 1F1B schedule (train.pipeline_schedule=1f1b), which owns it: the model
  hands over its parts (`pipeline_parts`, shardlab.models.protocol)."""
  parts_of = getattr(model, "pipeline_parts", None)
  if parts_of is None:
    raise ConfigError(f"train.pipeline_schedule=1f1b needs the model's pipeline_parts (an "
                      f"optional member of shardlab.models.protocol), which "
                      f"{type(model).__name__} does not give; use train.pipeline_schedule="
                      f"gpipe")
  inputs, targets_BxL, weights_BxL = _unpack(model, batch)
  parts = parts_of(*inputs)
  run = lambda head_loss, targets: pipeline_1f1b_loss(
      parts.layers, parts.x, parts.head, head_loss, targets, *parts.args, call=parts.call,
      remat=parts.remat, unroll=parts.unroll)
  if weights_BxL is None:  # every microbatch counts as many targets: the mean of means
    return run(lambda head, y, t: cross_entropy(*parts.output(head, y), t, chunk),
               targets_BxL)

  # Counted targets differ between microbatches: each microbatch's loss is its weighted sum
  # over b rows with weights scaled by B / (all counted), so their mean is the batch's.
  def weighted(head, y_bxLxD, t):
    w_bxL = t["weights"]
    mean = cross_entropy(*parts.output(head, y_bxLxD), t["targets"], chunk, w_bxL)
    return mean * jnp.maximum(w_bxL.sum(), 1.0) / y_bxLxD.shape[0]

  scale = weights_BxL.shape[0] / jnp.maximum(weights_BxL.sum(), 1.0)
  return run(weighted, {"targets": targets_BxL, "weights": weights_BxL * scale})
