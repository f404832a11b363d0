"""The fewest devices that fit, per strategy and overall, at the requested microbatch count and
at any that divides the batch: an ascending scan over every device count some mesh can run
on (any count, not only powers of two), with the placements search.py tells apart.
"""

import itertools
import math
import sys

from shardlab.observe.progress import Activity
from shardlab.plan.training.estimate import MAX_DEVICES, STRATEGIES, Estimate, Request
from shardlab.plan.training.estimate import split_ici_dcn
from shardlab.plan.training.search import CORE, axes_of, context_sizes, divisors
from shardlab.plan.training.search import logical_sizes, placer, rank, try_estimate
from shardlab.sharding import rules as rules_lib

LONG_SCAN = 200  # candidates (a few ms each) past which a terminal gets a progress bar
PRUNE_AT = 40  # candidates past which strategies that can never fit are ruled out first


def _axis_sizes(rules: rules_lib.Rules, dims: dict) -> dict[str, list[int]]:
  """Sizes each core axis can take: divisors of every dimension it shards (any other size
  cannot run), only 1 for an axis that shards nothing (it would be idle)."""
  out = {}
  for axis in CORE:
    g = 0
    for table in (rules.params, rules.opt_state, rules.activations, rules.working or {}):
      for name, axes in table.items():
        if name in dims and axis in axes_of(axes):
          g = math.gcd(g, dims[name])
    out[axis] = divisors(g) if g else [1]
  return out


def candidates(req: Request, model, acc, microbatches: int,
               bound: int = MAX_DEVICES) -> dict[int, list[tuple]]:
  """Device count (<= bound) -> [(strategy, mesh)]: every distinct placement without an idle
  axis whose axis sizes divide what they shard, the first strategy (in STRATEGIES order) to
  make it. A count not listed has no mesh that can run at all."""
  dims = logical_sizes(req, model, microbatches)
  by_n: dict[int, list[tuple]] = {}
  seen = set()
  for strategy in STRATEGIES:
    rules = rules_lib.strategy(strategy, req.rules)
    sizes, place = _axis_sizes(rules, dims), placer(rules, dims)
    for shape in itertools.product(sizes["tensor"], sizes["fsdp"], sizes["data"],
                                   context_sizes(req.train.seq_len)):
      t, f, d, c = shape
      shards = math.prod({"data": d, "fsdp": f}.get(a, 1) for a in rules.batch_axes)
      if d * f * t * c > bound or dims["batch"] % shards:
        continue
      axes = {"data": d, "fsdp": f, "tensor": t} | ({"context": c} if c > 1 else {})
      spec = split_ici_dcn(axes, acc.ici_domain)
      key = place(spec)
      if key is not None and key not in seen:
        seen.add(key)
        by_n.setdefault(d * f * t * c, []).append((strategy, spec))
  return dict(sorted(by_n.items()))


def _never_fit(req: Request, model, acc, by_n: dict, seen: list) -> set[str]:
  """Strategies nothing fits under. Memory only falls as the data or tensor axis grows (by a
  multiple) with fsdp and context fixed — every term is divided by them or independent of
  them — so for each fsdp and context size the mesh with the largest data and tensor axes
  bounds all the others. (Not fsdp or context: at 1 nothing is gathered.) A strategy is
  ruled out only when every such mesh is valid and does not fit."""
  groups: dict[tuple, list] = {}
  for cands in by_n.values():
    for strategy, spec in cands:
      groups.setdefault((strategy, spec.size("fsdp"), spec.size("context")), []).append(spec)
  fits = {s: False for s in STRATEGIES}
  for (strategy, *_), specs in groups.items():
    top = max(specs, key=lambda s: s.n_devices)
    if any(top.size(a) % s.size(a) for s in specs for a in ("data", "tensor")):
      fits[strategy] = True  # no single mesh bounds the group: keep scanning it
      continue
    e = try_estimate(req, model, acc, top, strategy)
    seen.append(e)
    fits[strategy] |= e is None or e.fits
  return {s for s, ok in fits.items() if not ok}


class _Floors:
  """Bytes a (strategy, mesh) holds at any microbatch count: everything but the activations
  and the token batch (the state, and the gathered weights), from an estimate already made.
  With more than one microbatch the state holds the fp32 gradient accumulator too, so a
  floor found at one microbatch bounds every count and one found at more bounds every count
  above one. Most of a fewest-devices scan's candidates at one count have a state larger
  than the device (two thirds for llama3-70b on 80 GB GPUs) and are not estimated again at
  the next; `skipped` keeps them, for the least-memory answer when nothing fits."""

  def __init__(self):
    self.floors: dict[tuple, tuple[float, bool]] = {}
    self.skipped: list[tuple[int, str, object, float]] = []

  def record(self, e: Estimate | None, microbatches: int) -> None:
    if e is not None:
      m = e.memory
      floor = m.total - m.activations - m.batch
      key = (e.strategy, e.mesh)  # the mesh as spec.describe() writes it
      if floor > self.floors.get(key, (0.0, False))[0]:
        self.floors[key] = (floor, microbatches > 1)

  def rules_out(self, strategy: str, spec, microbatches: int, usable: float) -> bool:
    floor, accumulates = self.floors.get((strategy, spec.describe()), (0.0, False))
    if floor > usable and (microbatches > 1 or not accumulates):
      self.skipped.append((microbatches, strategy, spec, floor))
      return True
    return False


