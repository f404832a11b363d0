"""The README's `shardlab plan train ... --search --compile` (issue 34, item 3), with XLA:CPU's
compile replaced by a report that has its bf16 habit: the exact state, and temporaries
beyond the target's memory (XLA:CPU holds bf16 in fp32 buffers). The search must compile only
its top rows, not call the formula's top mesh "does not fit" over temporaries that are not
the target's, pick the search's top row where the compiled programs tie, and print one unit."""

import json
import re

import pytest

from shardlab import cli
from shardlab.observe.step_report import StepReport
from shardlab.plan.auto import choice as auto_choice
from shardlab.plan.compiled import aot
from shardlab.runtime.units import GiB
from shardlab.sharding import mesh as mesh_lib

README = ["plan", "train", "--model", "llama2-70b", "--target", "a100-80g", "--devices", "128",
          "--global-batch", "256", "--seq-len", "4096", "--search", "--compile"]
# The same question at a size whose formula search takes a second, not several.
SMALL = ["plan", "train", "--model", "llama2-7b", "--target", "a100-80g", "--devices", "16",
         "--global-batch", "32", "--seq-len", "2048", "--search", "--compile"]


@pytest.fixture
def compiles(monkeypatch):
  """Each compile's (mesh, precision); the report: 3 GiB of state, 100 GiB of temporaries,
  the same FLOPs for every mesh (the compiled steps tie, as the real ones do here)."""
  seen = []

  def compile_on_cpu(cfg, n_devices):
    seen.append((cfg.mesh, cfg.train.precision))
    return StepReport(collectives=[], argument_bytes=3 * GiB, output_bytes=0, alias_bytes=0,
                      temp_bytes=100 * GiB, where=f"cpu x{n_devices}", n_devices=n_devices,
                      flops=1e15)

  monkeypatch.setattr(aot, "compile_on_cpu", compile_on_cpu)
  return seen


def _same_mesh(a: str, b: str) -> bool:
  x, y = mesh_lib.load(a), mesh_lib.load(b)
  norm = lambda part: {k: v for k, v in part.items() if v != 1}
  return (norm(x.ici), norm(x.dcn)) == (norm(y.ici), norm(y.dcn))


def test_readme_search_compile_picks_the_top_row(capsys, compiles):
  assert cli.main(README + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert len(compiles) == 2  # --compile-top 2: the top rows only, not until 4 fit
  assert {p for _, p in compiles} == {"bf16"}
  search, choice = out["search"], out["compiled_search"]
  top = search[0]
  winner = choice["winner"]
  assert winner["verdict"] == "fits"
  assert winner["strategy"] == top["strategy"]
  assert _same_mesh(winner["mesh"], cli.plan_cli.inline_mesh(top["mesh"]))
  compiled = [c for c in choice["candidates"] if c["compiled_bytes"] is not None]
  assert [c["verdict"] for c in compiled] == ["fits", "fits"]
  # The two programs' dots and collectives tie; the top row's FSDP over all 128 GPUs holds
  # half the optimizer state a GPU of the runner-up (a data axis of 2) does, so its update
  # is shorter: it leads by that, under 1%.
  runner, = [c for c in compiled if c != winner]
  lead = runner["predicted_step_s"] / winner["predicted_step_s"]
  assert 1 < lead < 1.01, lead
  assert re.search(r", 0\.\d% ahead of fsdp on \S*dcn\.data:2", choice["reason"]), choice["reason"]


def test_a_tie_goes_to_the_formulas_order_and_says_so():
  def candidate(mesh: str) -> auto_choice.Candidate:
    report = StepReport(collectives=[], argument_bytes=GiB, output_bytes=0, alias_bytes=0,
                        temp_bytes=GiB)
    return auto_choice.Candidate(auto_choice.Option("fsdp", mesh, "full", 1), None, None,
                                 report, 2.0, "compute", "fits", memory_judged=False)
  first, second = candidate("fsdp:8"), candidate("data:2,fsdp:4")
  choice = auto_choice.Choice(first, (first, second), None, 8, 0.0)
  assert choice.reason().endswith("; as fast as fsdp on data:2,fsdp:4, it ranked first by "
                                  "formula"), choice.reason()


def test_fp32_temporaries_are_judged(capsys, compiles):
  """Under fp32 XLA:CPU's buffers are the target's: 100 GiB of them do not fit 79."""
  assert cli.main(SMALL + ["--precision", "fp32"]) == 2
  assert "no candidate fits by XLA's memory analysis" in capsys.readouterr().err
  assert compiles and {p for _, p in compiles} == {"fp32"}


def test_state_over_the_target_does_not_fit(capsys, monkeypatch):
  """What is judged under bf16 on CPU is exact: a state over the target's memory fails."""
  def compile_on_cpu(cfg, n_devices):
    return StepReport(collectives=[], argument_bytes=90 * GiB, output_bytes=0,
                      alias_bytes=0, temp_bytes=0, n_devices=n_devices, flops=1e15)

  monkeypatch.setattr(aot, "compile_on_cpu", compile_on_cpu)
  assert cli.main(SMALL + ["--compile-top", "1", "--compile-budget-s", "1e-9"]) == 2
  assert "does not fit: state 90.00 GiB > 79.00 GiB" in capsys.readouterr().err


def test_one_unit_of_memory(capsys, compiles):
  """Memory in GiB throughout (GB only in bandwidths, GB/s)."""
  assert cli.main(SMALL) == 0
  out = capsys.readouterr().out
  assert "GiB" in out and not re.search(r"\d ?(GB|MB|kB)\b(?!/s)", out)
  assert "its compiled totals are shown, not judged" in out


def test_the_planner_search_is_reused(monkeypatch):
  """--search --compile ranks the planner's own search instead of running it again."""
  from shardlab.cli import plan as plan_cli
  from shardlab.plan.auto import choice
  from shardlab.plan.training import planner, search
  from shardlab.runtime import hardware
  req = plan_cli.request_from_args(plan_cli.train_parser().parse_args(SMALL[2:]))
  model, acc = req.model_config(), hardware.get(req.target)
  found = search.search(req, model, acc, 16)
  fresh = choice.options(req, model, acc, 16, None, None, False)
  monkeypatch.setattr(choice, "search", lambda *a, **k: pytest.fail("searched again"))
  reused = choice.options(req, model, acc, 16, None, None, False, found=found)
  assert len(fresh) > 10
  assert [(c.option, c.estimate) for c in reused] == [(c.option, c.estimate) for c in fresh]
