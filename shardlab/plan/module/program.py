"""A traced program as XLA will see it, and where its values live on a mesh.

`inline` flattens a jaxpr's calls (jit, remat, custom_jvp/vjp), as XLA inlines them; loops
and conditionals stay whole. `propagate` gives every value a Spec (the mesh axes each of its
dims is split over) from its inputs' Specs and every `with_sharding_constraint`
(`sl.constrain`), dimension by dimension: a simplified GSPMD. Elementwise ops merge their
operands' axes; dot_general keeps its batch and free dims' axes; reshape, transpose,
broadcast and reductions move or drop them; loop bodies are entered once.

Limits: this is not XLA's partitioner. Where its choice is open (a matmul whose operands
both split the output's dims over one axis) the larger operand keeps the axis here; a reshape
keeps only the axes of the major dim it merges; ops it has no rule for keep the axes of
operand dims of the same size.
"""

import dataclasses
import math
from typing import Any

import numpy as np
from jax.extend import core as jcore

Spec = tuple  # per dim, a tuple of mesh axis names (empty: not split)


def shard_bytes(shape, dtype, spec: Spec, mesh_shape: dict) -> int:
  """Per-device bytes of a `shape` array split as `spec` (a dim that does not divide is
  padded, as GSPMD pads it)."""
  n = 1
  for size, axes in zip(shape, spec):
    n *= math.ceil(size / math.prod(mesh_shape[a] for a in axes))
  return n * np.dtype(dtype).itemsize


def spec_of(sharding, rank: int) -> Spec:
  """A NamedSharding's PartitionSpec as a Spec of `rank` dims."""
  parts = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
  return tuple(() if p is None else (p,) if isinstance(p, str) else tuple(p) for p in parts)


@dataclasses.dataclass(frozen=True)
class Op:
  """One primitive of a program with every call (jit, remat, custom_jvp/vjp) inlined, as XLA
  inlines them: a call boundary stores nothing."""
  name: str
  params: dict
  invars: list
  outvars: list
  eqn: Any  # the original equation (for its source line)


OPAQUE = ("scan", "while", "cond")  # their bodies run per iteration: kept whole


def inline(jaxpr, args, ops: list) -> list:
  """Appends `jaxpr`'s ops to `ops` with its inputs renamed to `args`; returns its outputs.
  Every value gets a new name: JAX shares one jaxpr between the calls of a jitted function,
  so two inlined calls would otherwise define the same value twice."""
  env = dict(zip(jaxpr.invars, args))
  look = lambda v: env.get(v, v) if isinstance(v, jcore.Var) else v
  for eqn in jaxpr.eqns:
    ins = [look(v) for v in eqn.invars]
    sub = None if eqn.primitive.name in OPAQUE else _sub_jaxpr(eqn)
    if sub is None:
      outs = [jcore.Var(v.aval) for v in eqn.outvars]
      env.update(zip(eqn.outvars, outs))
      ops.append(Op(eqn.primitive.name, eqn.params, ins, outs, eqn))
      continue
    for outer, inner in zip(eqn.outvars, inline(getattr(sub, "jaxpr", sub), ins, ops)):
      env[outer] = inner
  return [look(v) for v in jaxpr.outvars]


def propagate(ops, env: dict, mesh_shape: dict) -> dict:
  """Var -> Spec for every var `ops` define, from `env` (the inputs' Specs). A value made
  from constants alone (a broadcast zero, the scalar loss's cotangent spread over the
  batch) has no placement of its own: it takes its readers', as GSPMD propagates both ways."""
  env = dict(env)
  _forward(ops, env, mesh_shape)
  _backward(ops, env)
  _forward(ops, env, mesh_shape)
  rank = lambda v: len(getattr(v.aval, "shape", ()))
  return {v: s if s is not None else ((),) * rank(v) for v, s in env.items()}


