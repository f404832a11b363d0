"""Attention for any module: `attention(q, k, v)` picks the platform's path and, when the
step's rules split the sequence over a mesh axis, context parallelism.

Paths (`impl`, a model's `model.attention`): "xla" (dense softmax, fp32 scores), "flash"
(blockwise FlashAttention-2 in pure JAX on CPU, cuDNN's fused kernel on GPU, Pallas splash
attention on TPU: parallel/flash.py), "auto" (flash on TPU and GPU, xla on CPU). Packed
documents (`segment_ids`, `positions`) and context parallelism (all-gather or ring K/V
exchange: parallel/context.py) share one masked path.

Sliding windows (`window`) follow Hugging Face's Mistral / Gemma 2 convention
(transformers' masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window, on
top of the causal kv_idx <= q_idx): query i sees key j iff i - window < j <= i, so at most
`window` keys, its own included. The same convention as cuDNN's sliding_window_length and
splash's LocalMask((window - 1, 0)), and what HF checkpoints were trained with, so a
converted model sees what it saw in training. Soft-capping (`softcap`) is Gemma 2's
(HF's Gemma2 eager attention): scores scaled first, then softcap·tanh(scores / softcap),
then masked and softmaxed.

Shape suffixes: B batch, L length, M attended length, H heads, K kv heads, G heads per kv
head, E head_dim, S cache length.
"""

import functools

import jax
import jax.numpy as jnp

import shardlab.parallel.context as context
import shardlab.parallel.flash as flash
from shardlab.parallel.names import ACTIVATIONS
from shardlab.parallel.softmax import check_scores, softmax_attention
from shardlab.sharding.activations import constrain, platform


def attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, *, segment_ids=None, positions=None,
              causal: bool = True, impl: str = "auto", kv_exchange: str = "all-gather",
              window: int | None = None, softcap: float | None = None,
              scores: str = "fp32"):
  """Grouped-query attention B×L×H×E (query head i uses kv head i // G, as Hugging Face's
  repeat_kv lays them out; scores scaled by E^-0.5, softmax statistics in fp32, output in
  q's dtype). Inputs and output are constrained to the activation names `queries` and
  `keys_values` (parallel/names.py).

  `segment_ids` (B×L; packed documents) keeps each token's attention inside its document;
  `positions` (B×L) are the tokens' positions for the causal mask (restarting per document;
  derived from the segment ids when absent). Under context parallelism (the rules split
  `length` over a mesh axis) the inputs must be in the zig-zag layout that `context.zigzag`
  gives; `kv_exchange` is "all-gather" or "ring". `causal=False` (an encoder) runs the
  dense path on whole sequences only.

  `window`: a query sees at most this many keys, its own included (query i, key j:
  i - window < j <= i), on the positions, so per document. `softcap`: scores become
  softcap·tanh(scores / softcap) after the E^-0.5 scaling (Gemma 2). Every path supports
  both, except that cuDNN (flash on gpu in 16 bits) refuses `softcap` and `causal=False`
  refuses `window`. `scores`: the dense path's scores and softmax in "fp32" or in the
  inputs' dtype ("compute", MaxText's default); the flash paths keep fp32 statistics
  whatever it says (parallel/softmax.py)."""
  flash.check_options(window, softcap)
  if not causal:
    if window is not None:
      raise ValueError(f"attention window = {window!r} needs causal=True: the window is "
                       f"causal (i - window < j <= i); causal=False takes window=None")
    return _bidirectional(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids, impl, softcap,
                          scores)
  doc = None
  if segment_ids is not None or positions is not None:
    b, l = q_BxLxHxE.shape[:2]
    if segment_ids is None:
      segment_ids = jnp.ones((b, l), jnp.int32)
    if positions is None:
      positions = context.document_positions(segment_ids)
    doc = (positions, segment_ids)
  l = q_BxLxHxE.shape[1]
  mask = None if doc else jnp.tril(jnp.ones((l, l), bool))
  return attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask, impl=impl, doc=doc,
                exchange=kv_exchange, window=window, softcap=softcap, scores=scores)[0]


def _bidirectional(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, segment_ids, impl: str, softcap,
                   scores: str):
  flash.resolve(impl, platform())  # an unknown name is still an error
  q = constrain(q_BxLxHxE, ACTIVATIONS["queries"])
  if context.split(ACTIVATIONS["queries"], q.shape):
    raise ValueError("attention(causal=False) has no context-parallel path: the rules split "
                     "`length` over a mesh axis; map `length` to no mesh axis for this model")
  k = constrain(k_BxLxKxE, ACTIVATIONS["keys_values"])
  v = constrain(v_BxLxKxE, ACTIVATIONS["keys_values"])
  mask = jnp.ones((1, 1), bool)
  if segment_ids is not None:  # B×1×1×L×M: the softmax's B×K×G×L×M scores
    mask = (segment_ids[:, None, :] == segment_ids[:, :, None])[:, None, None]
  return _dense(q, k, v, mask, softcap, scores)


