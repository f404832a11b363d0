"""Activation sharding constraints by logical name, and the one step context they read.

A model only names its activations' axes (`constrain(x, ("batch", "length", "embed"))`); the
train step sets which mesh and rules table those names resolve against while it is traced,
together with the step's other settings that traced code reads (the pipeline schedule,
early gradient reduction): one frozen `StepContext`. The layer scan's own settings (remat,
unroll) are not among them: the model that owns the stack is given those when it is built.
Outside that context `constrain` is the identity, so the same module runs unsharded.
"""

import contextlib
import contextvars
import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlab.sharding.rules import Rules, spec


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What a step being traced tells the building blocks in shardlab.parallel."""
  mesh: Mesh
  rules: Rules
  # (microbatches, repeats) of a pipeline schedule (shardlab.parallel.pipeline), used when
  # the rules split `layers` over a mesh axis.
  pipeline: tuple[int, int] = (1, 1)
  # Gradients reduced where the model asks (shardlab.parallel.early_grads).
  early_grads: bool = False
  # Which schedule that pipeline runs: "gpipe" (circular with repeats > 1) through the layer
  # scan, or "1f1b", which owns the loss (shardlab.parallel.pipeline_1f1b_loss).
  schedule: str = "gpipe"


_STEP: contextvars.ContextVar = contextvars.ContextVar("shardlab_step", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules, pipeline: tuple[int, int] = (1, 1),
                     early_grads: bool = False, *, schedule: str = "gpipe"):
  """Traces under `rules` on `mesh`, with the step's other settings (see StepContext)."""
  token = _STEP.set(StepContext(mesh, rules, tuple(pipeline), bool(early_grads), schedule))
  try:
    yield
  finally:
    _STEP.reset(token)


def step_context() -> StepContext | None:
  """The step being traced (None outside one)."""
  return _STEP.get()


def pipeline_schedule() -> tuple[int, int]:
  """(microbatches, repeats) the active step gives a pipeline."""
  active = _STEP.get()
  return (1, 1) if active is None else active.pipeline


def gradient_rules() -> tuple[Mesh, dict] | None:
  """(mesh, the table gradients are reduced to) when the step reduces them early, else None."""
  active = _STEP.get()
  if active is None or not active.early_grads:
    return None
  return active.mesh, active.rules.grads


def constrain(x: jax.Array, names: tuple) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op outside `activation_rules`."""
  active = _STEP.get()
  if active is None:
    return x
  mesh = active.mesh
  inside = jax.sharding.get_abstract_mesh()
  if inside.manual_axes:  # inside shard_map (a pipeline stage): the mesh as it sees it
    mesh = inside
  pspec = spec(names, x.shape, active.rules.activations, mesh, f"activation {names}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, pspec))


def platform() -> str:
  """The platform a step is traced for: the active mesh's (a TPU topology compiled from a
  CPU host), else JAX's default backend."""
  active = _STEP.get()
  return active.mesh.devices.flat[0].platform if active else jax.default_backend()


def current(names: tuple, shape) -> tuple[Mesh, PartitionSpec] | None:
  """The active mesh and the PartitionSpec `names` resolve to for `shape` (None outside
  `activation_rules`): what hand-written shard_map code needs to match `constrain`."""
  active = _STEP.get()
  if active is None:
    return None
  return active.mesh, spec(names, shape, active.rules.activations, active.mesh,
                           f"activation {names}")