def _scan(req: Request, model, acc, bound: int, every_strategy: bool,
          floors: _Floors | None = None) -> tuple[dict, list]:
  """The fewest devices (<= bound) that fit at req.train.microbatches, per strategy (or only the
  first to fit): ascending over every count a mesh can run on, stopping where it fits.
  `floors` (kept across scans at other microbatch counts) skips meshes that cannot fit."""
  by_n = candidates(req, model, acc, req.train.microbatches, bound)
  floors = floors or _Floors()
  m = req.train.microbatches
  seen: list = []
  total = sum(len(c) for c in by_n.values())
  # Ruling strategies out costs an estimate per fsdp size: worth it only for long scans.
  pending = set(STRATEGIES) - (_never_fit(req, model, acc, by_n, seen) if total > PRUNE_AT
                               else set())
  found: dict[str, Estimate] = {}
  label = f"fewest devices at {req.train.microbatches} microbatch(es)"
  with Activity(label, total=total, stream=sys.stderr) if total > LONG_SCAN else \
       _Quiet() as activity:
    for n, cands in by_n.items():
      if not pending:
        break
      fitting: dict[str, list] = {}
      for strategy, spec in (c for c in cands if c[0] in pending):
        if floors.rules_out(strategy, spec, m, acc.usable_bytes):
          continue
        e = try_estimate(req, model, acc, spec, strategy)
        seen.append(e)
        floors.record(e, m)
        if e is not None and e.fits:
          fitting.setdefault(strategy, []).append(e)
      activity.advance(len(cands))
      for strategy, es in fitting.items():
        found[strategy] = min(es, key=rank)
        pending.discard(strategy)
      if fitting and not every_strategy:
        break
  return found, [e for e in seen if e is not None]


class _Quiet:
  """Activity's interface, drawing nothing: short scans need no bar."""

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    pass

  def advance(self, n: int = 1) -> None:
    pass


def _row(e: Estimate, microbatches: int | None = None) -> dict:
  row = {"devices": e.n_devices, "strategy": e.strategy, "mesh": e.mesh, "step_s": e.step_s}
  return row if microbatches is None else {**row, "microbatches": microbatches}


def _best(rows: list[dict]) -> dict | None:
  return min(rows, key=lambda r: (r["devices"], r["step_s"])) if rows else None


def min_devices(req: Request, model, acc) -> tuple[dict, Estimate | None]:
  """The fewest devices that fit, per strategy (over every mesh it can run on — any count,
  not only powers of two — the fastest fitting one reported) and overall, at the requested
  microbatch count; "any_microbatches": the fewest at any microbatch count that divides the
  batch. Plus the estimate with the least memory seen, for the error when nothing fits."""
  floors = _Floors()
  found, seen = _scan(req, model, acc, MAX_DEVICES, every_strategy=True, floors=floors)
  out: dict = {s: (None if s not in found else
                   {k: v for k, v in _row(found[s]).items() if k != "strategy"})
               for s in STRATEGIES}
  out["overall"] = _best([_row(e) for e in found.values()])
  rows = [] if out["overall"] is None else [{**out["overall"],
                                             "microbatches": req.train.microbatches}]
  for m in divisors(req.train.global_batch):
    if m == req.train.microbatches:
      continue
    bound = rows[0]["devices"] if rows else MAX_DEVICES
    more, also = _scan(req.with_train(microbatches=m), model, acc, bound, False, floors)
    seen += also
    rows = [r for r in [_best(rows + [_row(e, m) for e in more.values()])] if r]
  out["any_microbatches"] = _best(rows)
  return out, _least(req, model, acc, seen, floors.skipped)


def _least(req: Request, model, acc, seen: list, skipped: list) -> Estimate | None:
  """The estimate with the least memory of every one the scans made or skipped: a skipped
  one is estimated where its floor is below the least seen (it might be less)."""
  least = min(seen, key=lambda e: e.memory.total) if seen else None
  for m, strategy, spec, floor in sorted(skipped, key=lambda s: s[3]):
    if least is not None and floor >= least.memory.total:
      break
    e = try_estimate(req.with_train(microbatches=m), model, acc, spec, strategy)
    if e is not None and (least is None or e.memory.total < least.memory.total):
      least = e
  return least
