"""Shard arithmetic the planner's counts share: per-device elements and bytes of a tensor
with logical names under a rules table, on a (possibly abstract) mesh."""

import math

import jax
import jax.numpy as jnp

from shardlab.sharding import rules as rules_lib


def itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def shard_elems(shape: tuple, names: tuple, table: dict, mesh, what: str) -> int:
  """Elements per device of a tensor with logical `names` under `table` (ConfigError if a
  dim does not divide its mesh axes)."""
  spec = rules_lib.spec(names, shape, table, mesh, what)
  n = math.prod(shape)
  for axes in spec:
    for axis in (axes,) if isinstance(axes, str) else (axes or ()):
      n //= mesh.shape[axis]
  return n


def dim_shards(names: tuple, shape: tuple, dim: int, table: dict, mesh) -> int:
  """Into how many pieces `table` splits dim `dim` of a tensor with logical `names`."""
  spec = rules_lib.spec(names, shape, table, mesh, f"activation {names}")
  entry = spec[dim] if dim < len(spec) else None
  return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))


def tree_shard_bytes(abstract_tree, sharding_tree, dtype=None) -> float:
  leaves = jax.tree.leaves(jax.tree.map(
      lambda a, s: math.prod(s.shard_shape(a.shape)) * itemsize(dtype or a.dtype),
      abstract_tree, sharding_tree))
  return float(sum(leaves))
