"""Collectives in compiled HLO text: each one (kind, shapes, groups, runs per step) and totals
per kind, per device, per step.

Works on the text of any backend's optimised module (`compiled.as_text()`): CPU, GPU and TPU
spell collectives alike, synchronously (`all-gather(...)`) or as async pairs
(`all-gather-start` / `-done`, or `async-start` wrapping a computation). Instructions inside
a while body run once per iteration, so each is weighted by the loop's trip count (scan over
layers puts most collectives there). Replica groups are read by shardlab.observe.hlo_groups.

Bytes convention, the same one shardlab.plan uses: the per-device buffer on the *full* side
of the collective — all-gather: its result; reduce-scatter: its operand; all-reduce,
all-to-all, collective-permute: the buffer itself. Wire traffic per device for a ring over
n devices is (n-1)/n of that for all-gather/reduce-scatter and 2(n-1)/n for all-reduce.
"""

import dataclasses
import math
import re
from collections.abc import Callable

from shardlab.observe import hlo_groups
# The text reader, re-exported: callers read computations through this module too.
from shardlab.observe.hlo_text import (CALLED, DTYPE_BYTES, Instruction, Shape, arrays,
                                       executions, parse)

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_DIMENSIONS = re.compile(r"\bdimensions=\{([\d,]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
  count: int  # executions per step (an op in a loop counts once per iteration)
  bytes: int  # per device per step, by the convention in the module docstring
  ops: int  # distinct collectives in the HLO


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective of the module (the TPU compiler's copies of one async op count once)."""
  op: str  # one of KINDS
  name: str
  dtypes: tuple[str, ...]
  shapes: tuple[Shape, ...]  # per-device results, one per array (several if combined)
  operand_shapes: tuple[Shape, ...]
  dimensions: tuple[int, ...]
  computation: str  # the HLO computation it sits in
  executions: int  # per step; 0 where nothing calls its computation
  bytes: int  # per device per execution, by the convention in the module docstring
  channel_id: int | None
  groups_text: str = dataclasses.field(repr=False)
  n_devices: int = dataclasses.field(repr=False)

  @property
  def groups(self) -> hlo_groups.Groups:
    # Parsed on demand: counting bytes must not fail on a group form nobody asked about.
    return hlo_groups.replica_groups(self.groups_text, self.n_devices)


def _array_bytes(dtype: str, dims: Shape) -> float:
  return math.prod(dims) * DTYPE_BYTES[dtype]


def _record(instr: Instruction, local: dict[str, Instruction], runs: int,
            n_devices: int) -> CollectiveOp | None:
  """The collective `instr` is, if it is one; `local` holds its computation's instructions."""
  op = instr.opcode.removesuffix("-start")  # a -done is not counted: its -start is
  if op not in KINDS:
    return None
  results = arrays(instr.shape)
  if op == "all-reduce" and instr.computation.startswith("all-reduce-scatter"):
    # The TPU compiler fuses a reduce-scatter as all-reduce + dynamic-slice in a computation
    # it names all-reduce-scatter: a reduce-scatter whose shards are that computation's result.
    op = "reduce-scatter"
    results = next((arrays(i.shape) for i in local.values() if i.root), results)
  elif instr.opcode.endswith("-start") and op != "all-reduce":
    results = _async_result(instr, local)
  operands = [a for o in instr.operands if o in local for a in arrays(local[o].shape)]
  full = operands if op == "reduce-scatter" else results
  channel = _CHANNEL.search(instr.attrs)
  dims = _DIMENSIONS.search(instr.attrs)
  return CollectiveOp(
      op=op, name=instr.name, dtypes=tuple(d for d, _ in results),
      shapes=tuple(s for _, s in results), operand_shapes=tuple(s for _, s in operands),
      dimensions=tuple(int(x) for x in dims.group(1).split(",") if x) if dims else (),
      computation=instr.computation, executions=runs,
      bytes=int(sum(_array_bytes(d, s) for d, s in full)),
      channel_id=int(channel.group(1)) if channel else None,
      groups_text=hlo_groups.groups_text(instr.attrs), n_devices=n_devices)


def _async_result(start: Instruction, local: dict[str, Instruction]) -> list[tuple[str, Shape]]:
  """An async start's results: its -done's type, or else the part of the start's tuple
  (operands, results, context...) that follows the operands."""
  for i in local.values():
    if i.opcode.endswith("-done") and i.operands[:1] == [start.name]:
      return arrays(i.shape)
  k = sum(len(arrays(local[o].shape)) for o in start.operands if o in local)
  return arrays(start.shape)[k:2 * k]


def _call_sites(computations: dict[str, list[Instruction]]) -> dict[str, str]:
  """For each computation called through `calls=` (fusions, async wrappers): its caller."""
  return {callee: name for name, instrs in computations.items() for i in instrs
          for key, value in CALLED.findall(i.attrs) if key == "calls"
          for callee in re.findall(r"%?([\w.\-]+)", value.strip("{}"))}


def collective_ops(hlo_text: str, n_devices: int | None = None) -> list[CollectiveOp]:
  """Every collective of a module, in text order, with its executions per step. `n_devices`
  (default: from the module header) is what an empty replica group stands for."""
  computations, entry = parse(hlo_text)
  return _collective_ops(computations, entry, n_devices or hlo_groups.device_count(hlo_text))


def _collective_ops(computations: dict[str, list[Instruction]], entry: str | None,
                    n_devices: int) -> list[CollectiveOp]:
  runs = executions(computations, entry) if entry else {}
  sites = _call_sites(computations)
  out, first_seen = [], {}
  for name, instrs in computations.items():
    local = {i.name: i for i in instrs}
    for instr in instrs:
      op = _record(instr, local, runs.get(name, 0), n_devices)
      if op is None:
        continue
      # The TPU compiler splits one async collective into a start fusion, continuation
      # fusions and a done fusion, each holding a copy of the op (same channel, shapes and
      # groups, called from one computation). Channel ids alone are not unique (shard_map
      # gives all its collectives channel 1; the TPU compiler reuses them across fusions),
      # so only copies in *different* computations called from the same site are merged.
      key = (op.op, op.channel_id, sites.get(name, name), op.dtypes, op.shapes,
             op.groups_text)
      if op.channel_id is not None and first_seen.setdefault(key, name) != name:
        continue
      out.append(op)
  return out


def collectives(hlo_text: str, label: Callable[[CollectiveOp], str] | None = None) -> dict:
  """Per kind (all of KINDS, zeros included): executions, bytes per device, collectives.
  With `label` (a CollectiveOp -> str, e.g. the mesh axes of its groups): per (kind, label)
  instead, only those present. Collectives in computations nothing calls are left out."""
  computations, entry = parse(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  totals = {} if label else {k: [0, 0, 0] for k in KINDS}
  for op in _collective_ops(computations, entry, hlo_groups.device_count(hlo_text)):
    if not op.executions:
      continue
    t = totals.setdefault((op.op, label(op)) if label else op.op, [0, 0, 0])
    t[0] += op.executions
    t[1] += op.executions * op.bytes
    t[2] += 1
  return {k: Collective(c, b, o) for k, (c, b, o) in totals.items()}


def summary(stats: dict[str, Collective]) -> dict[str, dict]:
  """Plain dicts for JSON."""
  return {k: dataclasses.asdict(v) for k, v in stats.items()}
