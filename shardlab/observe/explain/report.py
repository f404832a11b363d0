"""Why is each collective of a compiled step there? One row per collective: the source line
it comes from, forward or backward, inside which loop, kind, mesh axes, bytes per device per
step (loops counted, shardlab.observe.hlo's convention), time on a target's links, what it
moves and the rule that sharded it, and a verdict (shardlab.observe.explain.verdicts).

    report = explain(step, state, batch)      # a train step and its (abstract) arguments
    print("\\n".join(report.render()))

Counting and bytes are hlo.py's; mesh axes hlo_groups'; source lines hlo_source's; the
annotations that disagree annotations.py's. The partitioner's "Involuntary full
rematerialization" warnings go to stderr during the compile, so a step compiled here has
its fd 2 captured around `.compile()` and parsed (explain/compiled.py).
"""

import dataclasses
import math

import shardlab.observe.explain.annotations as notes_lib
import shardlab.observe.explain.compiled as explain_compile
import shardlab.observe.explain.verdicts as verdicts
from shardlab.observe import hlo, hlo_groups, hlo_source
from shardlab.runtime import hardware

DEFAULT_TARGET = "h100-80g"


@dataclasses.dataclass(frozen=True)
class Row:
  kind: str
  axes: tuple[str, ...]
  bytes: int  # per device per step
  runs: int  # executions per step
  seconds: float  # on the target's links
  verdict: str
  source: str  # "models/llama.py:109"; "" when the op carries no metadata
  via: str  # the innermost toolkit line, when it is not `source`
  backward: bool
  loop: str  # "" or "models/decoder.py:74 ×2"
  moves: str  # "params['wq'] (embed, kv_heads, head_dim)" or the per-device shape
  rule: str  # "embed → fsdp,context,expert (params)", where recovered
  hint: str  # for unplanned rows
  op: str  # the HLO instruction

  @property
  def planned(self) -> bool:
    return self.verdict in verdicts.PLANNED

  def key(self) -> tuple:
    """What identifies a row across two compiles of related programs."""
    return (self.kind, self.axes, self.source, self.backward, self.verdict, self.moves)


@dataclasses.dataclass
class Report:
  rows: list[Row]
  target: str
  warnings: list[str] = dataclasses.field(default_factory=list)
  memory_bytes: int | None = None  # XLA's peak per device; None for HLO text

  @property
  def seconds(self) -> float:
    """The collectives' time on the target's links, none of it hidden behind compute."""
    return sum(r.seconds for r in self.rows)

  @classmethod
  def from_dict(cls, d: dict) -> "Report":
    """A report read back from `as_dict` (`shardlab explain --json`): another commit's or
    machine's step to compare with (--against-report)."""
    fields = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{**{k: v for k, v in r.items() if k in fields}, "axes": tuple(r["axes"])})
            for r in d["rows"]]
    return cls(rows, d["target"], list(d.get("warnings", [])), d.get("memory_bytes"))

  @property
  def unplanned(self) -> list[Row]:
    return [r for r in self.rows if not r.planned]

  def totals(self) -> dict[str, tuple[int, float]]:
    """{verdict: (bytes, seconds)}, largest time first."""
    out: dict[str, list] = {}
    for r in self.rows:
      t = out.setdefault(r.verdict, [0, 0.0])
      t[0] += r.bytes
      t[1] += r.seconds
    return {k: tuple(v) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}

  def render(self) -> list[str]:
    from shardlab.observe.explain.text import render
    return render(self)

  def as_dict(self) -> dict:
    return {"target": self.target, "rows": [dataclasses.asdict(r) for r in self.rows],
            "totals": {k: {"bytes": b, "seconds": s} for k, (b, s) in self.totals().items()},
            "warnings": self.warnings, "memory_bytes": self.memory_bytes,
            "seconds": self.seconds}


def wire_seconds(kind: str, nbytes: int, n: int, bandwidth: float) -> float:
  """A ring over n devices: (n-1)/n of the full buffer crosses each link for gathers,
  scatters and all-to-all, twice that for an all-reduce; a permute sends its buffer once."""
  if n <= 1:
    return 0.0
  factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)
  return nbytes * factor / bandwidth


