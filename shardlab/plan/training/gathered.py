"""The weights a sharded step gathers whole for compute, and the bytes they hold at the step's
peak (estimate.py's `gathered` memory term)."""

import math

import jax

from shardlab.plan.training import comm as plan_comm
from shardlab.sharding import rules as rules_lib


def gathered_bytes(abstract, rules, mesh, p: int) -> tuple[float, float]:
  """Weights FSDP gathers for compute, at the step's peak (compute dtype): one layer's (a
  slice of the stacked leaves) twice — the gathered weights and, in the backward pass, their
  gradients before the reduce-scatter, which XLA's buffer assignment (CPU and TPU) holds
  beside them — and one vocabulary table, the output head (or the tied table), gathered
  until the loss is done; the embedding is looked up where it is stored. A ZeRO-1/2 working
  copy is gathered whole already (counted as the params), but XLA re-lays out the largest
  gathered layer leaf, live twice while it is copied (seen on CPU). Returns the total and its
  largest single buffer, which the output head's gradient takes over once it is dead."""
  names = jax.tree.leaves(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  read = rules.activations if rules.working is None else rules.working
  layer, outer = 0.0, [0.0]
  stages = rules_lib.pipeline_stages(rules, mesh)  # a stage holds 1/stages of the layers
  for n, leaf in zip(names, jax.tree.leaves(abstract.state.params)):
    p_axes = plan_comm._axes(rules_lib.spec(n, leaf.shape, rules.params, mesh, "param"))
    c_axes = plan_comm._axes(rules_lib.spec(n, leaf.shape, read, mesh, "param"))
    if not {a for a in p_axes - c_axes if mesh.shape[a] > 1}:
      continue
    elems = math.prod(leaf.shape) // plan_comm._shards(c_axes, mesh)
    if rules.working is not None:
      outer.append(elems * p if n[0] == "layers" else 0)
    elif n[0] == "layers":
      layer += elems * p * stages / leaf.shape[0]
    else:
      outer.append(elems * p)
  return 2 * layer + max(outer), max(outer)
