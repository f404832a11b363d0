"""`shardlab explain`: every collective of a compiled step with its source line, bytes, time
and a verdict; conflicting annotations show up as unplanned resharding naming both lines;
--against shows what another strategy (or a saved report) changed, byte for byte, with the
steps' collective time and memory; the HTML page renders."""

import json
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlab as sl
from shardlab.cli import explain as explain_cli
from shardlab.observe import step_report
from shardlab.observe.explain import compiled as explain_compile, diff as explain_diff
from shardlab.observe.explain import html as explain_html
import shardlab.observe.explain.verdicts as verdicts
from shardlab.observe.explain import explain
from shardlab.testing import assert_no_collective, assert_no_unplanned_collectives

import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("strategy", helpers.STRATEGIES)
def test_bundled_llama_collectives_are_planned_and_attributed(strategy):
  r = helpers.run(strategy)
  report = explain(r.compiled_step, mesh=r.mesh, rules=r.rules, names=r.abstract.names)
  assert report.rows, strategy
  for row in report.rows:
    path = pathlib.Path(row.source.rpartition(":")[0])
    assert row.source and (ROOT / path).resolve().is_relative_to(ROOT), row
    assert row.planned, f"{strategy}: {row}"
  assert not report.unplanned
  kinds = {row.verdict for row in report.rows}
  if strategy in ("fsdp", "fsdp_tp"):
    assert verdicts.WEIGHT_GATHER in kinds and any(
        row.verdict == verdicts.WEIGHT_GATHER and "params[" in row.moves and "embed" in row.rule
        for row in report.rows)
  if strategy in ("tp", "fsdp_tp"):
    assert verdicts.TENSOR_REDUCTION in kinds
  assert verdicts.GRAD_REDUCTION in kinds
  # Forward and backward both appear, and the layer scan's collectives say so.
  assert {row.backward for row in report.rows} == {False, True} or strategy in ("dp", "zero1")
  # The report's bytes are the compiled program's, kind by kind.
  by_kind = step_report.report(r.compiled_step, r.mesh).by_kind()
  for kind, axes in by_kind.items():
    assert sum(row.bytes for row in report.rows if row.kind == kind) == sum(axes.values())


class Mixer(nnx.Module):
  """Two activations annotations on one array: `conflict` asks for its second dim split
  over the batch axes right after the first asked for its first dim."""

  def __init__(self, rngs: nnx.Rngs, conflict: bool):
    init = nnx.initializers.normal(0.1)
    self.w1 = sl.param(init(rngs.params(), (64, 128)), ("embed", "mlp"))
    self.w2 = sl.param(init(rngs.params(), (128, 64)), ("mlp", "embed"))
    self.conflict = conflict

  def __call__(self, x):
    h = x @ self.w1
    h = sl.constrain(h, ("batch", "mlp"))  # annotation A
    h = jnp.tanh(h)
    if self.conflict:
      h = sl.constrain(h, (None, "batch"))  # annotation B
    else:
      h = sl.constrain(h, ("batch", "mlp"))  # annotation B, fixed
    return h @ self.w2


def _line(marker: str) -> int:
  lines = pathlib.Path(__file__).read_text().splitlines()
  return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))


def _mixer_step(conflict: bool):
  mesh = sl.mesh("fsdp:8")
  abstract = sl.abstract_state(lambda: Mixer(nnx.Rngs(0), conflict), optax.sgd(1e-2))
  sh = sl.shardings(abstract, sl.strategy("fsdp"), mesh)
  step = sl.train_step(lambda model, batch: jnp.mean((model(batch) - batch) ** 2), abstract,
                       sh)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       abstract.state, sh.state)
  batch = jax.ShapeDtypeStruct((32, 64), np.float32, sharding=sh.batch)
  return step, state, batch


