"""`sl.plan_module`: memory per device of the train step for ANY nnx.Module, without compiling.

    plan = sl.plan_module(lambda: Mixer(nnx.Rngs(0)), optax.adamw(1e-3), "fp32", "fsdp_tp",
                          sl.mesh("data:2,fsdp:2,tensor:2"), batch=batch_shapes,
                          loss_fn=loss_fn)
    print(plan.render())

What it counts, per device:
  * params, master weights, gradients, optimizer state (plan.training.state_bytes): exact,
    from the abstract state and the same shardings the train step uses; with the batch and
    the step counter they are the compiled step's argument bytes to the byte;
  * activations: the residuals the backward reads (module.residuals): `jax.vjp` of the
    loss over the working params, traced (never lowered) under the step's context
    (`activation_rules`, so `sl.constrain` applies) on one microbatch, with the module's own
    remat; each residual divided by the shardings propagated to it from the params', the
    batch's and the model's constraints, and left out where XLA recomputes it in a fused
    kernel instead of storing it;
  * temporaries: the rest of the backward's peak (module.liveness): cotangents, the
    layers a remat rebuilds, the loss's buffers, the gradients as they accumulate, walked op
    by op in program order.

Limits (docs/plan-any-module.md): XLA's schedule and fusion decisions are modelled, not
asked for; weights FSDP gathers and the optimizer's own temporaries are not counted; no
pipeline schedules. `compiled=True` compiles the real step (aot.compile_train_step) and puts
XLA's figures beside the estimate.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from shardlab.errors import ConfigError
from shardlab.observe.step_report import StepReport
from shardlab.plan.compiled import aot
from shardlab.plan.module import liveness
from shardlab.plan.module import program
from shardlab.plan.module import residuals
from shardlab.plan.training import state_bytes
from shardlab.plan.training.memory import tree_shard_bytes
from shardlab.sharding import rules as rules_lib
from shardlab.sharding.activations import activation_rules
from shardlab.training import precision as precision_lib
from shardlab.training import state as state_lib
from shardlab.training import step as step_lib
from shardlab.runtime.units import GiB

STEP_COUNTER = 4  # the train state's int32 step: one of the step's arguments


@dataclasses.dataclass(frozen=True)
class ModulePlan:
  """Bytes per device of one train step (see the module docstring for what each holds)."""
  where: str  # the mesh, e.g. "data:2,fsdp:2,tensor:2 on cpu"
  strategy: str
  precision: str
  microbatches: int
  params: float  # the working copy forward and backward read
  master: float  # stored weights that are not that copy
  grads: float
  opt_state: float
  batch: float
  activations: float
  temporaries: float
  stored: float  # the weights the train state keeps on the device (params or master)
  host: float = 0.0  # stored weights and optimizer state offloaded to host memory
  residuals: tuple = ()  # residuals.Residual, largest first
  compiled: StepReport | None = None

  @property
  def arguments(self) -> float:
    """The step's arguments on the device: the stored state, the batch, the step counter
    (XLA's argument bytes, to the byte)."""
    return self.stored + self.opt_state + self.batch + STEP_COUNTER

  @property
  def total(self) -> float:
    return (self.params + self.master + self.grads + self.opt_state + self.batch +
            self.activations + self.temporaries)

  def render(self, largest: int = 6) -> str:
    """A table in GiB per device; with `compiled`, XLA's figures and estimate / XLA."""
    c, digits = self.compiled, 3 if self.total >= GiB else 6
    gib = lambda b: f"{b / GiB:>12.{digits}f}"
    lines = [f"plan for {self.strategy} on {self.where}, precision {self.precision}, "
             f"microbatches {self.microbatches}",
             f"{'per device':<22}{'GiB':>12}" + (f"{'XLA GiB':>12}{'ratio':>7}" if c else "")]
    for name, value in (("params (working copy)", self.params),
                        ("master weights", self.master), ("gradients", self.grads),
                        ("optimizer state", self.opt_state), ("batch", self.batch),
                        ("activations (saved)", self.activations),
                        ("temporaries", self.temporaries)):
      lines.append(f"{name:<22}{gib(value)}")
    for name, value, xla in (("arguments", self.arguments, c and c.argument_bytes),
                             ("total", self.total, c and c.total_bytes)):
      ratio = f"{gib(xla)}{value / max(xla, 1):>7.2f}" if c else ""
      lines.append(f"{name:<22}{gib(value)}{ratio}")
    if self.host:
      lines.append(f"{'host (offloaded)':<22}{gib(self.host)}")
    if self.residuals:
      lines.append(f"largest saved residuals (of {len(self.residuals)}):")
      for r in self.residuals[:largest]:
        split = ",".join("x".join(axes) or "-" for axes in r.spec)
        lines.append(f"  {gib(r.bytes).strip()} GiB  {r.dtype}{list(r.shape)} split "
                     f"[{split}]  {r.where}")
    return "\n".join(lines)


def plan_module(model, optimizer: optax.GradientTransformation | None = None,
                precision: str = "fp32", strategy="fsdp", mesh: Mesh | None = None, *,
                batch, loss_fn: Callable, microbatches: int = 1,
                frozen: Callable | None = None, offload: str = "none",
                grad_dtype: str = "auto", early_grads: bool = True,
                compiled: bool = False) -> ModulePlan:
  """The memory per device of `sl.train_step(loss_fn, ...)` for `model` (a factory, or an
  `sl.abstract_state` result, which then brings its optimizer, precision and frozen set),
  under `strategy` (a name or `sl.strategy(...)` Rules) on `mesh` (simulated, real or
  compile-only TPU devices), for `batch`: a tree of global jax.ShapeDtypeStructs whose
  leading dim is the batch. Nothing is allocated or compiled unless `compiled=True`."""
  abstract = _abstract(model, optimizer, precision, frozen)
  rules = strategy if isinstance(strategy, rules_lib.Rules) else rules_lib.strategy(strategy)
  if not isinstance(mesh, Mesh):
    raise ConfigError(f"plan_module needs a mesh (sl.mesh(...)), got {type(mesh).__name__}")
  if rules_lib.pipeline_stages(rules, mesh) > 1:
    raise ConfigError("plan_module does not model pipeline schedules (layers split over "
                      "`stage`); compile the step instead (aot.compile_train_step)")
  sh = state_lib.shardings(abstract, rules, mesh, offload)
  batch = _batch_shapes(batch)
  step_lib.check_batch(jax.tree.leaves(batch)[0].shape[0], microbatches, sh,
                       "the batch's leading dim")
  dtype = precision_lib.gradient_dtype(abstract.policy, grad_dtype)
  state = state_bytes.model_state(abstract, sh, abstract.policy, microbatches, dtype, offload)
  # The layer scan's settings (remat, unroll) are the module's own, given when it is built.
  with activation_rules(mesh, rules, (1, 1), early_grads):
    held, peak = _backward_memory(abstract, sh, loss_fn, _microbatch(batch, microbatches),
                                  dtype)
  activations = float(sum(r.bytes for r in held))
  one_grads = tree_shard_bytes(abstract.trainable(abstract.state.params),
                               abstract.trainable(sh.grads), dtype)
  report = None
  if compiled:
    step = step_lib.make_train_step(loss_fn, abstract, sh, microbatches=microbatches,
                                    grad_dtype=grad_dtype, early_grads=early_grads)
    report = aot.compile_train_step(step, abstract, sh, batch)
  return ModulePlan(
      where=f"{','.join(f'{a}:{n}' for a, n in mesh.shape.items())} on "
            f"{mesh.devices.flat[0].platform}",
      strategy=rules.name, precision=abstract.policy.name, microbatches=microbatches,
      params=state["params"], master=state["master"], grads=state["grads"],
      opt_state=state["opt_state"], batch=tree_shard_bytes(
          batch, jax.tree.map(lambda _: sh.batch, batch)),
      activations=activations, temporaries=max(0.0, peak - activations - one_grads),
      stored=state["stored"], host=state["host"],
      residuals=tuple(sorted(held, key=lambda r: -r.bytes)), compiled=report)


def _abstract(model, optimizer, precision: str, frozen) -> state_lib.Abstract:
  if isinstance(model, state_lib.Abstract):
    if optimizer is not None or frozen is not None:
      raise ConfigError("plan_module: an sl.abstract_state result brings its own optimizer "
                        "and frozen set; pass the model factory to give them here")
    return model
  if not callable(model):
    raise ConfigError(f"plan_module: model must be a factory (lambda: MyModule(...)) or "
                      f"an sl.abstract_state result, got {type(model).__name__}")
  if optimizer is None:
    raise ConfigError("plan_module: optimizer is required with a model factory "
                      "(e.g. optax.adamw(1e-3))")
  return state_lib.abstract_state(model, optimizer, precision, frozen)


def _batch_shapes(batch):
  leaves = jax.tree.leaves(batch)
  if not leaves or any(not hasattr(x, "shape") or not hasattr(x, "dtype") or not x.shape
                       for x in leaves):
    raise ConfigError("plan_module: batch must be a tree of jax.ShapeDtypeStruct (or arrays) "
                      "with a leading batch dim, e.g. {'x': jax.ShapeDtypeStruct((64, 32), "
                      "jnp.float32)}")
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)


