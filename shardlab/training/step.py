"""The jitted train and eval steps for any loss over any NNX module, with explicit in/out
shardings and the state donated.

`loss_fn(model, batch)` returns a scalar loss or `(loss, aux)` with a dict of scalar
metrics. The model it receives is built from the params cast to the policy's compute dtype,
inside the strategy's activation rules (so `constrain` in the module takes effect).
"""

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardlab.errors import ConfigError, unknown
from shardlab.parallel import accumulate, pipeline
from shardlab.sharding import rules as rules_lib
from shardlab.sharding.activations import activation_rules
from shardlab.training import precision
from shardlab.training import state as state_lib
from shardlab.training.state import Abstract, Shardings, TrainState

LossFn = Callable[[nnx.Module, Any], Any]


def batch_shards(shardings: Shardings) -> int:
  return math.prod(shardings.mesh.shape[a] for a in shardings.rules.batch_axes
                   if a in shardings.mesh.shape)


def check_batch(global_batch: int, microbatches: int, shardings: Shardings,
                name: str = "train.global_batch") -> None:
  """The global batch (and each microbatch) must split evenly over the batch axes; `name`
  is what the user calls the batch size."""
  shards = batch_shards(shardings)
  axes = "×".join(a for a in shardings.rules.batch_axes if a in shardings.mesh.shape)
  pipeline.check_microbatches(global_batch, microbatches, name)
  micro = global_batch // microbatches
  if micro % shards:
    what = (f"{name} ({global_batch})" if microbatches == 1
            else f"the microbatch ({name} {global_batch} / {microbatches} microbatches "
                 f"= {micro})")
    raise ConfigError(f"{what} is not divisible by the batch-sharding mesh axes {axes} "
                      f"({shards} shards); use a multiple of {shards}")


def _split_loss(out) -> tuple[jax.Array, dict]:
  loss, aux = out if isinstance(out, tuple) else (out, {})
  if not isinstance(aux, dict):
    raise ConfigError(f"loss_fn must return a loss or (loss, dict of metrics), got aux of "
                      f"type {type(aux).__name__}")
  return loss.astype(jnp.float32), aux


def working_loss(loss_fn: LossFn, abstract: Abstract):
  """(working copy, batch) -> (loss, aux): the module merged from compute-dtype params."""
  return lambda working, batch: _split_loss(loss_fn(nnx.merge(abstract.graphdef, working),
                                                    batch))


def model_loss(loss_fn: LossFn, abstract: Abstract):
  """(params, batch) -> (loss, aux), casting the stored params to the compute dtype."""
  loss = working_loss(loss_fn, abstract)
  return lambda params, batch: loss(precision.cast_for_compute(params, abstract.policy), batch)


