"""The text form of an explain report (shardlab.observe.explain), and of a comparison."""

from shardlab.observe.step_report import bytes_text


def seconds_text(s: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
    if s >= scale:
      return f"{s / scale:.2f} {unit}"
  return f"{s * 1e9:.0f} ns"


def row_line(r) -> str:
  where = ",".join(r.axes) or "-"
  phase = "bwd" if r.backward else "fwd"
  line = (f"{seconds_text(r.seconds):>10s} {bytes_text(r.bytes):>10s} {r.kind:18s} "
          f"{where:14s} {phase} {r.verdict:28s} {r.source}")
  extra = [x for x in (f"via {r.via}" if r.via else "", f"in {r.loop}" if r.loop else "",
                       f"moves {r.moves}" if r.moves else "", r.rule) if x]
  return line + ("  [" + "; ".join(extra) + "]" if extra else "")


def render(report) -> list[str]:
  lines = [f"collectives of the compiled step, per device per step, timed on "
           f"{report.target} (sorted by time):",
           f"{'time':>10s} {'bytes':>10s} {'kind':18s} {'mesh axes':14s} pass "
           f"{'verdict':28s} source"]
  lines += [row_line(r) for r in report.rows] or ["  no collectives"]
  lines.append("totals by verdict:")
  for verdict, (b, s) in report.totals().items():
    lines.append(f"  {verdict:30s} {bytes_text(b):>10s} {seconds_text(s):>10s}")
  unplanned = report.unplanned
  lines.append(f"unplanned: {len(unplanned)}")
  lines += [f"  {r.source or r.op}: {r.verdict}: {r.hint}" for r in unplanned]
  return lines


def render_diff(diff) -> list[str]:
  lines = [f"against {diff.other}: {len(diff.appeared)} appeared, {len(diff.disappeared)} "
           f"disappeared, {len(diff.changed)} changed size"]
  for label, rows in (("+", diff.appeared), ("-", diff.disappeared)):
    lines += [f"  {label} {row_line(r)}" for r in rows]
  for a, b in diff.changed:
    lines.append(f"  ~ {bytes_text(a.bytes)} → {bytes_text(b.bytes)} "
                 f"({b.bytes - a.bytes:+,d} B) {b.kind} over {','.join(b.axes) or '-'} "
                 f"{b.verdict} {b.source}")
  lines.append("bytes by kind (this − other): " + ", ".join(
      f"{k} {v:+,d} B" for k, v in diff.delta_by_kind().items()))
  (mine, theirs) = diff.seconds
  lines.append(f"collective time: {seconds_text(theirs)} → {seconds_text(mine)} "
               f"({'+' if mine >= theirs else '-'}{seconds_text(abs(mine - theirs))})")
  if None not in diff.memory:
    mine, theirs = diff.memory
    lines.append(f"memory per device (XLA): {bytes_text(theirs)} → {bytes_text(mine)} "
                 f"({mine - theirs:+,d} B)")
  return lines
