"""Ring attention with document masks: each device keeps its queries and passes its key/value
block around the `context` ring (jax.lax.ppermute), folding each block into an online softmax
(fp32 running max, sum and output). A custom VJP saves only q, k, v, the output and the
log-sum-exp; the backward runs the ring again, the key/value gradients travelling with
their blocks and coming home after the last step.

Causal load balance: the caller lays the sequence out zig-zag (device i holds chunks i and
2n-1-i of 2n, context.zigzag), so a block from a device j < i is seen by every local query
but only through its first half, a block from j > i only by the local queries' second half:
every device computes the same n-1 half blocks and one diagonal block. Masks are explicit
(position and segment per token), so the same kernel serves documents, padding and any
layout; the skipped halves are those the zig-zag layout masks anyway.

A sliding window (`window`) is one more clause of the position mask, so it is per document
too; `softcap` caps the scaled scores (softmax.cap) in the folds and the backward.

Run it inside shard_map over `axis` (n devices), or with n = 1 anywhere (no collectives).
Shape suffixes: B batch, K kv heads, G heads per kv head, Q local queries, M keys, E head_dim.
"""

import functools

import jax
import jax.numpy as jnp

from shardlab.parallel.softmax import cap, cap_grad

F32 = jnp.float32
NEG = -1e30  # finite: a row whose keys are all masked keeps m = NEG and adds nothing
CHUNK = 512  # tile side: a fold holds CHUNK × CHUNK scores per head at a time


def mask(q_pos_BxQ, q_seg_BxQ, k_pos_BxM, k_seg_BxM, window: int | None = None):
  """B×1×1×Q×M: a key is seen by a query of the same segment at the same or a later
  position (causal within each document) and, with a `window`, fewer than `window`
  positions earlier (Hugging Face's sliding window: q - window < k <= q)."""
  seen = ((k_pos_BxM[:, None, :] <= q_pos_BxQ[:, :, None]) &
          (k_seg_BxM[:, None, :] == q_seg_BxQ[:, :, None]))
  if window is not None:
    seen &= k_pos_BxM[:, None, :] > q_pos_BxQ[:, :, None] - window
  return seen[:, None, None]


def _in_loop(q_meta, k_pos, k_seg, carry):
  """(q positions, q segments, k positions, k segments) tied to the loop's carry: XLA would
  otherwise hoist every tile's mask out of the loops and build them all at once (a
  B×Q×M bool per tile pair: 64 MiB for one 8192-token row on two devices)."""
  return jax.lax.optimization_barrier((*q_meta, k_pos, k_seg, carry))[:4]


def _scores(q, k, seen, softcap=None):
  """The masked (capped) scores and the uncapped ones, which the cap's gradient needs."""
  raw = jnp.einsum("bkgqe,bkme->bkgqm", q, k, preferred_element_type=F32) * q.shape[-1]**-0.5
  return jnp.where(seen, cap(raw, softcap), NEG), raw


def _size(length: int) -> int:
  return CHUNK if length % CHUNK == 0 else length