def _forward(ops, env: dict, mesh_shape: dict) -> None:
  """A scalar is placed nowhere in particular: it counts as unknown."""
  scalar = lambda v: not getattr(v.aval, "shape", ())
  for op in ops:
    ins = [env.get(v) if isinstance(v, jcore.Var) and not scalar(v) else None
           for v in op.invars]
    for v, s in zip(op.outvars, _rule(op, ins, mesh_shape)):
      s = None if scalar(v) else s
      if s is not None or v not in env:
        env[v] = s


def _backward(ops, env: dict) -> None:
  """Unknown inputs take the Spec of an output they map onto (same shape, or through a
  broadcast, transpose, reshape or reduction)."""
  for op in reversed(ops):
    out_specs = [(env.get(v), tuple(v.aval.shape)) for v in op.outvars
                 if getattr(v.aval, "shape", None) is not None]
    known = [(s, shape) for s, shape in out_specs if s is not None]
    if not known or op.name == "dot_general":  # a matmul's operands are placed upstream
      continue
    spec, shape = known[0]
    for v in op.invars:
      if isinstance(v, jcore.Var) and env.get(v) is None and hasattr(v.aval, "shape"):
        env[v] = _inverse(op, spec, shape, tuple(v.aval.shape))


def _inverse(op, spec: Spec, out: tuple, shape: tuple):
  p = op.params
  if shape == out:
    return spec
  if op.name == "broadcast_in_dim" and len(shape) == len(p["broadcast_dimensions"]):
    return tuple(spec[d] if shape[i] == out[d] else ()
                 for i, d in enumerate(p["broadcast_dimensions"]))
  if op.name == "transpose":
    return tuple(spec[p["permutation"].index(d)] for d in range(len(shape)))
  if op.name == "reshape":
    return _reshape(spec, out, shape)
  if "axes" in p and len(shape) == len(out) + len(p["axes"]):
    it = iter(spec)
    return tuple(() if d in p["axes"] else next(it) for d in range(len(shape)))
  return None


def _rule(op, ins: list, mesh_shape: dict) -> list:
  """The outputs' Specs (None: unknown) from the inputs' (None: unknown)."""
  name, p = op.name, op.params
  shapes = [tuple(getattr(v.aval, "shape", ())) for v in op.invars]
  outs = [tuple(getattr(v.aval, "shape", ())) for v in op.outvars]
  if name == "sharding_constraint":
    return [spec_of(p["sharding"], len(outs[0]))]
  if name == "dot_general":
    if ins[0] is None and ins[1] is None:
      return [None]
    return [_dot(p["dimension_numbers"], _known(ins, shapes), shapes)]
  if name in ("scan", "while", "cond"):
    return _loop(op, _known(ins, shapes), mesh_shape)
  if name in ("transpose", "broadcast_in_dim", "reshape", "squeeze") or (
      "axes" in p and (name.startswith("reduce_") or name.startswith("arg"))):
    return [None if ins[0] is None else _move(op, ins[0], shapes[0], outs[0])] * len(outs)
  return [_like(out, ins, shapes) for out in outs]


def _known(ins: list, shapes: list) -> list:
  return [((),) * len(s) if spec is None else spec for spec, s in zip(ins, shapes)]


def _move(op, spec: Spec, shape: tuple, out: tuple) -> Spec:
  """Ops that move, add or drop dims."""
  p = op.params
  if op.name == "transpose":
    return tuple(spec[d] for d in p["permutation"])
  if op.name == "broadcast_in_dim":
    dims = [()] * len(out)
    for src, dst in enumerate(p["broadcast_dimensions"]):
      dims[dst] = spec[src] if shape[src] == out[dst] else ()
    return tuple(dims)
  if op.name == "reshape":
    return _reshape(spec, shape, out)
  dropped = p["dimensions"] if op.name == "squeeze" else p["axes"]
  return tuple(s for d, s in enumerate(spec) if d not in dropped)


def _loop(op, ins: list, mesh_shape: dict) -> list:
  p = op.params
  if op.name == "scan":
    return _scan(p, ins, mesh_shape)
  if op.name == "while":
    return list(ins[p["cond_nconsts"] + p["body_nconsts"]:])
  return _body(p["branches"][0], ins[1:], mesh_shape)


