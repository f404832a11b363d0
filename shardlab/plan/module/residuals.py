"""What a traced step keeps for its backward pass, per device, read from the program itself.

`trace` runs `jax.vjp` of the loss under `jax.make_jaxpr`, the public machinery behind
`jax.ad_checkpoint.print_saved_residuals`: the residuals are the vjp function's pytree
leaves, the values its backward reads. The model's own remat (`nnx.remat`, `jax.checkpoint`
and its policies) decides which they are. `saved` then says, for each:

  * its per-device bytes: residuals are global shapes; the Specs module.program
    propagates from the arguments' shardings and the model's `sl.constrain` calls divide
    them;
  * whether XLA stores it at all: a residual that is an elementwise function of values held
    anyway (other residuals, the arguments) and that the forward does not write out for a
    matmul or a transpose is recomputed inside the backward's fused kernels (GELU's tanh
    terms, a norm's squared input); where such residuals hang off values not held (a norm's
    input), XLA holds the smaller of the two sets.

Limits: the fusion rule is XLA's usual behaviour (seen on XLA:CPU), not a guarantee; XLA may
also keep a broadcast or a second copy the rule drops. Residuals that are the step's
arguments (the params, the batch) are state and batch, not activations.
"""

import dataclasses
from typing import Any

import jax
from jax.extend import core as jcore

from shardlab.plan.module.program import Spec, inline, propagate, shard_bytes
from shardlab.runtime import jax_compat

# Ops XLA fuses into their consumers and may recompute there: elementwise arithmetic and the
# layout changes that are free in a fusion (broadcast, reshape, squeeze).
FUSIBLE = frozenset("""
    abs add add_any and acos acosh asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
    pow real reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    broadcast_in_dim reshape squeeze expand_dims iota""".split())


@dataclasses.dataclass(frozen=True)
class Residual:
  shape: tuple
  dtype: str
  spec: Spec  # mesh axes per dim, as propagated
  bytes: int  # per device
  where: str  # the op that made it and the user's source line


@dataclasses.dataclass(frozen=True)
class Trace:
  """The forward of `jax.vjp` over a function, calls inlined, with every value's Spec."""
  ops: list
  invars: list  # the differentiated leaves, then the others
  residuals: list  # the vjp's residual values, in its pytree's leaf order
  specs: dict  # var -> Spec
  vjp: Any  # the vjp function's pytree of ShapeDtypeStructs (its leaves: the residuals)
  out: Any  # the function's output, as ShapeDtypeStructs
  mesh_shape: dict

  def size(self, var) -> int:
    aval = var.aval
    return shard_bytes(aval.shape, aval.dtype, self.specs.get(var, ((),) * aval.ndim),
                       self.mesh_shape)


def trace(fn, diff, const, diff_specs: list, const_specs: list, mesh_shape: dict) -> Trace:
  """`jax.vjp` of `fn(diff, const)` in `diff` only, traced as
  `jax.ad_checkpoint.saved_residuals` traces it; the Specs: one per leaf of `diff`/`const`."""
  diff_leaves, diff_tree = jax.tree.flatten(diff)
  const_leaves, const_tree = jax.tree.flatten(const)

  def flat(d, c):
    c = jax.tree.unflatten(const_tree, c)
    return jax.vjp(lambda *d: fn(jax.tree.unflatten(diff_tree, d), c), *d)

  closed, (out, vjp) = jax.make_jaxpr(flat, return_shape=True)(diff_leaves, const_leaves)
  n_res = len(jax.tree.leaves(vjp))
  ops: list = []
  outs = inline(closed.jaxpr, closed.jaxpr.invars, ops)
  invars = list(closed.jaxpr.invars)
  specs = propagate(ops, dict(zip(invars, list(diff_specs) + list(const_specs))), mesh_shape)
  return Trace(ops, invars, outs[len(outs) - n_res:], specs, vjp, out, mesh_shape)


