"""Tokens to their experts and back: dispatch, the experts' matmuls (SwiGLU, or the
caller's own expert function over its own weights), and the combine.

Each device routes its own tokens (T of them, K choices each: K·T assignments, the first
choices before the second). Two modes (model.dispatch):
  capacity  each expert takes at most C = ⌈capacity_factor · K·T / E⌉ of a device's
            assignments, first come first served; the rest are dropped (their output is 0;
            the residual stream carries the token on). Buffers are E×C×D: fixed shapes.
  dropless  assignments sorted by expert and run as grouped matmuls (jax.lax.ragged_dot):
            none is ever dropped.
Under expert parallelism (the rules split `experts` over a mesh axis of n devices, which
also splits the batch) the whole layer runs in jax.shard_map: each device sends every
expert's share of its tokens to the device holding that expert with one all-to-all, and the
outputs come back with a second. Capacity sends E×C×D; dropless sends, to each peer, a
buffer of K·T rows (the most any device could send one peer: XLA:CPU implements no
ragged all-to-all) and the receiver sorts what it got by expert for its grouped matmuls.
When the rules also split `mlp` (tensor), each device computes its slice of every expert's
hidden units and the outputs are summed over that axis.
An expert function `expert_fn(x, weights, matmul) -> y` computes every expert at once:
`matmul(a, w)` multiplies each row of `a` by its own expert's slice of `w` (G×In×Out, the
local experts), as an einsum over E×C×D buffers (capacity) or a ragged_dot over rows sorted
by expert (dropless); elementwise steps between matmuls act on rows the same either way.
Shape suffixes: T tokens, K experts per token, A = K·T assignments, E experts, G experts on
this device, C capacity, D d_model, F mlp (this device's share), N expert-parallel devices.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardlab.parallel.mlp import swiglu
from shardlab.sharding import activations

MODES = ("dropless", "capacity")
TOKENS = ("batch", "length", None)
WEIGHTS = (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed"))


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def swiglu_expert(x, weights, matmul):
  """The default expert: SwiGLU with (gate E×D×F, up E×D×F, down E×F×D)."""
  gate, up, down = weights
  return matmul(swiglu(matmul(x, gate), matmul(x, up)), down)


def _check_names(expert_weights, names) -> None:
  if len(names) != len(expert_weights) or expert_weights[0].ndim != 3 or any(
      len(n) != w.ndim or n[0] != "experts" for n, w in zip(names, expert_weights)):
    shapes = [tuple(w.shape) for w in expert_weights]
    raise ValueError(f"experts(..., names=) must give each expert weight's logical names, "
                     f"the experts dim first (and the first weight E×D×F: its F is what "
                     f"tensor parallelism splits); got names {tuple(names)} for weights of "
                     f"shapes {shapes}")


def run(x_BxLxD, experts_BxLxK, weights_BxLxK, expert_weights, mode: str,
        capacity_factor: float, *, expert_fn=swiglu_expert, names=WEIGHTS):
  """(output B×L×D, kept B×L×K) — kept is False for a dropped assignment. `expert_fn`
  (see the module docstring) runs the experts on `expert_weights`, whose dims have the
  logical `names`; the output is summed over the mesh axes that split the first weight's
  last dim (`mlp` under tensor parallelism), so it must be linear in that dim's slices."""
  expert_weights = tuple(expert_weights)
  _check_names(expert_weights, names)
  where = activations.current(TOKENS, x_BxLxD.shape)
  if where is None:
    return _layer(x_BxLxD, experts_BxLxK, weights_BxLxK, expert_weights, fn=expert_fn,
                  mode=mode, factor=capacity_factor, axis=None, n=1, tensor=())
  mesh, x_spec = where
  w_specs = tuple(activations.current(tuple(n), w.shape)[1]
                  for n, w in zip(names, expert_weights))
  expert_axis = _axes(w_specs[0][0] if len(w_specs[0]) else None)
  tensor = _axes(w_specs[0][2] if len(w_specs[0]) > 2 else None)
  n = math.prod(mesh.shape[a] for a in expert_axis)
  meta_spec = PartitionSpec(*x_spec[:2])

  def local(x, e, w, *weights):
    return _layer(x, e, w, weights, fn=expert_fn, mode=mode, factor=capacity_factor,
                  axis=expert_axis or None, n=n, tensor=tensor)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(x_spec, meta_spec, meta_spec, *w_specs),
                       out_specs=(x_spec, meta_spec))(
      x_BxLxD, experts_BxLxK, weights_BxLxK, *expert_weights)


