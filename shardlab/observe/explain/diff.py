"""What changed between two explain reports: collectives that appeared, disappeared or
changed size, and the steps' collective time and memory per device. Rows are matched by what they are (kind, mesh axes, source line, pass,
verdict, what they move) and summed per match, so the byte deltas add up to the difference
of the two compiled programs' totals."""

import dataclasses

from shardlab.observe import hlo


@dataclasses.dataclass
class Diff:
  other: str
  appeared: list  # rows only in this report
  disappeared: list  # rows only in the other
  changed: list  # (other's row, this row) with different bytes
  this_rows: list
  other_rows: list
  # The whole steps: collective time on the target (s) and XLA's memory per device (bytes,
  # None where a report has none), (this, other).
  seconds: tuple = (0.0, 0.0)
  memory: tuple = (None, None)

  def delta_by_kind(self) -> dict[str, int]:
    """{kind: bytes here − bytes there}: the compiled programs' difference per kind."""
    out = {}
    for kind in hlo.KINDS:
      d = sum(r.bytes for r in self.this_rows if r.kind == kind) - \
          sum(r.bytes for r in self.other_rows if r.kind == kind)
      if d or any(r.kind == kind for r in self.this_rows + self.other_rows):
        out[kind] = d
    return out

  def render(self) -> list[str]:
    from shardlab.observe.explain.text import render_diff
    return render_diff(self)


def _merged(rows) -> dict:
  out = {}
  for r in rows:
    k = r.key()
    out[k] = r if k not in out else dataclasses.replace(
        out[k], bytes=out[k].bytes + r.bytes, seconds=out[k].seconds + r.seconds,
        runs=out[k].runs + r.runs)
  return out


def compare(this, other, label: str = "the other step") -> Diff:
  mine, theirs = _merged(this.rows), _merged(other.rows)
  appeared = [r for k, r in mine.items() if k not in theirs]
  gone = [r for k, r in theirs.items() if k not in mine]
  changed = [(theirs[k], r) for k, r in mine.items()
             if k in theirs and theirs[k].bytes != r.bytes]
  return Diff(label, appeared, gone, changed, this.rows, other.rows,
              (this.seconds, other.seconds), (this.memory_bytes, other.memory_bytes))
