"""Reading compiled HLO text: its computations, their instructions (opcode, operands, the
type text, attributes) and how many times each computation runs per execution of the entry
one (while loops weighted by their trip counts). shardlab.observe.hlo finds the collectives
in them, hlo_flops the matmuls, explain the source lines."""

import dataclasses
import re

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
}
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
CALLED = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|"
                     r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")

Shape = tuple[int, ...]


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


def arrays(shape: str) -> list[tuple[str, Shape]]:
  """(dtype, dims) of each array in an HLO type text, tuples flattened; () for a scalar."""
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


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
  for key, value in CALLED.findall(instr.attrs):
    if key == "to_apply" and instr.opcode != "call":
      continue  # reduction bodies hold no collectives
    for name in re.findall(r"%?([\w.\-]+)", value.strip("{}")):
      out.append((name, trips if key in ("body", "condition") else 1))
  return out


def with_runs(hlo_text: str) -> tuple[dict[str, list[Instruction]], dict[str, int]]:
  """A program's computations and how many times each runs per step (`executions`)."""
  computations, entry = parse(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, executions(computations, entry)


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
