"""Assertions about why a compiled step communicates (shardlab.observe.explain): nothing
unplanned, and no collective over a given mesh axis from a given line or function."""

import shardlab.observe.explain.report as explain_lib


def _report(program, args, **kw) -> explain_lib.Report:
  if isinstance(program, explain_lib.Report):
    return program
  return explain_lib.explain(program, *args, **kw)


def assert_no_unplanned_collectives(program, *args, mesh=None, rules=None,
                                    names=None) -> explain_lib.Report:
  """Every collective of the step is one its strategy implies (no resharding, replicated
  intermediate or involuntary rematerialization). `program`: as for explain (a shardlab
  train step with its arguments, a jitted function with its arguments, a Lowered, a
  Compiled) or an explain Report. Returns the report."""
  report = _report(program, args, mesh=mesh, rules=rules, names=names)
  bad = report.unplanned
  if bad:
    lines = [f"  {r.kind} over {','.join(r.axes) or '-'} ({r.bytes:,} B/step) at "
             f"{r.source or r.op}: {r.verdict}; {r.hint}" for r in bad]
    raise AssertionError(f"{len(bad)} unplanned collective(s):\n" + "\n".join(lines))
  return report


def assert_no_collective(program, *args, axis: str | None = None, source: str | None = None,
                         kind: str | None = None, mesh=None,
                         rules=None) -> explain_lib.Report:
  """No collective over mesh axis `axis` (any, if None) whose source line — or the toolkit
  line it goes through — contains `source` ("models/llama.py:109", "mlp.py", or a function
  name as it appears in a frame), of `kind` if given ("all-gather")."""
  report = _report(program, args, mesh=mesh, rules=rules)
  bad = [r for r in report.rows
         if (axis is None or axis in r.axes) and (kind is None or r.kind == kind)
         and (source is None or source in r.source or source in r.via)]
  if bad:
    lines = [f"  {r.kind} over {','.join(r.axes) or '-'} ({r.bytes:,} B/step) at "
             f"{r.source}: {r.verdict}" for r in bad]
    raise AssertionError(f"{len(bad)} collective(s) over {axis or 'any axis'} from "
                         f"{source or 'anywhere'}:\n" + "\n".join(lines))
  return report