def test_conflicting_annotations_are_an_unplanned_resharding_naming_both_lines():
  step, state, batch = _mixer_step(conflict=True)
  report = explain(step, state, batch)
  bad = report.unplanned
  assert bad and all(r.verdict in verdicts.UNPLANNED for r in bad)
  first, second = f"test_explain.py:{_line('# annotation A')}", \
      f"test_explain.py:{_line('# annotation B')}"
  named = [r for r in bad if r.verdict == verdicts.RESHARDING and first in r.hint
           and second in r.hint]
  assert named, "\n".join(report.render())
  assert all("test_explain.py:" in r.source for r in bad)  # the module's lines, not ours
  text = "\n".join(report.render())
  assert f"unplanned: {len(bad)}" in text and first in text
  with pytest.raises(AssertionError, match="unplanned collective"):
    assert_no_unplanned_collectives(report)
  # The planned ones are still recognised: the weights' gathers and gradients.
  assert {verdicts.WEIGHT_GATHER, verdicts.GRAD_REDUCTION} <= {r.verdict for r in report.rows}

  fixed = assert_no_unplanned_collectives(*_mixer_step(conflict=False))
  assert fixed.rows and not fixed.unplanned
  assert_no_collective(fixed, axis="fsdp", source=f"test_explain.py:{_line('# annotation A')}")
  with pytest.raises(AssertionError, match="over fsdp"):
    assert_no_collective(report, axis="fsdp", source="test_explain.py")


def test_against_fsdp_shows_tensor_reductions_and_smaller_gathers():
  tp = helpers.run("fsdp_tp")
  fsdp = helpers.run("fsdp", "fsdp:4,tensor:2")
  this = explain(tp.compiled_step, mesh=tp.mesh, rules=tp.rules, names=tp.abstract.names)
  other = explain(fsdp.compiled_step, mesh=fsdp.mesh, rules=fsdp.rules,
                  names=fsdp.abstract.names)
  diff = explain_diff.compare(this, other, "fsdp")
  assert any(r.verdict == verdicts.TENSOR_REDUCTION and r.axes == ("tensor",)
             for r in diff.appeared)
  shrunk = [(a, b) for a, b in diff.changed if b.verdict == verdicts.WEIGHT_GATHER]
  assert shrunk and all(b.bytes < a.bytes for a, b in shrunk)
  # Byte deltas are the compiled programs' own.
  mine = step_report.report(tp.compiled_step, tp.mesh).by_kind()
  theirs = step_report.report(fsdp.compiled_step, fsdp.mesh).by_kind()
  for kind, delta in diff.delta_by_kind().items():
    assert delta == sum(mine.get(kind, {}).values()) - sum(theirs.get(kind, {}).values())
  moved = sum(r.bytes for r in diff.appeared) - sum(r.bytes for r in diff.disappeared) + \
      sum(b.bytes - a.bytes for a, b in diff.changed)
  assert moved == sum(r.bytes for r in this.rows) - sum(r.bytes for r in other.rows)
  text = "\n".join(diff.render())
  assert "against fsdp" in text
  # The whole steps too: collective time on the target, and XLA's memory per device.
  assert diff.seconds == (this.seconds, other.seconds) and this.seconds > 0
  assert diff.memory == (step_report.report(tp.compiled_step, tp.mesh).total_bytes,
                         step_report.report(fsdp.compiled_step, fsdp.mesh).total_bytes)
  assert f"({diff.memory[0] - diff.memory[1]:+,d} B)" in text and "collective time:" in text
  # A report saved as JSON (another commit's step: --against-report) compares the same.
  saved = type(other).from_dict(json.loads(json.dumps(other.as_dict())))
  assert saved == other
  again = explain_diff.compare(this, saved, "fsdp")
  assert again.delta_by_kind() == diff.delta_by_kind() and again.memory == diff.memory