def _split(x, axis: int, c: int):
  """Axis `axis` cut into chunks of c, the chunk index leading (what lax.scan walks)."""
  x = x.reshape(*x.shape[:axis], x.shape[axis] // c, c, *x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _merge(x, axis: int):
  """_split's inverse."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _chunks(kv):
  """A block's keys, values, positions and segments in chunks of at most CHUNK keys."""
  c = _size(kv[0].shape[2])
  return (_split(kv[0], 2, c), _split(kv[1], 2, c), _split(kv[2], 1, c), _split(kv[3], 1, c))


def _fold(carry, q, kv, q_meta, window, softcap):
  """The block's keys into the running (max, sum, unnormalised output), in tiles of at most
  CHUNK queries × CHUNK keys."""

  def keys(carry, q, q_meta):
    def chunk(carry, kv_c):
      k, v, k_pos, k_seg = kv_c
      m, total, acc = carry
      seen = mask(*_in_loop(q_meta, k_pos, k_seg, m), window)
      s = _scores(q, k, seen, softcap)[0]
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqm,bkme->bkgqe", p.astype(v.dtype), v, preferred_element_type=F32)
      return (m_new, total * alpha + p.sum(-1), acc * alpha[..., None] + pv), None

    return jax.lax.scan(chunk, carry, _chunks(kv))[0]

  c = _size(q.shape[3])
  rows = (tuple(_split(x, 3, c) for x in carry), _split(q, 3, c),
          tuple(_split(x, 1, c) for x in q_meta))
  return tuple(_merge(x, 3) for x in jax.lax.map(lambda r: keys(*r), rows))


def _pair_grads(q, do, lse, delta, kv, q_meta, window, softcap):
  """(dq, dk, dv) in fp32 of the local query rows against one block, tile by tile."""

  def tile(dq, q, do, lse, delta, q_meta, kv_c):
    k, v, k_pos, k_seg = kv_c
    seen = mask(*_in_loop(q_meta, k_pos, k_seg, dq), window)
    s, raw = _scores(q, k, seen, softcap)
    p = jnp.where(seen, jnp.exp(s - lse[..., None]), 0.0)
    dp = jnp.einsum("bkgqe,bkme->bkgqm", do, v, preferred_element_type=F32)
    ds = cap_grad(p * (dp - delta[..., None]), raw, softcap)  # through the cap, if any
    ds = (ds * q.shape[-1]**-0.5).astype(q.dtype)
    dv = jnp.einsum("bkgqm,bkgqe->bkme", p.astype(q.dtype), do, preferred_element_type=F32)
    dk = jnp.einsum("bkgqm,bkgqe->bkme", ds, q, preferred_element_type=F32)
    return dq + jnp.einsum("bkgqm,bkme->bkgqe", ds, k, preferred_element_type=F32), (dk, dv)

  def rows(dkv, r):
    q, do, lse, delta, q_meta = r
    dq, (dk, dv) = jax.lax.scan(lambda dq, kv_c: tile(dq, q, do, lse, delta, q_meta, kv_c),
                                jnp.zeros_like(q, F32), _chunks(kv))
    return (dkv[0] + _merge(dk, 2), dkv[1] + _merge(dv, 2)), dq

  c = _size(q.shape[3])
  split_rows = tuple(_split(x, 3, c) for x in (q, do, lse, delta)) + (
      tuple(_split(x, 1, c) for x in q_meta),)
  zeros = (jnp.zeros_like(kv[0], F32), jnp.zeros_like(kv[1], F32))
  (dk, dv), dq = jax.lax.scan(rows, zeros, split_rows)
  return _merge(dq, 3), dk, dv


def _rows(x, lo, hi, axis):
  return jax.lax.slice_in_dim(x, lo, hi, axis=axis)


def _visible_half(i, j, q_len: int, k_len: int, fn):
  """fn(query rows, key rows) on the half of a block pair the zig-zag layout leaves
  visible: every query × the keys' first half when the block comes from a device j < i,
  else the queries' second half × every key."""
  return jax.lax.cond(j < i, lambda: fn((0, q_len), (0, k_len // 2)),
                      lambda: fn((q_len // 2, q_len), (0, k_len)))


def _permute(tree, axis, n: int):
  return jax.lax.ppermute(tree, axis, [(d, (d + 1) % n) for d in range(n)])


def _slice_kv(kv, ks):
  return tuple(_rows(x, *ks, 2) for x in kv[:2]) + tuple(_rows(x, *ks, 1) for x in kv[2:])


def _forward(axis, n: int, window, softcap, q, kv, q_meta):
  """Output (q's dtype) and fp32 log-sum-exp of local queries over the ring's blocks."""
  # zeros_like: the carry varies over the mesh axes q does (shard_map's scan checks it).
  zeros = jnp.zeros_like(q, F32)
  carry = (zeros[..., 0] + NEG, zeros[..., 0], zeros)
  i = jax.lax.axis_index(axis) if n > 1 else 0
  for s in range(n):
    nxt = _permute(kv, axis, n) if s < n - 1 else None  # in flight while this block folds
    if s == 0:
      carry = _fold(carry, q, kv, q_meta, window, softcap)
    else:
      carry = _fold_half(carry, i, (i - s) % n, q, kv, q_meta, window, softcap)
    kv = nxt
  m, total, acc = carry
  return (acc / total[..., None]).astype(q.dtype), m + jnp.log(total)


def _fold_half(carry, i, j, q, kv, q_meta, window, softcap):
  def fn(qs, ks):
    part = tuple(_rows(c, *qs, 3) for c in carry)
    new = _fold(part, _rows(q, *qs, 3), _slice_kv(kv, ks),
                tuple(_rows(x, *qs, 1) for x in q_meta), window, softcap)
    return tuple(jax.lax.dynamic_update_slice_in_dim(c, x, qs[0], 3)
                 for c, x in zip(carry, new))

  return _visible_half(i, j, q.shape[3], kv[0].shape[2], fn)


def attention(axis, n: int, q_BxKxGxQxE, kv, q_meta, window: int | None = None,
              softcap: float | None = None):
  """Attention of local queries over all n blocks of the ring. `kv`: (k B×K×M×E,
  v B×K×M×E, key positions B×M, key segments B×M), this device's block; `q_meta`: the
  queries' (positions, segments), B×Q; `window`, `softcap`: as `mask` and softmax.cap."""
  return _attention(axis, n, window, softcap, q_BxKxGxQxE, kv, q_meta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(axis, n: int, window, softcap, q_BxKxGxQxE, kv, q_meta):
  return _forward(axis, n, window, softcap, q_BxKxGxQxE, kv, q_meta)[0]


def _attention_fwd(axis, n, window, softcap, q, kv, q_meta):
  out, lse = _forward(axis, n, window, softcap, q, kv, q_meta)
  return out, (q, kv, q_meta, out, lse)


def _grads_half(grads, i, j, saved, kv, q_meta, window, softcap):
  dq, dk, dv = grads

  def fn(qs, ks):
    part = [_rows(x, *qs, 3) for x in saved]
    g_q, g_k, g_v = _pair_grads(*part, _slice_kv(kv, ks),
                                tuple(_rows(x, *qs, 1) for x in q_meta), window, softcap)
    add = lambda full, x, lo, axis: jax.lax.dynamic_update_slice_in_dim(
        full, _rows(full, lo, lo + x.shape[axis], axis) + x, lo, axis)
    return add(dq, g_q, qs[0], 3), add(dk, g_k, ks[0], 2), add(dv, g_v, ks[0], 2)

  return _visible_half(i, j, saved[0].shape[3], kv[0].shape[2], fn)


def _attention_bwd(axis, n, window, softcap, residuals, do):
  """The ring again: dq stays, each block's dk, dv travel with it and come home last."""
  q, kv, q_meta, out, lse = residuals
  do = do.astype(q.dtype)
  delta = jnp.sum(do.astype(F32) * out.astype(F32), -1)
  saved = (q, do, lse, delta)
  i = jax.lax.axis_index(axis) if n > 1 else 0
  k, v = kv[:2]
  dq, dk, dv = _pair_grads(*saved, kv, q_meta, window, softcap)
  for s in range(1, n):
    kv, (dk, dv) = _permute((kv, (dk, dv)), axis, n)
    dq, dk, dv = _grads_half((dq, dk, dv), i, (i - s) % n, saved, kv, q_meta, window, softcap)
  if n > 1:
    dk, dv = _permute((dk, dv), axis, n)
  zeros = tuple(jnp.zeros(x.shape, jax.dtypes.float0) for x in kv[2:])
  no_meta = tuple(jnp.zeros(x.shape, jax.dtypes.float0) for x in q_meta)
  return dq.astype(q.dtype), (dk.astype(k.dtype), dv.astype(v.dtype), *zeros), no_meta


_attention.defvjp(_attention_fwd, _attention_bwd)
