"""An explain report as one self-contained HTML page: the rows in a table that sorts by any
column (a click on its header), and a bar of time by verdict. No external files or scripts."""

import html

from shardlab.observe.explain.text import seconds_text
from shardlab.observe.explain.verdicts import UNPLANNED
from shardlab.observe.step_report import bytes_text

COLUMNS = ("time", "bytes", "kind", "mesh axes", "pass", "verdict", "source", "loop", "moves",
           "rule", "hint")
_COLORS = ("#4e79a7", "#59a14f", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#bab0ac",
           "#ff9da7", "#86bcb6")
_UNPLANNED_COLOR = "#e15759"

_SCRIPT = """
document.querySelectorAll("th").forEach((th, col) => th.addEventListener("click", () => {
  const body = th.closest("table").tBodies[0];
  const up = th.dataset.dir !== "asc"; th.dataset.dir = up ? "asc" : "desc";
  const key = td => td.dataset.sort !== undefined ? parseFloat(td.dataset.sort) : td.textContent;
  [...body.rows].sort((a, b) => {
    const x = key(a.cells[col]), y = key(b.cells[col]);
    return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
  }).forEach(r => body.appendChild(r));
}));
"""


def _cells(r) -> list[tuple[str, float | None]]:
  return [(seconds_text(r.seconds), r.seconds), (bytes_text(r.bytes), r.bytes), (r.kind, None),
          (",".join(r.axes) or "-", None), ("bwd" if r.backward else "fwd", None),
          (r.verdict, None), (r.source + (f" (via {r.via})" if r.via else ""), None),
          (r.loop, None), (r.moves, None), (r.rule, None), (r.hint, None)]


def _bar(report) -> str:
  totals = report.totals()
  whole = sum(s for _, s in totals.values()) or 1.0
  parts, legend = [], []
  for i, (verdict, (_, s)) in enumerate(totals.items()):
    color = _UNPLANNED_COLOR if verdict in UNPLANNED else _COLORS[i % len(_COLORS)]
    title = html.escape(f"{verdict}: {seconds_text(s)}")
    parts.append(f'<div class="seg" style="width:{100 * s / whole:.3f}%;background:{color}" '
                 f'title="{title}"></div>')
    legend.append(f'<span class="key"><i style="background:{color}"></i>{title}</span>')
  return f'<div class="bar">{"".join(parts)}</div><p>{" ".join(legend)}</p>'


def render(report, title: str = "shardlab explain") -> str:
  head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
  rows = []
  for r in report.rows:
    cls = "" if r.planned else ' class="unplanned"'
    cells = "".join(f'<td data-sort="{v}">{html.escape(t)}</td>' if v is not None
                    else f"<td>{html.escape(t)}</td>" for t, v in _cells(r))
    rows.append(f"<tr{cls}>{cells}</tr>")
  unplanned = len(report.unplanned)
  return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 2px 6px; }}
th {{ cursor: pointer; background: #eee; }} tr.unplanned td {{ background: #fde2e2; }}
.bar {{ display: flex; height: 22px; width: 100%; border: 1px solid #999; }}
.key i {{ display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Collectives per device per step, timed on {html.escape(report.target)};
{len(report.rows)} collectives, {unplanned} unplanned.</p>
<h2>Time by verdict</h2>
{_bar(report)}
<table id="collectives"><thead><tr>{head}</tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<script>{_SCRIPT}</script>
</body></html>
"""