def _body(closed, ins, mesh_shape) -> list:
  """The output Specs of a loop body or branch entered with `ins`."""
  jaxpr = getattr(closed, "jaxpr", closed)
  ops: list = []
  outs = inline(jaxpr, jaxpr.invars, ops)
  env = propagate(ops, dict(zip(jaxpr.invars, ins)), mesh_shape)
  return [env.get(v, ((),) * len(v.aval.shape)) if isinstance(v, jcore.Var)
          else ((),) * np.ndim(v.val) for v in outs]


def _sub_jaxpr(eqn):
  """The called program of a call-like op (jit, remat, custom_jvp/vjp) whose inputs and
  outputs are the op's own, else None."""
  for value in eqn.params.values():
    jaxpr = getattr(value, "jaxpr", value)
    if (isinstance(jaxpr, jcore.Jaxpr) and len(jaxpr.invars) == len(eqn.invars) and
        len(jaxpr.outvars) == len(eqn.outvars)):
      return value
  return None


def _scan(p, ins, mesh_shape) -> list:
  """A scan's body entered once with the initial carry's specs; the stacked outputs get an
  unsplit leading (iteration) dim."""
  consts, carry = p["num_consts"], p["num_carry"]
  body_ins = ins[:consts + carry] + [s[1:] for s in ins[consts + carry:]]
  outs = _body(p["jaxpr"], body_ins, mesh_shape)
  return outs[:carry] + [((),) + tuple(s) for s in outs[carry:]]


def _dot(dimension_numbers, ins, shapes) -> Spec:
  """Batch dims, then the lhs's free dims, then the rhs's, each with its operand's axes; a
  contracted dim's axes leave (its partial sums are reduced)."""
  (lc, rc), (lb, rb) = dimension_numbers
  lhs, rhs = ins[0], ins[1]
  left = [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
  right = [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
  dims = [lhs[a] or rhs[b] for a, b in zip(lb, rb)] + left + right
  # Where both operands would split the output over one axis, the larger operand (the
  # activation, usually) keeps it and the other is gathered, as GSPMD tends to choose.
  n_batch, n_left = len(lb), len(left)
  order = list(range(len(dims)))
  if math.prod(shapes[0]) < math.prod(shapes[1]):
    order = order[:n_batch] + order[n_batch + n_left:] + order[n_batch:n_batch + n_left]
  used, out = set(), [()] * len(dims)
  for i in order:
    out[i] = tuple(a for a in dims[i] if a not in used)
    used.update(out[i])
  return tuple(out)


def _reshape(spec: Spec, old: tuple, new: tuple) -> Spec:
  """Axes follow the major dim of each group of dims a reshape merges or splits."""
  out, i, j = [()] * len(new), 0, 0
  while i < len(old) and j < len(new):
    a, b, gi, gj = old[i], new[j], [i], [j]
    while a != b and a and b:
      if a < b and i + 1 < len(old):
        i += 1
        a *= old[i]
        gi.append(i)
      elif j + 1 < len(new):
        j += 1
        b *= new[j]
        gj.append(j)
      else:
        break
    src = next((d for d in gi if old[d] > 1), gi[0])
    dst = next((d for d in gj if new[d] > 1), gj[0])
    out[dst] = spec[src] if src < len(spec) else ()
    i, j = i + 1, j + 1
  return tuple(out)


def _like(shape: tuple, ins: list, shapes: list):
  """Any other op: dims the same size as an operand's of the same rank keep its axes
  (elementwise ops, slices, updates, gathers along other dims), each mesh axis on one dim;
  None if no operand of its rank is placed."""
  placed = [(spec, s) for spec, s in zip(ins, shapes)
            if spec is not None and len(s) == len(shape)]
  if not placed:
    return None
  dims: list = [()] * len(shape)
  for spec, s in placed:
    for d, (a, b) in enumerate(zip(s, shape)):
      if a == b and not dims[d]:
        dims[d] = spec[d]
  used, out = set(), []
  for axes in dims:
    out.append(tuple(a for a in axes if a not in used))
    used.update(out[-1])
  return tuple(out)