def explain(program, *args, mesh=None, rules=None, names=None, target: str = DEFAULT_TARGET,
            dcn_axes=()) -> Report:
  """The report of a step: `program` is a jitted function (or shardlab train step) called
  with `args` (arrays or ShapeDtypeStructs with shardings; compiled here, its warnings
  caught), a Lowered (compiled here), a Compiled (no warnings: they were printed when it
  compiled), or HLO text. `mesh`/`rules` default to a shardlab step's own; `names`
  (Abstract.names) gives parameters their logical names; `dcn_axes` are the mesh axes
  that cross hosts (timed at the target's DCN bandwidth instead of ICI)."""
  shardings = getattr(program, "shardings", None)
  mesh = mesh if mesh is not None else getattr(shardings, "mesh", None)
  rules = rules if rules is not None else getattr(shardings, "rules", None)
  if mesh is None:
    raise TypeError("explain needs the mesh the program runs on (mesh=)")
  c = explain_compile.compiled_text(program, args)
  text, warnings = c.text, c.warnings
  accel = hardware.get(target)
  ctx = _Context(mesh, verdicts.plan(rules), rules, verdicts.leaves(c.arguments, names),
                 notes_lib.annotations(c.debug) if c.debug else [], accel, set(dcn_axes))
  sources = hlo_source.SourceMap(text)
  computations, _ = hlo.parse(text)
  attrs = {(c, i.name): i.attrs for c, instrs in computations.items() for i in instrs}
  rows = [_row(op, sources.source(attrs.get((op.computation, op.name), "")), ctx)
          for op in hlo.collective_ops(text) if op.executions]
  rows += [explain_compile.remat_row(w, ctx, Row) for w in warnings]
  rows.sort(key=lambda r: (-r.seconds, -r.bytes, r.source))
  return Report(rows, accel.name, [w.text for w in warnings], c.memory_bytes)


@dataclasses.dataclass
class _Context:
  mesh: object
  plan: verdicts.Plan
  rules: object
  leaves: list
  notes: list
  accel: object
  dcn: set

  @property
  def sizes(self) -> dict[str, int]:
    return dict(self.mesh.shape)

  def seconds(self, kind: str, nbytes: int, axes: tuple[str, ...]) -> float:
    n = 1
    for a in axes:
      n *= self.sizes.get(a, 1)
    bw = self.accel.dcn_bw if set(axes) & self.dcn else self.accel.ici_bw
    return wire_seconds(kind, nbytes, n, bw)


def _what(op: hlo.CollectiveOp, axes: tuple[str, ...], ctx: _Context):
  """(leaf or None, moves text, rule text) for what the collective carries."""
  full = (op.operand_shapes if op.op == "reduce-scatter" else op.shapes) or ((),)
  shape = full[0]
  # A combined collective (XLA merges small ones) carries several arrays: any may match.
  hits = [(leaf, leaf.matches(tuple(s), set(axes), ctx.sizes))
          for s in full for leaf in ctx.leaves]
  # A gather must undo some dim's sharding; an exact-order match beats a permuted one.
  hits = [(leaf, dim) for leaf, dim in hits
          if dim is not None and (dim >= 0 or op.op != "all-gather")]
  for leaf, dim in hits[:1]:
    names = leaf.names
    moves = leaf.path + (f" ({', '.join(str(n) for n in names)})" if names else "")
    moves += f" and {len(full) - 1} more arrays" if len(full) > 1 else ""
    rule = ""
    if names and dim >= 0 and ctx.rules is not None:
      name = names[dim]
      table = ctx.rules.params.get(name)
      rule = f"{name} → {','.join(rules_axes(table)) or 'replicated'} (rules.params)"
    elif dim >= 0:
      rule = f"dim {dim} over {','.join(leaf.axes[dim]) or '-'}"
    return leaf, moves, rule
  dtype = op.dtypes[0] if op.dtypes else ""
  rule = ""
  if ctx.rules is not None:
    hits = [f"{n} → {','.join(rules_axes(v))}" for n, v in ctx.rules.activations.items()
            if set(rules_axes(v)) & set(axes) and n != "layers"]
    rule = "; ".join(hits) + " (rules.activations)" if hits else ""
  return None, f"{dtype}{list(shape)}", rule


def rules_axes(value) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def _row(op: hlo.CollectiveOp, source: hlo_source.Source, ctx: _Context) -> Row:
  axes = hlo_groups.mesh_axes(op.groups, ctx.mesh)
  nbytes = op.bytes * op.executions
  leaf, moves, rule = _what(op, axes, ctx)
  shapes = list(op.shapes) + list(op.operand_shapes)  # results, then operands (as many)
  elements = max((math.prod(s) for s in shapes), default=0)
  verdict = verdicts.verdict(op.op, axes, elements, leaf, source.op_name, source.backward,
                             ctx.plan)
  line = str(source.line or "")
  hint, others = "", []
  if verdict in verdicts.UNPLANNED:
    clash = notes_lib.disagreeing(ctx.notes, shapes, ctx.sizes)
    others = [f"{a.spec_text()} at {_own(a.frames)}" for a in clash]
    if len(others) >= 2:
      verdict = verdicts.RESHARDING
    hint = verdicts.hint(verdict, line or op.name, others)
  loop = ""
  if op.executions > 1 or "/while/" in source.op_name:
    call = hlo_source.loop_call(source.frames)
    loop = f"{call or 'a loop'} ×{op.executions}"
  return Row(op.op, axes, nbytes, op.executions, ctx.seconds(op.op, nbytes, axes), verdict,
             line, str(source.via or ""), source.backward, loop, moves, rule, hint, op.name)


def _own(frames) -> str:
  return str(hlo_source.user_line(frames) or "?")