def saved(t: Trace) -> tuple[list[Residual], list]:
  """(the residuals XLA will hold between forward and backward, per device (see the module
  docstring); the values they are)."""
  made_by = {v: op for op in t.ops for v in op.outvars}
  held = _held(t.ops, t.invars, t.residuals, t.size)
  return [Residual(tuple(v.aval.shape), str(v.aval.dtype),
                   t.specs.get(v, ((),) * v.aval.ndim), t.size(v), _describe(made_by.get(v)))
          for v in held], held


def _describe(op) -> str:
  if op is None:
    return "?"
  line = jax_compat.source_line(op.eqn)
  return f"{op.name} at {line.rsplit('/', 1)[-1]}"  # file name, line, function


# Consumers that read their operands from memory: XLA fuses elementwise producers into
# reductions and other elementwise ops, not into matmuls, transposes, gathers or loops.
FUSES_PRODUCERS = FUSIBLE | {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                             "reduce_and", "reduce_or", "argmax", "argmin"}


def written(ops, invars) -> set:
  """The values the forward writes to memory in any case: arguments, results of ops that
  are not fused (matmuls, reductions, transposes, loops), operands of ops that do not fuse
  their producers, and elementwise results read more than once."""
  out, uses = set(invars), {}
  for op in ops:
    inputs = [v for v in op.invars if isinstance(v, jcore.Var)]
    for v in inputs:
      uses[v] = uses.get(v, 0) + 1
    if op.name not in FUSES_PRODUCERS:
      out.update(inputs)
    if op.name not in FUSIBLE:
      out.update(op.outvars)
  return out | {v for v, n in uses.items() if n > 1}


def _held(ops, invars, residuals, size) -> list:
  """What XLA holds for the backward in place of the vjp's residuals. A residual the forward
  writes anyway is held as it is. Any other is an elementwise function of written values
  (its frontier), which the backward's fused kernels recompute: free when the frontier is
  held already, else XLA holds whichever is smaller, the residuals or their frontier (a
  norm's centred and squared input: the input itself)."""
  made_by = {v: op for op in ops for v in op.outvars}
  read = {v for op in ops for v in op.invars if isinstance(v, jcore.Var)}
  stored = written(ops, invars) | {v for v in residuals if isinstance(v, jcore.Var) and
                                   v in read and _expands(made_by.get(v))}
  constant = set()  # made from literals and iotas alone (a mask): always recomputed
  for op in ops:
    if op.name in FUSIBLE and all(v in constant for v in op.invars
                                  if isinstance(v, jcore.Var)):
      constant.update(op.outvars)
  unique = list(dict.fromkeys(v for v in residuals if isinstance(v, jcore.Var)
                              and v not in invars and v not in constant))
  kept = [v for v in unique if v in stored]
  held = set(kept) | set(invars)
  groups: list = []  # (residuals, frontier not held), merged where frontiers meet
  for r in unique:
    extra = set() if r in stored else _frontier(r, made_by, stored) - held
    if extra:
      joined = [g for g in groups if g[1] & extra]
      groups = [g for g in groups if not g[1] & extra]
      groups.append(({r}.union(*(g[0] for g in joined)), extra.union(*(g[1] for g in joined))))
  for rs, frontier in groups:
    if sum(map(size, rs)) <= sum(map(size, frontier)):
      kept += [v for v in unique if v in rs]
    else:
      kept += sorted(frontier, key=lambda v: -size(v))
  return kept


def _expands(op) -> bool:
  """An elementwise op that broadcasts (a norm's scale times its per-row factor): XLA writes
  its result out for the forward's reader and keeps it, rather than recompute it."""
  if op is None or op.name not in FUSIBLE or op.name == "broadcast_in_dim":
    return False
  sizes = [v.aval.size for v in op.invars if isinstance(v, jcore.Var)]
  return bool(sizes) and op.outvars[0].aval.size > max(sizes)


def _frontier(var, made_by, stored) -> set:
  """The written values an unwritten elementwise value is computed from."""
  out, stack, seen = set(), [var], set()
  while stack:
    v = stack.pop()
    if not isinstance(v, jcore.Var) or v in seen:
      continue
    seen.add(v)
    if v in stored and v is not var:
      out.add(v)
    elif v in made_by:
      stack.extend(made_by[v].invars)
  return out