def test_the_partitioners_involuntary_rematerialization_is_an_unplanned_row():
  """A real one, not a made-up message: fsdp on data:2,fsdp:4 (the layout the issue found
  printing it). Compiled once before by another Run, so the suite's persistent compilation
  cache holds it: a cache hit would log nothing, so explain compiles past the cache."""
  cfg = helpers.make_config("fsdp", "data:2,fsdp:4")
  helpers.Run(cfg, None).compiled_step
  run = helpers.Run(cfg, None)
  report = explain(run.lowered_step, mesh=run.mesh, rules=run.rules, names=run.abstract.names)
  remat = [r for r in report.unplanned if r.verdict == verdicts.REMAT]
  assert remat and report.warnings, report.render()
  assert all("reshard" in r.hint or "constrain" in r.hint for r in remat)


def test_remat_warnings_are_parsed_into_rows():
  text = ("W0101 00:00:00.000000 1 spmd_partitioner.cc:630] [SPMD] Involuntary full "
          "rematerialization. The compiler cannot go from sharding {devices=[8,1]<=[8]} to "
          "{devices=[1,8]<=[8]} efficiently for HLO operation %tanh.3 = f32[32,128]{1,0} "
          "tanh(%dot), metadata={op_name=\"jit(f)/tanh\" source_file=\"/x/model.py\" "
          "source_line=12}. As the result, this operation will be done on the full tensor.\n"
          "I0101 00:00:00.000000 1 other.cc:1] unrelated\n")
  (w,) = explain_compile.warnings(text)
  assert (w.source, w.target, w.instruction) == ("{devices=[8,1]<=[8]}",
                                                 "{devices=[1,8]<=[8]}", "tanh.3")
  assert w.shape == "f32[32,128]" and str(w.frames[0]).endswith("model.py:12")


def _chromium() -> str | None:
  return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="the chromium binary is absent (Debian "
                    "package `chromium`; .ci/run installs it)")
def test_html_report_renders_the_same_rows_in_headless_chromium(tmp_path):
  step, state, batch = _mixer_step(conflict=True)
  report = explain(step, state, batch)
  page = tmp_path / "explain.html"
  page.write_text(explain_html.render(report))
  dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                        "--dump-dom", page.as_uri()], capture_output=True, text=True,
                       timeout=120, check=True).stdout
  body = dom.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
  rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
  assert len(rows) == len(report.rows)
  cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in rows]
  text_rows = [(r.kind, r.verdict, r.source) for r in report.rows]
  assert [(c[2], c[5], c[6].split(" (via")[0]) for c in cells] == text_rows
  assert dom.count('class="seg"') == len(report.totals())
  assert len(re.findall(r'<tr class="unplanned"', body)) == len(report.unplanned)


def test_cli_prints_text_json_and_html(tmp_path, capsys):
  page = tmp_path / "r.html"
  argv = ["--model", "tiny", "--mesh", "fsdp:8", "--strategy", "fsdp", "--set",
          "train.global_batch=8", "--set", "train.seq_len=16", "--html", str(page)]
  assert explain_cli.explain_main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["rows"] and all(r["verdict"] in verdicts.PLANNED for r in out["rows"])
  assert "<table" in page.read_text() and len(out["rows"]) == page.read_text().count("<tr>") - 1  # + the header
  assert explain_cli.explain_main(["--strategy", "nope"]) == 2
  saved = tmp_path / "saved.json"  # as if from another commit: here, the same step
  saved.write_text(json.dumps(out))
  assert explain_cli.explain_main(argv + ["--json", "--against-report", str(saved)]) == 0
  against = json.loads(capsys.readouterr().out)["against"]
  assert (against["appeared"], against["disappeared"], against["changed"]) == (0, 0, 0)
  assert set(against["delta_by_kind"].values()) == {0}
  assert against["memory_bytes"][0] == against["memory_bytes"][1] > 0
  saved.write_text("{not json")
  assert explain_cli.explain_main(argv + ["--against-report", str(saved)]) == 2
  assert "not a report written by `shardlab explain --json`" in capsys.readouterr().err
