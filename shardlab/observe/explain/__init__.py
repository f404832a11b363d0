"""Why is each collective of a compiled step there (`shardlab explain`): report.py builds
the rows (source line, pass, loop, bytes, time, what moves and the rule, a verdict);
verdicts.py says planned or not, annotations.py finds the two annotations that disagree,
compiled.py compiles with the partitioner's warnings caught, diff.py compares two steps,
text.py and html.py render.

    from shardlab.observe.explain import explain
    report = explain(step, state, batch)
"""

from shardlab.observe.explain.report import Report, Row, explain  # noqa: F401
