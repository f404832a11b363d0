"""Context parallelism and document masks for attention.

When the rules split `length` over a mesh axis (the `context` axis, n devices), each device
holds L/n positions of every sequence for the whole model. Attention then exchanges keys and
values one of two ways (`model.kv_exchange`):
  all-gather  each device gathers the whole K/V (and positions, segments) and attends its
              queries to it; backward reduce-scatters dK/dV (MaxText's approach);
  ring        parallel/ring.py: K/V blocks travel around the ring by ppermute, one step per
              device, overlapping each block's transfer with the previous block's compute.
The sequence is laid out zig-zag (device i holds chunks i and 2n-1-i of 2n) so that causal
work is the same on every device; the model permutes its inputs into that order and its
output back (`zigzag`). Masks come from per-token positions and segment ids, so documents
packed into one row never see each other, and a sliding window (on those positions) stays
inside its document.
Shape suffixes: B batch, L length, Q local length, H heads, K kv heads, G heads per kv head,
E head_dim, D d_model.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardlab.errors import ConfigError, unknown
import shardlab.parallel.flash as flash
import shardlab.parallel.ring as ring
from shardlab.parallel.names import KEYS_VALUES, QUERIES
from shardlab.sharding import activations

KV_EXCHANGES = ("all-gather", "ring")
RESIDUAL = ("batch", "length", "embed")  # the residual stream, split as attention splits it


def check_exchange(value: str) -> str:
  if value not in KV_EXCHANGES:
    raise unknown("model.kv_exchange", value, KV_EXCHANGES)
  return value


def split(names: tuple, shape: tuple):
  """(mesh, spec, axis, n) when the active rules split dim 1 (`length`) over n > 1 devices,
  else None."""
  where = activations.current(names, shape)
  if where is None:
    return None
  mesh, spec = where
  axis = spec[1] if len(spec) > 1 else None
  if axis is None:
    return None
  axes = (axis,) if isinstance(axis, str) else axis
  return mesh, spec, axis, math.prod(mesh.shape[a] for a in axes)


def is_context_parallel(x_BxLxD_shape: tuple) -> bool:
  """Whether the step's rules split a B×L×D residual stream's length over a mesh axis."""
  return split(RESIDUAL, x_BxLxD_shape) is not None


def zigzag_order(length: int, n: int) -> np.ndarray:
  """Device i's positions: chunk i, then chunk 2n-1-i, of 2n equal chunks."""
  if length % (2 * n):
    raise ConfigError(f"train.seq_len ({length}) must be divisible by 2 × the context-parallel "
                      f"degree ({n}) for the zig-zag layout; use a multiple of {2 * n}")
  chunks = np.arange(length).reshape(2 * n, length // (2 * n))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]])
                         for i in range(n)])


def zigzag(x_BxLxD_shape: tuple, *per_token_BxL):
  """The per-token inputs (tokens, positions, segments; whole on every context device)
  permuted into the zig-zag layout, and a function that puts the model's B×L×D output back
  in order. Identity when the sequence is not split."""
  where = split(RESIDUAL, x_BxLxD_shape)
  if where is None:
    return per_token_BxL, lambda x: x
  order = zigzag_order(x_BxLxD_shape[1], where[3])
  return tuple(t[:, order] for t in per_token_BxL), lambda x: _unzigzag(x, where)


def _unzigzag(x_BxLxD, where):
  """Back to contiguous order: each device holds one even and one odd chunk; the even chunk
  c goes to device c // 2's first half, the odd one to its second half (two ppermutes)."""
  mesh, _, axis, n = where
  spec = activations.current(RESIDUAL, x_BxLxD.shape)[1]
  x_BxLxD = activations.constrain(x_BxLxD, RESIDUAL)
  chunk = lambda i, parity: i if i % 2 == parity else 2 * n - 1 - i

  def local(x):
    half = x.shape[1] // 2
    first, second = x[:, :half], x[:, half:]
    i_even = jax.lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(i_even, first, second), jnp.where(i_even, second, first)
    even = jax.lax.ppermute(even, axis, [(i, chunk(i, 0) // 2) for i in range(n)])
    odd = jax.lax.ppermute(odd, axis, [(i, chunk(i, 1) // 2) for i in range(n)])
    return jnp.concatenate([even, odd], axis=1)

  return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(x_BxLxD)


def document_positions(segments_BxL):
  """Per-token positions that restart at 0 where the segment id changes."""
  index = jnp.arange(segments_BxL.shape[1])
  starts = jnp.concatenate([jnp.ones_like(segments_BxL[:, :1], bool),
                            segments_BxL[:, 1:] != segments_BxL[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, positions_BxL, segments_BxL, *, impl: str,
           exchange: str, dense, platform: str, window: int | None = None,
           softcap: float | None = None):
  """Masked GQA attention (query i sees key j of the same segment at a position <= its
  own, and > its own - `window` when a window is given), split over the context axis when
  the rules say so. `dense(q_BxQxKxGxE, k_BxMxKxE, v_BxMxKxE, mask)` is the xla path's
  softmax (parallel/softmax.py; given `softcap=` too when one is set); flash and ring run
  ring.py."""
  blockwise = flash.resolve(impl, platform) == "flash"
  flash.check_options(window, softcap)
  opts = dict(exchange=exchange, flash=blockwise, dense=dense, window=window, softcap=softcap)
  where = split(QUERIES, q_BxLxHxE.shape)
  if where is None:
    return _local(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, positions_BxL, segments_BxL,
                  axis=None, n=1, **opts)
  mesh, q_spec, axis, n = where
  kv_spec = activations.current(KEYS_VALUES, k_BxLxKxE.shape)[1]
  meta_spec = PartitionSpec(*q_spec[:2])

  def local(q, k, v, pos, seg):
    return _local(q, k, v, pos, seg, axis=axis, n=n, **opts)

  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, meta_spec,
                                                   meta_spec), out_specs=q_spec)(
      q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, positions_BxL, segments_BxL)


def _local(q_BxQxHxE, k_BxQxKxE, v_BxQxKxE, pos_BxQ, seg_BxQ, *, axis, n: int,
           exchange: str, flash: bool, dense, window, softcap):
  b, l, h, e = q_BxQxHxE.shape
  kv = k_BxQxKxE.shape[2]
  dt = q_BxQxHxE.dtype
  k, v = k_BxQxKxE.astype(dt), v_BxQxKxE.astype(dt)
  q_BxQxKxGxE = q_BxQxHxE.reshape(b, l, kv, h // kv, e)
  k_pos, k_seg = pos_BxQ, seg_BxQ
  if n > 1 and exchange == "all-gather":
    k, v, k_pos, k_seg = (jax.lax.all_gather(x, axis, axis=1, tiled=True)
                          for x in (k, v, k_pos, k_seg))
  if not (flash or (n > 1 and exchange == "ring")):
    mask = ring.mask(pos_BxQ, seg_BxQ, k_pos, k_seg, window)
    # Given only when set, so a `dense` that knows no softcap still serves the rest.
    capped = {} if softcap is None else {"softcap": softcap}
    out = dense(q_BxQxKxGxE, k, v, mask, **capped)
    return out.reshape(b, l, h, e)
  ring_n = n if exchange == "ring" else 1
  q = q_BxQxKxGxE.transpose(0, 2, 3, 1, 4)
  blocks = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), k_pos, k_seg)
  out = ring.attention(axis, ring_n, q, blocks, (pos_BxQ, seg_BxQ), window, softcap)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, l, h, e)
