"""Reducing weight gradients where they are made, before the backward moves on below them.

Under FSDP a weight's gradient starts as a whole-size partial sum on every device and ends as
a reduced shard. XLA is free to reduce late — it combines reductions and places them near
their consumers — and then holds the whole-size sums through the rest of the backward: in a
rematerialised layer the MLP's (3 × D×F) through the attention's backward, beside its
B·H·L² buffers; in the loss, the D×V head's through the whole layer stack's backward.
llama2-7b on v5e-256 (plain attention): 3.39 GiB a chip with late reductions, 2.54 with the
bundled models' MLPs and head reducing early (docs/performance.md).

`x, (w1, w2) = reduce_grads_early(x, param1, param2)` is the identity on `x` and the
weights' values in the forward; use the returned values in the matmuls that read `x`. In the
backward it constrains their gradients to the shards of the step's gradient table and
releases `x`'s gradient only together with them (an optimization barrier), so the backward
below `x` starts after the reduction; that can still overlap the matmul making `x`'s
gradient. A frozen weight (LoRA's base) is left out, so its gradient is never computed.

It is the identity outside a train step, inside a pipeline stage (shard_map: the pipeline
reduces its own gradients) and with `train.early_grad_reduce=false`.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import SymbolicZero
from jax.sharding import NamedSharding

from shardlab.sharding import activations
from shardlab.sharding.rules import spec


def reduce_grads_early(x: jax.Array, *weights, names=None) -> tuple[jax.Array, tuple]:
  """(x, the weights' values), unchanged; use those in place of the weights. `weights`:
  nnx.Params, whose logical names are read, or arrays with `names` (one tuple each)."""
  values = tuple(w[...] if isinstance(w, nnx.Variable) else w for w in weights)
  active = _rules()
  if active is None:
    return x, values
  if names is None:
    names = [_names(w) for w in weights]
  mesh, table = active
  shardings = tuple(NamedSharding(mesh, spec(tuple(n), v.shape, table, mesh, f"gradient {n}"))
                    for v, n in zip(values, names))
  return _tie(shardings, x, values)


def _names(variable: nnx.Variable) -> tuple:
  ndim = jnp.ndim(variable[...])
  names = tuple(variable.get_metadata().get("out_sharding") or (None,) * ndim)
  return names[len(names) - ndim:]  # a layer's slice of a stacked param: drop the stack's


def _rules():
  active = activations.gradient_rules()
  if active is None or jax.sharding.get_abstract_mesh().manual_axes:
    return None
  return active


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tie(shardings, x, weights):
  del shardings
  return x, weights


def _tie_forward(shardings, x, weights):
  del shardings
  # Which weights are trained, as the residuals' structure: a frozen weight's gradient stays
  # out of the barrier, so XLA drops its matmul.
  trained = tuple(() if w.perturbed else None for w in weights)
  return (x.value, tuple(w.value for w in weights)), trained


def _tie_backward(shardings, trained, cotangents):
  d_x, d_weights = cotangents
  d_weights = tuple(
      None if t is None or isinstance(d, SymbolicZero)
      else jax.lax.with_sharding_constraint(d, s)
      for d, s, t in zip(d_weights, shardings, trained))
  if isinstance(d_x, SymbolicZero):
    return None, d_weights
  return jax.lax.optimization_barrier((d_x, d_weights))


_tie.defvjp(_tie_forward, _tie_backward, symbolic_zeros=True)