def _layer(x_BxLxD, e_BxLxK, w_BxLxK, weights, *, fn, mode, factor, axis, n, tensor):
  b, l, d = x_BxLxD.shape
  k = e_BxLxK.shape[-1]
  x_TxD = x_BxLxD.reshape(b * l, d)
  e_A = e_BxLxK.reshape(b * l, k).T.reshape(-1)  # choice-major: all first choices first
  token_A = jnp.tile(jnp.arange(b * l), k)
  mlp = (weights, fn, tensor)  # what _dense_mlp and _grouped_mlp run
  if mode == "capacity":
    rows_AxD, kept_A = _capacity(x_TxD, e_A, token_A, mlp, factor, k, axis, n)
  else:
    rows_AxD, kept_A = _dropless(x_TxD, e_A, token_A, mlp, axis, n), jnp.ones_like(e_A, bool)
  w_KxT = w_BxLxK.reshape(b * l, k).T
  y_TxD = jnp.sum(rows_AxD.reshape(k, b * l, d) * w_KxT[..., None], axis=0)
  return y_TxD.reshape(b, l, d), kept_A.reshape(k, b * l).T.reshape(b, l, k)


def _exchange(buf_NxGxCxD, axis, n: int, compute):
  """Sends slot j of axis 0 to device j, computes on what arrived, and sends it home."""
  g, c, d = buf_NxGxCxD.shape[1:]
  if n > 1:
    buf_NxGxCxD = jax.lax.all_to_all(buf_NxGxCxD, axis, 0, 0, tiled=True)  # 0: source
  out = compute(buf_NxGxCxD.swapaxes(0, 1).reshape(g, n * c, d))
  out = out.reshape(g, n, c, -1).swapaxes(0, 1)
  return jax.lax.all_to_all(out, axis, 0, 0, tiled=True) if n > 1 else out


def _capacity(x_TxD, e_A, token_A, mlp, factor, k, axis, n):
  g, d = mlp[0][0].shape[0], x_TxD.shape[1]
  n_experts = n * g
  c = max(1, math.ceil(factor * x_TxD.shape[0] * k / n_experts))
  seen_AxE = jnp.cumsum(jax.nn.one_hot(e_A, n_experts, dtype=jnp.int32), axis=0)
  position_A = jnp.take_along_axis(seen_AxE, e_A[:, None], axis=1)[:, 0] - 1
  kept_A = position_A < c
  slot_A = jnp.where(kept_A, e_A * c + position_A, n_experts * c)  # out of range: dropped
  buf = jnp.zeros((n_experts * c, d), x_TxD.dtype).at[slot_A].set(x_TxD[token_A],
                                                                 mode="drop")
  out = _exchange(buf.reshape(n, g, c, d), axis, n, lambda b: _dense_mlp(b, mlp))
  rows_AxD = out.reshape(n_experts * c, d).at[slot_A].get(mode="fill", fill_value=0)
  return rows_AxD, kept_A


def _einsum(spec: str, a, b):
  # Not parallel/dot.einsum: inside shard_map a custom VJP's weight gradient would vary over
  # the token axes where the weight does not; autodiff's transpose sums it over them.
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _dense_mlp(x_GxCxD, mlp):
  weights, fn, tensor = mlp
  out = fn(x_GxCxD, weights, lambda a, w: _einsum("gci,gio->gco", a, w))
  return jax.lax.psum(out, tensor) if tensor else out


def _inverse(order_A):
  return jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0]))


def _counts(ids, n: int):
  """How many of `ids` equal each of 0..n-1 (ids >= n count nowhere)."""
  return jnp.sum(jax.nn.one_hot(ids, n, dtype=jnp.int32), axis=0)


def _grouped_mlp(rows_MxD, ids_M, mlp):
  """The expert function of each row by its expert `ids_M` (G: padding, dropped by the
  caller), its matmuls ragged_dots over the rows sorted by expert."""
  weights, fn, tensor = mlp
  order = jnp.argsort(ids_M, stable=True)
  sizes = _counts(ids_M, weights[0].shape[0])
  ragged = lambda a, w: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32
                                           ).astype(a.dtype)
  out = fn(rows_MxD[order], weights, ragged)
  out = jax.lax.psum(out, tensor) if tensor else out
  return out[_inverse(order)]


def _dropless(x_TxD, e_A, token_A, mlp, axis, n):
  g, d = mlp[0][0].shape[0], x_TxD.shape[1]
  if n == 1:
    return _grouped_mlp(x_TxD[token_A], e_A, mlp)
  a = e_A.shape[0]
  dest_A, local_A = e_A // g, e_A % g
  start_N = jnp.cumsum(_counts(dest_A, n)) - _counts(dest_A, n)
  order = jnp.argsort(dest_A, stable=True)
  pos_A = jnp.zeros_like(e_A).at[order].set(jnp.arange(a)) - start_N[dest_A]
  send = jnp.zeros((n, a, d), x_TxD.dtype).at[dest_A, pos_A].set(x_TxD[token_A])
  ids = jnp.full((n, a), g, jnp.int32).at[dest_A, pos_A].set(local_A)
  ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
  compute = lambda rows: _grouped_mlp(rows[0], ids.reshape(-1), mlp)[None]
  back = _exchange(send[:, None], axis, n, compute)[:, 0]
  return back[dest_A, pos_A]
