"""The backward pass's peak bytes per device, by walking its program in order.

`backward_peak` traces the vjp function of a `residuals.Trace` (its inputs: the residuals and
the loss's cotangent; its outputs: the gradients, constrained to where the step reduces
them) and runs it op by op: a value is allocated when its op runs and freed after its last
reader. It starts with the residuals XLA holds (`residuals.saved`) and frees each after its
last reader, so the peak counts the cotangents, the layers a remat rebuilds, the loss's
buffers and the gradients as they accumulate. Sizes are per device, from the Specs
module.program propagates; an elementwise value read once by a fusing op takes no
buffer (its inputs live until that reader runs instead), as in XLA's fusions.

Limits: the order is the program's, not XLA's schedule (XLA may reorder to lower the peak,
or raise it: XLA:CPU hoists a remat's recomputation, docs/plan-any-module.md); the weights
FSDP gathers and the optimizer's update are not in it; a loop body counts once, at its own
peak, beside what the loop carries.
"""

import jax
from jax.extend import core as jcore

from shardlab.plan.module import program

from shardlab.plan.module import residuals


def backward_peak(t: residuals.Trace, held: list, grads_to=None) -> int:
  """Peak per-device bytes while the backward of `t` runs, holding `held` (the values
  `residuals.saved` returned) at its start; `grads_to(grads)` constrains the gradients where
  the step reduces them (else they stay where the backward makes them)."""
  leaves, tree = jax.tree.flatten(t.vjp)
  cotangent = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype), t.out)

  def backward(res, ct):
    grads = jax.tree.unflatten(tree, res)(ct)
    return grads_to(grads) if grads_to else grads

  jaxpr = jax.make_jaxpr(backward)(leaves, cotangent).jaxpr
  res_specs = [t.specs.get(v, ((),) * v.aval.ndim) if isinstance(v, jcore.Var) else ()
               for v in t.residuals]
  ct_specs = [None for _ in jax.tree.leaves(cotangent)]  # placed by what reads it
  wanted, initial = set(held), {}
  for inner, outer in zip(jaxpr.invars, t.residuals):
    if isinstance(outer, jcore.Var) and outer in wanted:
      initial[inner] = t.size(outer)
      wanted.discard(outer)
  # Held values that are not residuals (a norm's input kept in place of its derived
  # residuals) are counted for the whole backward.
  extra = sum(t.size(v) for v in wanted)
  return extra + _peak(jaxpr, res_specs + ct_specs, t.mesh_shape, initial)


def _peak(jaxpr, in_specs: list, mesh_shape: dict, initial: dict | None = None) -> int:
  """Peak bytes of `jaxpr` run in order; `initial`: inputs live at the start (var -> bytes),
  freed after their last reader (other inputs are counted elsewhere)."""
  ops: list = []
  outs = program.inline(jaxpr, jaxpr.invars, ops)
  specs = program.propagate(ops, dict(zip(jaxpr.invars, in_specs)), mesh_shape)

  def size(v) -> int:
    aval = v.aval
    if not hasattr(aval, "shape"):
      return 0
    return program.shard_bytes(aval.shape, aval.dtype,
                               specs.get(v, ((),) * len(aval.shape)), mesh_shape)

  def inner(op) -> int:
    ins = [specs.get(v, ()) if isinstance(v, jcore.Var) else () for v in op.invars]
    return _loop_peak(op, ins, mesh_shape)

  return _simulate(ops, list(jaxpr.invars), outs, size, inner, initial or {})


def _last_reads(ops, outs, stored) -> dict:
  """Var -> index of the op after which it can be freed."""
  last: dict = {v: len(ops) for v in outs if isinstance(v, jcore.Var)}
  for i in reversed(range(len(ops))):
    op = ops[i]
    buffered = op.name not in residuals.FUSIBLE or any(v in stored for v in op.outvars)
    # A fused value is computed where it is read: its inputs live until then.
    end = i if buffered else max([last.get(v, i) for v in op.outvars] or [i])
    for v in op.invars:
      if isinstance(v, jcore.Var):
        last[v] = max(last.get(v, -1), end)
  return last


def _simulate(ops, invars, outs, size, inner, initial: dict) -> int:
  """The largest sum of live buffers over `ops` in order, with what a loop op holds inside
  (`inner(op)`) while it runs."""
  stored = residuals.written(ops, invars) | {v for v in outs if isinstance(v, jcore.Var)}
  last = _last_reads(ops, outs, stored)
  live, frees = sum(initial.values()), {}
  for v in initial:
    frees.setdefault(max(last.get(v, 0), 0), []).append(v)
  arguments, peak = set(invars), live
  for i, op in enumerate(ops):
    buffered = op.name not in residuals.FUSIBLE or any(v in stored for v in op.outvars)
    for v in op.outvars if buffered else ():
      if v not in arguments:
        live += size(v)
        frees.setdefault(last.get(v, i), []).append(v)
    peak = max(peak, live + inner(op))
    live -= sum(initial.get(v, 0) if v in initial else size(v) for v in frees.pop(i, ()))
  return peak


def _loop_peak(op, in_specs: list, mesh_shape: dict) -> int:
  """What a loop's body allocates at its peak beyond its carry (0 for other ops)."""
  p = op.params
  if op.name == "scan":
    consts, carry = p["num_consts"], p["num_carry"]
    body = in_specs[:consts + carry] + [tuple(s)[1:] for s in in_specs[consts + carry:]]
    return _peak(p["jaxpr"].jaxpr, body, mesh_shape)
  if op.name == "while":
    return _peak(p["body_jaxpr"].jaxpr, in_specs[p["cond_nconsts"]:], mesh_shape)
  if op.name == "cond":
    return max(_peak(b.jaxpr, in_specs[1:], mesh_shape) for b in p["branches"])
  return 0
