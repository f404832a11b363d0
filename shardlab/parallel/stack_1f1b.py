"""1F1B for an NNX layer stack: the loss of a module whose stacked layers the step's rules
split over the `stage` mesh axis, by the 1F1B schedule (parallel/schedule_1f1b.py).

1F1B needs microbatch m's loss gradient while later microbatches still go forward, so the
schedule owns the loss: a module hands it its embedded input, its layer stack and its head
(the modules the output reads, and the loss of one microbatch's rows), not an activation to
take on. Anywhere else (no step, no pipeline, or a GPipe step) the same call scans the layers
(parallel/scan.py, GPipe included) and takes the head's loss of the whole batch, so a model
has one loss path for every layout.

The stack's params (N layers first, stage-sharded) are viewed as S stages of K = N/S layers,
a reshape that moves nothing; the head's (final norm, output projection, tied to the
embedding or not) go in whole to every stage, as GPipe's head sits outside its pipeline. The
outer value_and_grad differentiates through the schedule's custom_vjp: the stack and head
get their gradients from the schedule, the embedding from the input's gradient.

Shape suffixes: B batch, b rows per microbatch, L length, D d_model, V vocab.
"""

from typing import Any, Callable, NamedTuple

import jax
from flax import nnx

import shardlab.parallel.context as context
import shardlab.parallel.pipeline as pipeline
import shardlab.parallel.schedule_1f1b as schedule_1f1b
from shardlab.parallel.scan import jax_policy, scan
from shardlab.sharding.activations import step_context

# head_loss(head, y_bxLxD, targets_b) -> the mean loss of those rows: `head` is what the
# caller passed (modules merged afresh from their state), targets' leaves lead with the rows.
HeadLoss = Callable[[Any, jax.Array, Any], jax.Array]


class PipelineParts(NamedTuple):
  """A module's parts for pipeline_1f1b_loss (a bundled decoder's `pipeline_parts`)."""
  x: jax.Array  # B×L×D: the stack's input (the embedded tokens)
  layers: nnx.Module  # the stacked layers; params lead with the `layers` dim
  args: tuple  # the layers' other inputs, as scan_layers' *args (per-row ones lead with B)
  call: Callable  # (layer, h_bxLxD, *args) -> h_bxLxD: one layer
  head: Any  # the modules and arrays the output reads (a final norm, the output weight)
  output: Callable  # (head, y_bxLxD) -> (final hidden b×L×D, output projection D×V)
  remat: str = "none"  # the layer scan's settings (the module's own)
  unroll: int = 1


def active() -> bool:
  """Whether the step being traced runs its pipeline by 1F1B (train.pipeline_schedule)."""
  ctx = step_context()
  return ctx is not None and ctx.schedule == "1f1b"


def pipeline_1f1b_loss(layers: nnx.Module, x_BxLxD, head, head_loss: HeadLoss, targets,
                       *args, call: Callable | None = None, remat: str = "none",
                       unroll: int = 1):
  """The mean over the pipeline's microbatches of head_loss(head, y, targets) with y the
  stack's output for x: by 1F1B when the step's schedule is 1F1B and its rules split `layers`
  over a mesh axis, else the layers scanned (or GPipe) and head_loss of the whole batch —
  equal when head_loss is a mean over equal-sized rows. `call(layer, h, *args) -> h` applies
  one layer (default: layer(h, *args)); `remat` and `unroll` are the scan's settings inside
  each stage. `args` get no gradient through 1F1B."""
  call = call or (lambda layer, h, *a: layer(h, *a))
  graphdef, stacked = nnx.split(layers)
  where = pipeline.stages(jax.tree.leaves(stacked)[0].shape[0])
  if where is None or not active():
    y = scan(layers, x_BxLxD, args, lambda layer, h, a, _: (call(layer, h, *a), None, None),
             remat, unroll=unroll)[0]
    return head_loss(head, y, targets)
  head_def, head_state = nnx.split(head)
  stacked, head_state = nnx.to_pure_dict(stacked), nnx.to_pure_dict(head_state)
  stage_params, mesh, axis, microbatches = _stages(stacked, x_BxLxD, remat, where)

  def layer_fn(h, layer_params, layer_args):
    return call(nnx.merge(graphdef, layer_params), h, *layer_args)

  if remat != "none":
    layer_fn = jax.checkpoint(layer_fn, policy=jax_policy(remat), prevent_cse=False)

  def stage_fn(params, h, *stage_args):  # this stage's K layers, in order
    return jax.lax.scan(lambda c, p: (layer_fn(c, p, stage_args), None), h, params,
                        unroll=unroll)[0]

  def loss_fn(head_params, y, stage_targets):
    return head_loss(nnx.merge(head_def, head_params), y, stage_targets)

  return schedule_1f1b.loss(stage_fn, stage_params, x_BxLxD, loss_fn, head_state, targets,
                            mesh=mesh, axis=axis, microbatches=microbatches, stage_args=args)


def _stages(stacked, x_BxLxD, remat: str, where):
  """(the N stacked params as S×K×…, mesh, axis, microbatches), after the checks a run made
  at setup (training/checks.py), again for a module stepped without that setup."""
  mesh, axis, n_stages = where
  n_layers = jax.tree.leaves(stacked)[0].shape[0]
  microbatches, repeats = step_context().pipeline
  pipeline.check_schedule("1f1b", repeats)
  cp = context.split(context.RESIDUAL, x_BxLxD.shape)
  pipeline.check_combination(n_stages, remat=remat, context=1 if cp is None else cp[3])
  pipeline.check(n_layers, n_stages, 1, microbatches, x_BxLxD.shape[0])
  k = n_layers // n_stages
  return (jax.tree.map(lambda p: p.reshape(n_stages, k, *p.shape[1:]), stacked), mesh, axis,
          microbatches)
