"""The layer scan: a stack of identical layers applied in order with lax.scan, so compile
time does not grow with depth, under a named remat policy — or, when the step's rules split
`layers` over a mesh axis (`stage`), as a pipeline (parallel/pipeline.py).

A stack is any NNX module whose params lead with the layer dim (built with
`stacked_param(..., stack=(n,))`, or `nnx.vmap` with `transform_metadata=
{nnx.PARTITION_NAME: "layers"}`). `remat` and `unroll` are the scan's own settings, given by
the model that owns the stack (a bundled model gets train.remat and train.scan_unroll when it
is built), so the same module steps the same way inside a train step and outside one.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from shardlab import remat as remat_lib
from shardlab.errors import ConfigError
from shardlab.remat import LAYER_INPUT
import shardlab.parallel.accumulate as accumulate
import shardlab.parallel.context as context
import shardlab.parallel.pipeline as pipeline
from shardlab.sharding.activations import pipeline_schedule, step_context

@functools.cache
def jax_policy(remat: str):
  """The policy jax.checkpoint takes for a train.remat value, listed or custom (None: no
  jax.checkpoint at all; one object per value, so that tracing the same step twice sees the
  same policy). Each is described in shardlab/remat.py."""
  p = remat_lib.policy(remat)
  return None if p is None else p.jax_policy()


# The listed train.remat values -> their jax.checkpoint policies.
REMAT_POLICIES = {k: jax_policy(k) for k in remat_lib.POLICIES}

# call(layer, x, args, slice) -> (x, new slice, stats or None)
Call = Callable[[nnx.Module, jax.Array, tuple, object], tuple]


def scan_layers(layers: nnx.Module, x, *args, remat: str = "none", unroll: int = 1):
  """`layer(x, *args) -> x` for each layer of the stack in order; `args` are the same for
  every layer (inputs leading with the batch are split into a pipeline's microbatches)."""
  return scan(layers, x, args, lambda layer, h, a, _: (layer(h, *a), None, None), remat,
              unroll=unroll)[0]


def scan(layers: nnx.Module, x, args: tuple, call: Call, remat: str = "none",
         per_layer=None, stats: dict | None = None, unroll: int = 1):
  """(x, the stacked new per-layer slices, `stats` summed over the layers). `call` applies
  one layer: given the layer, x, `args` and its slice of `per_layer` (a tree whose leaves
  lead with the layer dim, e.g. a KV cache; None without one), it returns x, the new slice
  and a dict of scalars to add to `stats` (None when `stats` is None). `unroll`: layers per
  iteration of the lax.scan (train.scan_unroll; the layer count unrolls it whole)."""
  remat_lib.policy(remat)  # a listed policy or a custom spec, else refused naming them
  if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
    raise ConfigError(f"the layer scan's unroll (train.scan_unroll) must be an int >= 1, "
                      f"got {unroll!r}")
  graphdef, stacked = nnx.split(layers)
  n_layers = jax.tree.leaves(stacked)[0].shape[0]
  where = pipeline.stages(n_layers)
  if per_layer is None and where is not None:  # the rules split `layers` over `stage`
    return _pipelined(graphdef, stacked, x, args, call, remat, where, stats), None, stats

  def one_layer(layer_state, carry, layer_args, layer_slice=None):
    h, totals = carry
    # Every use reads the named copy, so under remat "offload" the input itself is no
    # residual: only its host copy is.
    h = checkpoint_name(h, LAYER_INPUT)
    h, new_slice, layer_stats = call(nnx.merge(graphdef, layer_state), h, layer_args,
                                     layer_slice)
    if totals is not None:
      totals = {k: totals[k] + layer_stats[k] for k in totals}
    return (h, totals), new_slice

  def body(carry, inputs):
    return one_layer(inputs[0], carry, args, inputs[1])

  zeros = None if stats is None else {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}
  registry = accumulate.active() if remat == "full" and per_layer is None else None
  into = registry and registry.take(jax.tree.leaves(stacked))
  if into:  # the step accumulates microbatches: into the accumulator, layer by layer
    stored, accumulators = into
    x, totals = accumulate.run(lambda *a: one_layer(*a)[0], stacked, stored, (x, zeros), args,
                               accumulators, registry.grad_dtype, unroll)
    return x, None, totals
  if remat != "none":
    # Inside a loop XLA cannot merge the backward's recomputed forward with the forward, so
    # no barrier is needed. A scan unrolled whole (or of one layer, whose loop XLA removes)
    # is straight-line code: without the barrier CSE merges the two and the remat is undone
    # (the step compiled to no remat's program, bytes and FLOPs alike).
    body = jax.checkpoint(body, policy=jax_policy(remat), prevent_cse=unroll >= n_layers)
  (x, totals), out = jax.lax.scan(body, (x, zeros), (stacked, per_layer), unroll=unroll)
  return x, out, totals


def _pipelined(graphdef, stacked, x, args, call: Call, remat: str, where, stats):
  # A run set up from a config refused these before tracing (shardlab/training/checks.py);
  # a module stepped by hand meets the same errors here.
  cp = context.split(context.RESIDUAL, x.shape)
  pipeline.check_combination(where[2], remat=remat, context=1 if cp is None else cp[3],
                             layer_stats=None if stats is None else "this model's layers")
  if step_context().schedule == "1f1b":
    raise ConfigError("train.pipeline_schedule=1f1b owns the loss, but this model's layer scan "
                      "reached the pipeline by itself; its loss must run the layers through "
                      "shardlab.parallel.pipeline_1f1b_loss (a bundled model: by its "
                      "pipeline_parts), or set train.pipeline_schedule=gpipe")

  def stage_layer(h, layer_state, layer_args):
    return call(nnx.merge(graphdef, layer_state), h, layer_args, None)[0]

  if remat != "none":
    stage_layer = jax.checkpoint(stage_layer, policy=jax_policy(remat), prevent_cse=False)
  return pipeline.run(stage_layer, stacked, x, args, where, *pipeline_schedule())
