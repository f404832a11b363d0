"""What a compiled step does per device: its collectives (kind, count, bytes, mesh axes) and
XLA's memory analysis — the one report type of every compiled step (training, inspect, the
planner's ahead-of-time compiles). Counting, bytes (and their conventions) and the mesh axes a
collective's replica groups span are shardlab.observe.hlo's and hlo_groups'.

    compiled = train_step.lower(state, batch).compile()
    print("\n".join(step_report.render(step_report.report(compiled, mesh))))
"""

import dataclasses

from jax.sharding import Mesh

from shardlab.observe import hlo, hlo_cycles, hlo_flops, hlo_groups, hlo_text


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
  kind: str
  axes: str  # "fsdp", "data,fsdp"; "" for a collective within one device
  count: int  # executions per step
  bytes: int  # per device per step (hlo.py's convention)
  ops: int  # instructions in the HLO


@dataclasses.dataclass(frozen=True)
class StepReport:
  """One compiled step's report, wherever it was compiled: the training loop's first step,
  `shardlab inspect --collectives`, and the planner's ahead-of-time compiles (train and
  decode steps, which also fill where, n_devices, compile_s and flops)."""
  collectives: list[CollectiveRow]
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int = 0
  # Peak host memory (offloaded state and activations); 0 where the backend reports none:
  # XLA:CPU does not tell host from device memory.
  host_bytes: int = 0
  where: str = ""  # "cpu x8" or "tpu v5e:16x16"
  n_devices: int = 0
  compile_s: float = 0.0
  flops: float = 0.0  # matmul FLOPs per device per step, loops unrolled (observe.hlo_flops)
  cycles: int = 0  # XLA:TPU's estimated cycles per step (observe.hlo_cycles); 0 elsewhere

  @property
  def total_bytes(self) -> int:
    """Peak per device: arguments + outputs not aliased to them + temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def by_kind(self) -> dict[str, dict]:
    """{kind: {axes: bytes}}."""
    out: dict[str, dict] = {}
    for row in self.collectives:
      out.setdefault(row.kind, {})[row.axes] = row.bytes
    return out

  def kinds(self) -> dict[str, dict]:
    """{kind: {"count", "bytes", "ops"}} over all axes, every kind of hlo.KINDS (zeros
    included): what the planner sets beside its formulas."""
    out = {k: {"count": 0, "bytes": 0, "ops": 0} for k in hlo.KINDS}
    for row in self.collectives:
      k = out.setdefault(row.kind, {"count": 0, "bytes": 0, "ops": 0})
      k["count"], k["bytes"], k["ops"] = (k["count"] + row.count, k["bytes"] + row.bytes,
                                          k["ops"] + row.ops)
    return out

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), total_bytes=self.total_bytes, kinds=self.kinds())

  @classmethod
  def from_dict(cls, d: dict) -> "StepReport":
    """The inverse of as_dict (the AOT compile's subprocess sends its report as JSON)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    rows = [CollectiveRow(**r) for r in d["collectives"]]
    return cls(**{k: v for k, v in d.items() if k in fields and k != "collectives"},
               collectives=rows)


def report(compiled, mesh: Mesh, where: str = "", compile_s: float = 0.0,
           flops: bool = False) -> StepReport:
  """The report of a compiled (jit(...).lower(...).compile()) step over `mesh`; `flops`
  also counts its matmul FLOPs (observe.hlo_flops) and, for a TPU program, the compiler's
  estimated cycles (observe.hlo_cycles), from one more reading of the HLO."""
  text = compiled.as_text()
  program = hlo_text.with_runs(text) if flops else None
  stats = hlo.collectives(text,
                          label=lambda op: ",".join(hlo_groups.mesh_axes(op.groups, mesh)))
  rows = [CollectiveRow(kind, axes, c.count, c.bytes, c.ops)
          for (kind, axes), c in stats.items()]
  rows.sort(key=lambda r: (hlo.KINDS.index(r.kind), -r.bytes))
  mem = compiled.memory_analysis()
  get = lambda field: int(getattr(mem, field, 0) or 0) if mem is not None else 0
  return StepReport(rows, get("argument_size_in_bytes"), get("output_size_in_bytes"),
                    get("alias_size_in_bytes"), get("temp_size_in_bytes"),
                    get("generated_code_size_in_bytes"),
                    get("host_argument_size_in_bytes") + get("host_output_size_in_bytes") -
                    get("host_alias_size_in_bytes") + get("host_temp_size_in_bytes"),
                    where or f"{mesh.devices.flat[0].platform} x{mesh.size}", mesh.size,
                    compile_s, hlo_flops.flops_of(*program) if flops else 0.0,
                    hlo_cycles.cycles_of(*program) if flops else 0)


def bytes_text(n: float) -> str:
  """'2.56 MB': decimal units, as XLA and the step report print sizes."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def render(r: StepReport, title: str = "compiled train step, per device") -> list[str]:
  lines = [f"{title}: arguments {bytes_text(r.argument_bytes)}, outputs "
           f"{bytes_text(r.output_bytes)} ({bytes_text(r.alias_bytes)} aliased to arguments), "
           f"temporaries "
           f"{bytes_text(r.temp_bytes)}, peak {bytes_text(r.total_bytes)}" +
           (f"; host memory {bytes_text(r.host_bytes)}" if r.host_bytes else "")]
  if not r.collectives:
    lines.append("  no collectives")
  for row in r.collectives:
    where = f"over {row.axes}" if row.axes else "within a device"
    lines.append(f"  {row.kind:18s} {where:22s} {row.count:5d} runs ({row.ops:3d} ops) "
                 f"{bytes_text(row.bytes):>10s}")
  return lines
