"""Activation sharding constraints by logical name.

A model only names its activations' axes (`constrain(x, ("batch", "length", "embed"))`); the
train step sets which mesh and rules table those names resolve against while it is traced.
Outside that context `constrain` is the identity, so the same module runs unsharded.
"""

import contextlib
import contextvars

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlab.sharding.rules import Rules, spec

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("shardlab_activation_rules",
                                                          default=None)
# (microbatches, repeats) of a pipeline schedule (models/pipeline.py), when the rules split
# `layers` over a mesh axis.
_PIPELINE: contextvars.ContextVar = contextvars.ContextVar("shardlab_pipeline",
                                                            default=(1, 1))
# (mesh, gradient table) while a train step that reduces gradients early is traced.
_GRADS: contextvars.ContextVar = contextvars.ContextVar("shardlab_gradient_rules", default=None)
# Layers per iteration of a layer scan (train.scan_unroll) while a step is traced.
_UNROLL: contextvars.ContextVar = contextvars.ContextVar("shardlab_scan_unroll", default=1)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules, pipeline: tuple[int, int] = (1, 1),
                     early_grads: bool = False, scan_unroll: int = 1):
  """Traces under `rules`; `pipeline` is (microbatches, repeats) for a pipelined layer scan;
  `early_grads` turns on sharding.early_grads.reduce_grads_early; `scan_unroll` is what
  `scan_unroll()` returns."""
  token = _ACTIVE.set((mesh, rules.activations))
  schedule = _PIPELINE.set(tuple(pipeline))
  grads = _GRADS.set((mesh, rules.grads) if early_grads else None)
  unroll = _UNROLL.set(scan_unroll)
  try:
    yield
  finally:
    _UNROLL.reset(unroll)
    _GRADS.reset(grads)
    _PIPELINE.reset(schedule)
    _ACTIVE.reset(token)


def pipeline_schedule() -> tuple[int, int]:
  """(microbatches, repeats) the active step gives a pipeline."""
  return _PIPELINE.get()


def scan_unroll() -> int:
  """Layers per iteration of a model's layer scan in the step being traced (1 outside one):
  the `unroll` of its lax.scan."""
  return _UNROLL.get()


def gradient_rules() -> tuple[Mesh, dict] | None:
  """(mesh, the table gradients are reduced to) when the step reduces them early, else None."""
  return _GRADS.get()


def constrain(x: jax.Array, names: tuple) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op outside `activation_rules`."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, table = active
  inside = jax.sharding.get_abstract_mesh()
  if inside.manual_axes:  # inside shard_map (a pipeline stage): the mesh as it sees it
    mesh = inside
  pspec = spec(names, x.shape, table, mesh, f"activation {names}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, pspec))


def platform() -> str:
  """The platform a step is traced for: the active mesh's (a TPU topology compiled from a
  CPU host), else JAX's default backend."""
  active = _ACTIVE.get()
  return active[0].devices.flat[0].platform if active else jax.default_backend()


def current(names: tuple, shape) -> tuple[Mesh, PartitionSpec] | None:
  """The active mesh and the PartitionSpec `names` resolve to for `shape` (None outside
  `activation_rules`): what hand-written shard_map code needs to match `constrain`."""
  active = _ACTIVE.get()
  if active is None:
    return None
  mesh, table = active
  return mesh, spec(names, shape, table, mesh, f"activation {names}")
