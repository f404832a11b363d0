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

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
}
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_DIMENSIONS = re.compile(r"\bdimensions=\{([\d,]*)\}")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|"
                     r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
  count: int  # executions per step (an op in a loop counts once per iteration)
  bytes: int  # per device per step, by the convention in the module docstring
  ops: int  # distinct collectives in the HLO


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the HLO type text: `f32[8,16]{1,0}`, or a tuple `(f32[8], u32[])`
  opcode: str
  operands: list[str]
  attrs: str  # the text after the operands
  args: str = ""  # the raw text between the opcode's parentheses
  computation: str = ""
  root: bool = False


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


def arrays(shape: str) -> list[tuple[str, Shape]]:
  """(dtype, dims) of each array in an HLO type text, tuples flattened; () for a scalar."""
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


def _array_bytes(dtype: str, dims: Shape) -> float:
  return math.prod(dims) * DTYPE_BYTES[dtype]


def _close(text: str, start: int) -> int:
  """Index of the parenthesis closing one opened before text[start] (len(text) if none)."""
  depth = 1
  for i in range(start, len(text)):
    depth += text[i] == "("
    depth -= text[i] == ")"
    if depth == 0:
      return i
  return len(text)


def _parse_instruction(line: str, computation: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):  # a tuple type, whose elements nest parentheses
    end = _close(rest, 1) + 1
    shape, tail = rest[:end], rest[end:].lstrip()
  else:
    shape, _, tail = rest.partition(" ")
  opcode, paren, after = tail.partition("(")
  if not paren:
    return None
  end = _close(after, 0)
  operands = re.findall(r"%([\w.\-]+)", after[:end])
  return Instruction(m.group(2), shape, opcode.strip(), operands, after[end + 1:], after[:end],
                     computation, bool(m.group(1)))


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
  """Computations by name, and the entry computation's name. An instruction whose attributes
  span lines (a Mosaic kernel's `frontend_attributes={kernel_metadata={` ... `}}`) is read
  whole: a line that starts with "}" ends its computation only outside an instruction."""
  computations, entry, current = {}, None, None
  pending, depth = "", 0
  for line in hlo_text.splitlines():
    if pending and not _INSTRUCTION.match(line):
      pending, depth = pending + "\n" + line, depth + _depth(line)
      if depth > 0:
        continue
      line, pending = pending, ""
    elif pending:  # a new instruction: the open one was not balanced after all
      _add(computations, current, pending)
      pending = ""
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("(")[0]:
      current = m.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      depth = _depth(line)
      if depth > 0:
        pending = line
        continue
      _add(computations, current, line)
  if pending:
    _add(computations, current, pending)
  return computations, entry


def _depth(line: str) -> int:
  """Brackets a line leaves open (string contents are counted too: HLO's are balanced)."""
  return line.count("{") - line.count("}") + line.count("(") - line.count(")")


def _add(computations: dict, current: str | None, line: str) -> None:
  instr = _parse_instruction(line, current) if current is not None else None
  if instr:
    computations[current].append(instr)


def _trips_from_condition(instr: Instruction, computations: dict) -> int:
  """A scan's loop condition is `i < N` with N a constant (the TPU compiler does not always
  record known_trip_count); 1 if the condition has another form."""
  m = re.search(r"condition=%?([\w.\-]+)", instr.attrs)
  cond = computations.get(m.group(1), []) if m else []
  constants = {i.name: i.args for i in cond if i.opcode == "constant"}
  for i in cond:
    if i.opcode == "compare" and "direction=LT" in i.attrs:
      for operand in i.operands:
        if constants.get(operand, "").strip().isdigit():
          return int(constants[operand])
  return 1


def _callees(instr: Instruction, computations: dict) -> list[tuple[str, int]]:
  """(computation, times per execution of `instr`) for what the instruction calls."""
  if instr.opcode in ("async-done", "async-update"):
    return []  # the same computation as its async-start, which is counted
  trips = 1
  if instr.opcode == "while":
    m = _TRIP_COUNT.search(instr.attrs)
    trips = int(m.group(1)) if m else _trips_from_condition(instr, computations)
  out = []
  for key, value in _CALLED.findall(instr.attrs):
    if key == "to_apply" and instr.opcode != "call":
      continue  # reduction bodies hold no collectives
    for name in re.findall(r"%?([\w.\-]+)", value.strip("{}")):
      out.append((name, trips if key in ("body", "condition") else 1))
  return out


def executions(computations: dict, entry: str) -> dict[str, int]:
  """How many times each computation runs per execution of the entry computation."""
  # Topological order over the call graph (a DAG), then push counts down.
  order, seen = [], set()

  def visit(name: str):
    if name in seen or name not in computations:
      return
    seen.add(name)
    for instr in computations[name]:
      for callee, _ in _callees(instr, computations):
        visit(callee)
    order.append(name)

  visit(entry)
  counts = {name: 0 for name in order}
  counts[entry] = 1
  for name in reversed(order):
    for instr in computations[name]:
      for callee, times in _callees(instr, computations):
        if callee in counts:
          counts[callee] += counts[name] * times
  return counts


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
          for key, value in _CALLED.findall(i.attrs) if key == "calls"
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