def _microbatch(batch, microbatches: int):
  """One microbatch's shapes: what a forward and backward of the step see at once."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // microbatches,
                                                      *x.shape[1:]), x.dtype), batch)


def _backward_memory(abstract, sh, loss_fn, batch, grad_dtype) -> tuple[list, int]:
  """(the residuals XLA holds, the backward's peak bytes), per device, for one microbatch;
  traced under the active step context."""
  mesh_shape = dict(sh.mesh.shape)
  working = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
      a.shape, abstract.policy.compute_dtype if jnp.issubdtype(a.dtype, jnp.floating)
      else a.dtype), abstract.state.params)
  specs = lambda tree, shards: [program.spec_of(s, a.ndim) for a, s in zip(
      jax.tree.leaves(tree), jax.tree.leaves(shards))]
  trained, fixed = abstract.trainable(working), abstract.fixed(working)
  loss = step_lib.working_loss(loss_fn, abstract)

  def fn(trained, const):
    fixed, batch = const
    return loss(state_lib.merge(trained, fixed), batch)[0]

  batch_specs = [program.spec_of(sh.batch, x.ndim) for x in jax.tree.leaves(batch)]
  t = residuals.trace(fn, trained, (fixed, batch),
                      specs(trained, abstract.trainable(sh.working)),
                      specs(fixed, abstract.fixed(sh.working)) + batch_specs, mesh_shape)
  held, values = residuals.saved(t)
  grad_shardings = tuple(jax.tree.leaves(abstract.trainable(sh.grads)))

  def reduced(grads):  # as the step holds them: in grad_dtype, where it reduces them
    return jax.lax.with_sharding_constraint(
        tuple(g.astype(grad_dtype) for g in grads), grad_shardings)

  return held, liveness.backward_peak(t, values, reduced)

