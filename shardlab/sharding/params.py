"""Declaring the logical axis names of a parameter.

`param(value, ("embed", "mlp"))` is `nnx.Param(value, out_sharding=names,
eager_sharding=False)`: Flax would otherwise read logical names as *mesh* axis names and try
to shard eagerly. `nnx.with_partitioning(init, names)` and `nnx.Param(v, out_sharding=names)`
work too inside shardlab (it builds modules with eager sharding off), but only there.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def param(value, names: tuple) -> nnx.Param:
  """An nnx.Param whose dims carry logical axis names (None for an unnamed dim)."""
  names = tuple(names)
  if len(names) != value.ndim:
    raise ValueError(f"param of shape {tuple(value.shape)} needs {value.ndim} logical names, "
                     f"got {names}")
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def stacked_param(rngs, shape, names, init, dtype, stack=()) -> nnx.Param:
  """A Param of `stack + shape` named `("layers",) * len(stack) + names`: one weight of a
  stack of identical layers (scanned or pipelined over the leading dims). `init`: "ones",
  "zeros", or a fan-in n for normal(0, n^-1/2) drawn from `rngs.params()`."""
  shape = tuple(stack) + tuple(shape)
  names = ("layers",) * len(stack) + tuple(names)
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = jax.random.normal(rngs.params(), shape, dtype) * init**-0.5
  return param(value, names)