def _dense(q_BxLxHxE, k_BxMxKxE, v_BxMxKxE, mask, softcap=None, scores="fp32"):
  """Softmax attention of constrained inputs under `mask`, scores capped by `softcap`, in
  `scores`' dtype."""
  b, l, h, e = q_BxLxHxE.shape
  kv = k_BxMxKxE.shape[2]
  dt = q_BxLxHxE.dtype
  q_BxLxKxGxE = q_BxLxHxE.reshape(b, l, kv, h // kv, e)
  out = softmax_attention(q_BxLxKxGxE, k_BxMxKxE.astype(dt), v_BxMxKxE.astype(dt), mask,
                          softcap, scores)
  return constrain(out.reshape(b, l, h, e), ACTIVATIONS["queries"])


def attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask_LxM, cache_kv=None, index=None,
           impl: str = "xla", doc=None, exchange: str = "all-gather", *,
           window: int | None = None, softcap: float | None = None, scores: str = "fp32"):
  """`attention` for a decoder with an optional KV cache: (output, updated cache). With
  `cache_kv` (this layer's B×S×K×E key and value buffers) the new keys and values are
  written at `index`, the queries attend over the buffers under `mask_LxM` (L×S), and the
  updated buffers come back too. Without a cache, `impl` may pick the platform's flash
  kernel; `doc` (positions, segment ids; B×L each) masks by document and is what context
  parallelism needs. `window` narrows `mask_LxM` (query i at position index + i with a
  cache, i without; key j at position j) or the document mask; `softcap` as `attention`'s.
  With both a cache and a `window` the buffers are a ring (`ring_attend`): S may be as
  short as the window, and `mask_LxM` is not read. `scores` as `attention`'s."""
  flash.check_options(window, softcap)
  check_scores(scores)
  q = constrain(q_BxLxHxE, ACTIVATIONS["queries"])
  k = constrain(k_BxLxKxE, ACTIVATIONS["keys_values"])
  v = constrain(v_BxLxKxE, ACTIVATIONS["keys_values"])
  if cache_kv is not None and window is not None:
    return ring_attend(q, k, v, cache_kv, index, window, softcap, scores)
  if cache_kv is None and (doc is not None or context.split(flash.QUERIES, q.shape)):
    if doc is None:
      raise ValueError("the rules split `length` (context parallelism) but this model passes "
                       "no positions to attention; it supports neither context parallelism "
                       "nor packed documents")
    out = context.attend(q, k, v, *doc, impl=impl, exchange=exchange,
                         dense=functools.partial(_masked_softmax, scores=scores),
                         platform=platform(), window=window, softcap=softcap)
    return constrain(out, ACTIVATIONS["queries"]), None
  if cache_kv is not None:
    k, v = (constrain(jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), index,
                                                          axis=1), ACTIVATIONS["kv_cache"][1:])
            for buf, new in zip(cache_kv, (k, v)))
    cache_kv = (k, v)
  elif flash.resolve(impl, where := platform()) == "flash":
    out = flash.causal(q, k, v, where, window=window, softcap=softcap)
    return constrain(out, ACTIVATIONS["queries"]), None
  if window is not None:  # no cache here: a windowed layer's cache is a ring (above)
    mask_LxM = mask_LxM & window_mask(q.shape[1], k.shape[1], window)
  return _dense(q, k, v, mask_LxM, softcap, scores), cache_kv


def _masked_softmax(q, k, v, mask, softcap=None, *, scores: str):
  return softmax_attention(q, k, v, mask, softcap, scores)


def causal_mask(length: int, cache_length: int | None = None, start=0):
  """L×M: query i (at start + i) sees positions up to its own (M = L without a cache; all
  cached positions up to its own when M = `cache_length`)."""
  if cache_length is None:
    return jnp.tril(jnp.ones((length, length), bool))
  return jnp.arange(cache_length)[None, :] <= start + jnp.arange(length)[:, None]


def window_mask(length: int, keys: int, window: int, start=0):
  """L×M: query i (at start + i) sees key j (at j) iff start + i - window < j; and it with a
  causal mask for the sliding window."""
  return jnp.arange(keys)[None, :] > start + jnp.arange(length)[:, None] - window


def ring_positions(slots: int, index):
  """S: the position each slot of a ring buffer holds once `index` tokens were written
  (position p lives in slot p mod S, the newest S of them); negative: not written yet."""
  s = jnp.arange(slots)
  return index - 1 - (index - 1 - s) % slots


def ring_attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, cache_kv, index, window: int, softcap=None,
                scores: str = "fp32"):
  """Attention of L queries at positions index.. over a sliding-window layer's ring cache
  (B×S×K×E buffers, S >= min(window, the tokens it will hold)): (output, updated buffers).
  Queries see the keys whose positions (from `ring_positions`) are causal and in the
  window. A decode step (L = 1) writes its entry first, over the oldest one, which its
  window no longer sees. A longer chunk attends over the ring's older entries and its own
  keys together, then leaves its last min(L, S) entries in the ring, so a prompt longer
  than S needs no buffer longer than S."""
  l, slots = q_BxLxHxE.shape[1], cache_kv[0].shape[1]
  names = ACTIVATIONS["kv_cache"][1:]
  new_kv = (k_BxLxKxE, v_BxLxKxE)
  if l == 1:
    ring = tuple(constrain(jax.lax.dynamic_update_slice_in_dim(
        buf, new.astype(buf.dtype), index % slots, axis=1), names)
                 for buf, new in zip(cache_kv, new_kv))
    keys, (k, v) = ring_positions(slots, index + 1), ring
  else:
    keys = jnp.concatenate([ring_positions(slots, index), index + jnp.arange(l)])
    k, v = (jnp.concatenate([buf, new.astype(buf.dtype)], axis=1)
            for buf, new in zip(cache_kv, new_kv))
    m = min(l, slots)
    written = (index + l - m + jnp.arange(m)) % slots  # distinct slots: one scatter
    ring = tuple(constrain(buf.at[:, written].set(new[:, l - m:].astype(buf.dtype)), names)
                 for buf, new in zip(cache_kv, new_kv))
  queries = index + jnp.arange(l)[:, None]
  mask_LxM = (keys >= 0) & (keys <= queries) & (keys > queries - window)
  k = constrain(k, ACTIVATIONS["keys_values"])
  v = constrain(v, ACTIVATIONS["keys_values"])
  return _dense(q_BxLxHxE, k, v, mask_LxM, softcap, scores), ring