def _grads(loss_fn, stored, cast, batch, microbatches: int, grad_dtype, grad_shardings,
           batch_sharding):
  """((loss, aux), gradients of `loss_fn(cast(stored), batch) -> (loss, aux)` w.r.t. the
  working copy `cast(stored)`, in `grad_dtype`, reduced to `grad_shardings`). Microbatches'
  gradients are reduced as they come and summed in fp32: a full-remat layer stack's straight
  into the accumulator, layer by layer, in its backward pass, which reads the stored weights
  and casts one layer at a time (shardlab/parallel/accumulate.py): no working copy of the
  stack is held through the step. The rest are added once each microbatch's backward pass
  is done."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def reduced(grads):
    grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    # An all-reduce, or a reduce-scatter (zero2, fsdp) where the grads' sharding splits what
    # the working copy held whole (TPU and GPU compile one; XLA:CPU lowers every
    # reduce-scatter to all-reduce + slice).
    return jax.lax.with_sharding_constraint(grads, grad_shardings)

  if microbatches == 1:
    out, grads = grad_fn(cast(stored), batch)
    return out, reduced(grads)

  # Microbatch j takes rows j, j+m, j+2m, ...: every device keeps its own rows, no reshuffle.
  def split(leaf):
    return leaf.reshape(leaf.shape[0] // microbatches, microbatches,
                        *leaf.shape[1:]).swapaxes(0, 1)

  def one_microbatch(carry, mb):
    out_sum, acc = carry
    mb = jax.lax.with_sharding_constraint(mb, batch_sharding)
    out, grads, into = accumulate.differentiate(lambda w: loss_fn(w, mb), stored, cast, acc,
                                                grad_dtype)
    a_leaves, a_def = jax.tree.flatten(acc)
    summed = [(a if new is None else new) + g.astype(jnp.float32) for a, g, new in
              zip(a_leaves, jax.tree.leaves(reduced(grads)), into)]
    acc = jax.lax.with_sharding_constraint(jax.tree.unflatten(a_def, summed), grad_shardings)
    return (jax.tree.map(lambda c, o: c + o.astype(jnp.float32), out_sum, out), acc), None

  micro = jax.tree.map(split, batch)
  out_shape = jax.eval_shape(lambda s, b: loss_fn(cast(s), b), stored,
                             jax.tree.map(lambda leaf: leaf[0], micro))
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), out_shape)
  acc = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), stored)
  acc = jax.lax.with_sharding_constraint(acc, grad_shardings)
  (out, acc), _ = jax.lax.scan(one_microbatch, (zeros, acc), micro)
  return jax.tree.map(lambda leaf: leaf / microbatches, (out, acc))


def _on_device(tree, device_shardings):
  """`tree` moved to its device placement (a no-op unless it is in host memory)."""
  return jax.device_put(tree, device_shardings)


def working_copy(params, abstract: Abstract, shardings: Shardings):
  """The params cast to the compute dtype and, for ZeRO-1/2, gathered whole (once per step,
  outside any microbatch loop): what forward and backward read."""
  working = precision.cast_for_compute(params, abstract.policy)
  if shardings.rules.working is None:
    return working
  return jax.lax.with_sharding_constraint(working, shardings.working)


def _read_params(params, abstract: Abstract, shardings: Shardings):
  """(the frozen params' working copy, the trained params the step differentiates, the cast
  that makes their working copy). ZeRO-1/2 gather the working copy whole once per step, so
  the trained params are that copy (the cast a no-op); otherwise they are the stored weights,
  cast where they are read: one layer at a time in an accumulating layer scan."""
  stored = _on_device(params, shardings.on_device.params)
  working = working_copy(stored, abstract, shardings)
  source = working if shardings.rules.working is not None else stored
  return (abstract.fixed(working), abstract.trainable(source),
          lambda tree: precision.cast_for_compute(tree, abstract.policy))


NONFINITE_POLICIES = ("stop", "skip")


def pipeline_split(shardings: Shardings, microbatches: int, repeats: int = 1,
                   schedule: str = "gpipe"):
  """(microbatches the step loops over, (microbatches, repeats) for the pipeline, its
  schedule). When the rules split `layers` over `stage`, the pipeline consumes
  train.microbatches itself: the step hands it the whole batch (shardlab/parallel/
  pipeline.py); without a pipeline the schedule is moot, and "gpipe" says so."""
  if rules_lib.pipeline_stages(shardings.rules, shardings.mesh) > 1:
    return 1, (microbatches, repeats), schedule
  return microbatches, (1, 1), "gpipe"


def _check_options(nonfinite: str, shardings: Shardings, schedule: str, repeats: int) -> None:
  if nonfinite not in NONFINITE_POLICIES:
    raise unknown("train.nonfinite", nonfinite, NONFINITE_POLICIES)
  pipeline.check_schedule(schedule, repeats)
  stages = rules_lib.pipeline_stages(shardings.rules, shardings.mesh)
  if stages > 1:  # a run from a config met this at setup (training/checks.py) already
    pipeline.check_combination(stages, offload="opt_state" if shardings.offloaded else "none")


def make_train_step(loss_fn: LossFn, abstract: Abstract, shardings: Shardings, *,
                    microbatches: int = 1, lr_schedule: optax.Schedule | None = None,
                    grad_dtype: str = "auto", nonfinite: str = "stop",
                    pipeline_repeats: int = 1, early_grads: bool = True,
                    pipeline_schedule: str = "gpipe"):
  """jit(state, batch) -> (state, metrics); `state` is donated. Metrics: loss, grad_norm,
  finite (both are finite), the loss's aux entries (averaged over microbatches) and, given a
  schedule, lr. `grad_dtype`: "auto", "fp32" or "bf16" (see precision.gradient_dtype).
  `nonfinite`: "stop" applies every update (the caller stops on `finite`); "skip" keeps the
  params and optimizer state of a non-finite step as they were and reports skipped = 1.
  `early_grads`: reduce weight gradients where the model asks
  (shardlab.parallel.reduce_grads_early). Remat and scan unroll are the model's own settings.
  `pipeline_schedule`: "gpipe" or "1f1b", which owns the loss: `loss_fn` then reaches the
  layers through shardlab.parallel.pipeline_1f1b_loss (as the bundled decoders' do)."""
  _check_options(nonfinite, shardings, pipeline_schedule, pipeline_repeats)
  dtype = precision.gradient_dtype(abstract.policy, grad_dtype)
  loss = working_loss(loss_fn, abstract)
  # Gradients only for the trainable params: a frozen one (a LoRA base) gets no weight-
  # gradient matmul at all, since nothing reads it.
  loss_of = lambda trained, fixed, batch: loss(state_lib.merge(trained, fixed), batch)

  looped, pipe, kind = pipeline_split(shardings, microbatches, pipeline_repeats, pipeline_schedule)

  def train_step(state: TrainState, batch):
    with activation_rules(shardings.mesh, shardings.rules, pipe, early_grads, schedule=kind):
      fixed, source, cast = _read_params(state.params, abstract, shardings)
      (value, aux), grads = _grads(lambda w, b: loss_of(w, fixed, b), source, cast, batch,
                                   looped, dtype, abstract.trainable(shardings.grads),
                                   shardings.batch)
      if shardings.offloaded:
        # The stored weights and optimizer state come in from host memory only now, for the
        # update (the barrier keeps XLA from fetching them before the gradients exist); the
        # out_shardings send them back.
        grads, state = jax.lax.optimization_barrier((grads, state))
        state = jax.device_put(state, shardings.on_device)
      trained = abstract.trainable(state.params)
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
      updates, opt_state = abstract.optimizer.update(grads, state.opt_state, trained)
      params = state_lib.merge(optax.apply_updates(trained, updates),
                               abstract.fixed(state.params))
    grad_norm = optax.tree.norm(grads)
    # Two scalar tests on values already reduced: no extra pass over the params.
    finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
    metrics = {"loss": value, "grad_norm": grad_norm, "finite": finite, **aux}
    if nonfinite == "skip":  # a select per element, fused into the update
      params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                       (params, opt_state), (state.params, state.opt_state))
      metrics["skipped"] = jnp.logical_not(finite).astype(jnp.int32)
    if lr_schedule is not None:
      metrics["lr"] = lr_schedule(state.step)
    return TrainState(state.step + 1, params, opt_state), metrics

  replicated = NamedSharding(shardings.mesh, PartitionSpec())
  jitted = jax.jit(train_step, in_shardings=(shardings.state, shardings.batch),
                   out_shardings=(shardings.state, replicated), donate_argnums=0)
  return _Checked(jitted, microbatches, shardings)


