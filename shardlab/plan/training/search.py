"""Searches over meshes: every data × fsdp × tensor (× context, for long sequences; × expert,
for a mixture of experts) factorisation × strategy that is a distinct placement with no idle
axis, fastest first (the fewest devices that fit: fewest.py).

Two candidates are one placement when every table puts every logical name on the same number
of devices inside the fast domain and across DCN (fsdp on a mesh with fsdp=1 is dp; zero1 with
data=fsdp=1 is dp): the search keeps the fastest of them. An axis of size > 1 that shards
nothing the model has only replicates work: such meshes are dropped.
"""

import math
from typing import Callable

from shardlab.errors import ConfigError
from shardlab.plan.training.estimate import STRATEGIES, Estimate, Request, estimate
from shardlab.plan.training.estimate import split_ici_dcn
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib

CORE = ("data", "fsdp", "tensor")
# Context parallelism joins a search only where each device keeps at least this many tokens
# of a sequence: below it attention's per-layer exchange outweighs what it saves.
MIN_CONTEXT_SHARD = 1024


def context_sizes(seq_len: int | None) -> list[int]:
  """Context-parallel degrees worth searching for a sequence length: 1, and each power of two
  c that the zig-zag layout can split (seq_len divisible by 2c) leaving every device at least
  MIN_CONTEXT_SHARD tokens."""
  out, c = [1], 2
  while seq_len and seq_len % (2 * c) == 0 and seq_len // c >= MIN_CONTEXT_SHARD:
    out.append(c)
    c *= 2
  return out


def factorizations(n: int, seq_len: int | None = None) -> list[dict]:
  """Every data × fsdp × tensor (× context, for a long enough `seq_len`) = n."""
  out = []
  for c in (c for c in context_sizes(seq_len) if n % c == 0):
    m = n // c
    for t in (d for d in range(1, m + 1) if m % d == 0):
      for f in (d for d in range(1, m // t + 1) if (m // t) % d == 0):
        out.append({"data": m // t // f, "fsdp": f, "tensor": t} | ({"context": c} if c > 1
                                                                     else {}))
  return out


def divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def axes_of(value) -> tuple[str, ...]:
  return (value,) if isinstance(value, str) else tuple(value or ())


def logical_sizes(req: Request, model, microbatches: int) -> dict[str, int]:
  """Each logical name's size: the model's parameter axes, the (micro)batch, the sequence."""
  return {**model.axis_sizes(), "batch": req.train.global_batch // microbatches,
          "length": req.train.seq_len, "residual_length": req.train.seq_len}


def placer(rules: rules_lib.Rules, dims: dict) -> Callable[[mesh_lib.MeshSpec], tuple | None]:
  """What a strategy puts where on a mesh, as a function of the mesh: per table and logical
  name, into how many pieces inside the fast domain and across DCN; None when an axis of
  size > 1 shards nothing. The rules are read once (a search asks about a thousand meshes
  per strategy)."""
  working = rules.params if rules.working is None else rules.working
  tables = (rules.params, rules.opt_state, rules.grads, working, rules.activations)
  rules_axes = [(i, name, axes_of(table[name])) for i, table in enumerate(tables)
                for name in sorted(n for n in table if n in dims)]

  def place(spec: mesh_lib.MeshSpec) -> tuple | None:
    shape, ici, dcn = spec.shape, spec.ici, spec.dcn
    used, out = set(), []
    for i, name, rule in rules_axes:
      axes = [a for a in rule if shape.get(a, 1) > 1]
      if axes:
        used.update(axes)
        out.append((i, name, math.prod(ici.get(a, 1) for a in axes),
                    math.prod(dcn.get(a, 1) for a in axes)))
    if any(size > 1 and axis not in used for axis, size in shape.items()):
      return None
    return tuple(out)

  return place


def staged(n: int, seq_len: int | None, dims: dict, acc) -> list[dict]:
  """Pipeline shapes for a multi-node target: a `stage` axis across nodes (it divides the
  node count and the layers; tensor and the rest stay inside), beside every factorization of
  what is left."""
  nodes = n // acc.ici_domain if n % acc.ici_domain == 0 else 1
  stages = [s for s in divisors(nodes) if s > 1 and dims.get("layers", 0) % s == 0]
  return [{"stage": s, **shape} for s in stages for shape in factorizations(n // s, seq_len)]


def expert_shapes(n: int, seq_len: int | None, dims: dict) -> list[dict]:
  """Expert-parallel shapes for a mixture of experts: an `expert` axis dividing the experts
  (and n), beside every factorization of what is left."""
  sizes = [e for e in divisors(dims.get("experts", 1)) if e > 1 and n % e == 0]
  return [{"expert": e, **shape} for e in sizes for shape in factorizations(n // e, seq_len)]


def rank(e: Estimate) -> tuple:
  """Fastest first; among equal step times (compute-bound), less communication, then less
  memory."""
  return (round(e.step_s, 9), e.comm_s, e.memory.total)


def try_estimate(req: Request, model, acc, spec, strategy: str) -> Estimate | None:
  try:
    return estimate(req, model, acc, spec, strategy)
  except ConfigError:
    return None


def search(req: Request, model, acc, n: int,
           strategies: tuple[str, ...] = STRATEGIES) -> list[Estimate]:
  """Every distinct placement on n devices that is valid and fits, fastest (analytically)
  first; of candidates with the same placement, the fastest."""
  best: dict[tuple, Estimate] = {}
  dims = logical_sizes(req, model, req.train.microbatches)
  for strategy in strategies:
    place = placer(rules_lib.strategy(strategy, req.rules), dims)
    for shape in (factorizations(n, req.train.seq_len) + staged(n, req.train.seq_len, dims, acc) +
                  expert_shapes(n, req.train.seq_len, dims)):
      spec = split_ici_dcn(shape, acc.ici_domain)
      key = place(spec)
      e = None if key is None else try_estimate(req, model, acc, spec, strategy)
      if e is not None and e.fits and (key not in best or rank(e) < rank(best[key])):
        best[key] = e
  return sorted(best.values(), key=rank)
