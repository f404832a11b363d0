"""One inference layout's figures: memory per device and the prefill and decode rooflines
(the terms are described in shardlab/plan/serving/terms.py)."""

import math

from shardlab.models import protocol
from shardlab.plan.serving import terms as inf
from shardlab.runtime import hardware

SCORE_BYTES = 10  # fp32 scores, their fp32 softmax and the compute-dtype probabilities


def _act_bytes(req: inf.Request) -> int:
  return 4 if req.weights == "fp32" else 2


def memory(req: inf.Request, model, layout: inf.Layout) -> inf.Memory:
  weights, one_layer = inf.weight_bytes(model, layout, req.weights)
  kv = inf.kv_bytes(model, layout, req.batch, req.context, req.kv_dtype)
  layer_kv = max(inf.kv_layer_bytes(model, layout, req.batch, req.context, req.kv_dtype))
  t, rows, c = layout.tensor, req.batch // layout.data, req.context
  # Both steps: the scan's new stacked cache, two of one layer's K/V buffers (the slice read
  # and the slice written; the largest layer's) and one layer's weights (the scan's slice).
  common = kv + 2 * layer_kv + one_layer
  decode = common + rows * model.vocab_size / t * 4  # fp32 logits of one position
  p = _act_bytes(req)
  pb, chunk = min(req.prefill_batch, rows), min(req.prefill_chunk, c)
  # A prefill call of pb sequences × chunk tokens: one layer's dense scores over its keys,
  # the chunk's fp32 logits (extend computes them all) and one layer's activations.
  scores = pb * model.n_heads / t * chunk * _keys(model, c, chunk) * SCORE_BYTES
  hidden = pb * chunk * (6 * model.d_model + 3 * model.mlp_dim / t) * p
  prefill = common + scores + pb * chunk * model.vocab_size / t * 4 + hidden
  return inf.Memory(weights=weights, kv_cache=kv, decode_temp=decode, prefill_temp=prefill)


def _keys(model, context: int, chunk: int) -> int:
  """The most keys a prefill chunk's queries attend over in one layer: the whole cache
  buffer; a sliding-window layer's ring and, beyond one token, the chunk's own keys
  (shardlab.parallel.attention.ring_attend)."""
  windows = protocol.get(model, "windows")
  return max(s + (chunk if w and chunk > 1 else 0)
             for w, s in zip(windows, inf.cache_lengths(model, context)))


def _all_reduce_s(nbytes: float, t: int, bw: float) -> float:
  return 0.0 if t == 1 else 2 * (t - 1) / t * nbytes / bw


def _phase(terms: dict, tokens_per_seq: float, sequences: float) -> inf.Phase:
  bound = max(terms, key=terms.get)
  step = terms[bound]
  return inf.Phase(step_s=step, bound=bound, terms=terms,
                   tokens_per_s_per_seq=tokens_per_seq / step,
                   tokens_per_s=sequences * tokens_per_seq / step)


def decode(req: inf.Request, model, acc: hardware.Accelerator, layout: inf.Layout,
           mem: inf.Memory) -> tuple[inf.Phase, float]:
  """One decode step of a replica (one token for each of its rows), the stages taking turns:
  (phase, bytes each device reads from HBM per step). Every weight the token passes (a
  mixture of experts: the active ones) and the whole cache are read — shardlab attends over
  the full buffer, masked — so this is the step at any context up to the cache's length."""
  t, s, rows = layout.tensor, layout.stage, req.batch // layout.data
  active = inf.active_params(model) / model.n_params
  read = mem.weights * active + mem.kv_cache
  flops = rows * model.flops_per_token(req.context) / 3 / (t * s)
  held = math.ceil(model.n_layers / s)
  tp = 2 * held * _all_reduce_s(rows * model.d_model * inf.ACTIVATION_BYTES, t, acc.ici_bw)
  link = acc.ici_bw if layout.n_devices <= acc.ici_domain else acc.dcn_bw
  hop = rows * model.d_model * inf.ACTIVATION_BYTES / link if s > 1 else 0.0
  terms = {"memory": s * read / acc.hbm_bw, "compute": s * flops / acc.peak_flops,
           "communication": s * (tp + hop)}
  return _phase(terms, 1.0, req.batch), read


def prefill(req: inf.Request, model, acc: hardware.Accelerator, layout: inf.Layout,
            mem: inf.Memory) -> inf.Phase:
  """Prefill of prefill_batch sequences of the whole context on a replica: their FLOPs on
  its tensor-parallel devices (stages in turn; every chunk attends over the whole cache
  buffer, masked), the weights read once per chunk and the cache written, the
  tensor-parallel all-reduces of every position."""
  t, s, rows = layout.tensor, layout.stage, req.batch // layout.data
  pb = min(req.prefill_batch, rows)
  tokens = pb * req.context
  flops = tokens * model.flops_per_token(req.context) / 3 / t
  calls = -(-req.context // req.prefill_chunk)
  written = s * (mem.weights * calls + mem.kv_cache * pb / rows)
  tp = 2 * model.n_layers * _all_reduce_s(tokens * model.d_model * inf.ACTIVATION_BYTES, t,
                                          acc.ici_bw)
  terms = {"compute": flops / acc.peak_flops, "memory": written / acc.hbm_bw,
           "communication": tp}
  return _phase(terms, req.context, pb * layout.data)


def estimate(req: inf.Request, model, acc: hardware.Accelerator,
             layout: inf.Layout) -> inf.Estimate:
  """ConfigError if the layout cannot hold the model (a dimension does not divide)."""
  mem = memory(req, model, layout)
  dec, read = decode(req, model, acc, layout, mem)
  return inf.Estimate(layout=layout, memory=mem, usable_bytes=acc.usable_bytes, decode=dec,
                      prefill=prefill(req, model, acc, layout, mem), bytes_per_decode_step=read)