class _Checked:
  """A jitted step that first checks the batch splits over the batch axes (jit's own error
  for this names no config field)."""

  def __init__(self, jitted, microbatches: int, shardings: Shardings):
    self.jitted, self.microbatches, self.shardings = jitted, microbatches, shardings

  def _check(self, batch) -> None:
    check_batch(jax.tree.leaves(batch)[0].shape[0], self.microbatches, self.shardings,
                "the batch's leading dim")

  def __call__(self, state, batch):
    self._check(batch)
    return self.jitted(state, batch)

  def lower(self, state, batch):
    self._check(batch)
    return self.jitted.lower(state, batch)


def make_eval_step(loss_fn: LossFn, abstract: Abstract, shardings: Shardings, *,
                   microbatches: int = 1, pipeline_repeats: int = 1):
  """jit(params, batch) -> mean loss. Under a pipeline it runs the train step's schedule
  (train.microbatches, train.pipeline_repeats), not a one-microbatch GPipe that would leave
  (S − 1)/S of it bubble; without one the whole batch goes through at once. A 1F1B run's
  eval runs GPipe over the same microbatches: forward only, where 1F1B would run the
  backwards too."""
  loss = model_loss(loss_fn, abstract)
  _, schedule, _ = pipeline_split(shardings, microbatches, pipeline_repeats)

  def eval_step(params, batch):
    params = _on_device(params, shardings.on_device.params)
    with activation_rules(shardings.mesh, shardings.rules, schedule):
      return loss(params, batch)[0]

  return jax.jit(eval_step, in_shardings=(shardings.state.params, shardings.batch),
                 out_shardings=NamedSharding(shardings.mesh, PartitionSpec()))
