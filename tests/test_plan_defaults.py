"""The planners' defaults answer the question asked: `plan train` without --devices finds the
fewest devices that fit; `plan serve` plans the model's own context and refuses a longer one;
every plan subcommand's --help shows its defaults. Analytic planner only (nothing compiled)."""

import json

import pytest

from shardlab.cli import plan as plan_cli
from shardlab.cli import plan_serve
from shardlab.plan.training import planner
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib


def plan_json(capsys, *argv: str) -> dict:
  assert plan_cli.plan_main([*argv, "--json"]) == 0, capsys.readouterr().err
  return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def llama2_70b() -> tuple[planner.Request, object, hardware.Accelerator]:
  req = planner.Request.of(model="llama2-70b", target="h100-80g")
  return req, req.model_config(), hardware.get("h100-80g")


def test_plan_train_without_devices_answers_how_many(capsys, llama2_70b):
  out = plan_json(capsys, "train", "--model", "llama2-70b")
  n, est = out["fewest_devices"]["devices"], out["estimate"]
  assert out["target"]["name"] == "h100-80g"  # today's default target
  assert out["request"]["devices"] == est["n_devices"] == n and est["fits"]
  assert est["strategy"] == out["fewest_devices"]["strategy"]
  # Independently of min_devices: every mesh and strategy the search weighs (pipelines
  # aside, which this scan leaves out) on fewer devices does not fit; on n one does.
  req, model, acc = llama2_70b
  for fewer in range(1, n):
    assert not [e for e in planner.search(req, model, acc, fewer)
                if e.mesh_shape.get("stage", 1) == 1], fewer
  assert any(e.n_devices == n for e in planner.search(req, model, acc, n))


def test_the_table_says_so_and_a_strategy_or_target_given_is_kept(capsys):
  argv = ["train", "--model", "125m", "--target", "l4-24g"]
  out = plan_json(capsys, *argv)
  est, n = out["estimate"], out["fewest_devices"]["devices"]
  assert out["target"]["name"] == "l4-24g" and est["n_devices"] == n
  assert plan_cli.plan_main(argv) == 0
  text = capsys.readouterr().out
  assert text.startswith(f"devices   {n} l4-24g: the fewest on which it fits")
  assert f"mesh      {est['mesh']} ({n} devices), strategy {est['strategy']}" in text
  out = plan_json(capsys, *argv, "--strategy", "fsdp_tp")
  assert out["estimate"]["strategy"] == "fsdp_tp" and out["estimate"]["fits"]
  assert out["estimate"]["n_devices"] == out["min_devices"]["fsdp_tp"]["devices"]
  assert plan_cli.plan_main(["train", "--model", "llama2-70b", "--strategy", "tp"]) == 2
  err = capsys.readouterr().err
  assert "strategy 'tp' fits on no count of h100-80g" in err and "fsdp fits on 32" in err


def test_the_mesh_found_reads_back_as_an_inline_mesh():
  for text in ("data:1,dcn.data:2,fsdp:8,dcn.fsdp:4,tensor:1", "data:2,fsdp:4,tensor:2",
               "data:1,fsdp:2,context:2,tensor:2,dcn.context:4"):
    spec = mesh_lib.load(text)
    again = mesh_lib.load(plan_cli.inline_mesh(spec.describe()))
    assert (again.ici, again.dcn) == (spec.ici, spec.dcn)


def test_plan_serve_defaults_to_the_models_context(capsys):
  out = plan_json(capsys, "serve", "--model", "llama2-70b")
  assert out["request"]["context"] == 4096  # llama2-70b's max_seq_len, not 8192
  assert out == plan_json(capsys, "serve", "--model", "llama2-70b", "--context", "4096")
  assert plan_json(capsys, "serve", "--model", "llama3-70b")["request"]["context"] == 8192


def test_plan_serve_refuses_a_context_past_max_seq_len(capsys):
  assert plan_cli.plan_main(["serve", "--model", "llama2-70b", "--context", "4097"]) == 2
  err = capsys.readouterr().err
  assert "--context 4097 exceeds model.max_seq_len (4096) of llama2-70b" in err
  assert "generate refuses" in err


@pytest.mark.parametrize("sub, shown", [
    ("train", ["(default: llama2-7b)", "(default: fsdp)", "(default: 256)", "(default: 2048)",
               "(default: adamw)", "(default: full)", "unset (with no --mesh): the fewest",
               "else h100-80g"]),
    ("serve", ["(default: llama3-70b)", "(default: h100-80g)", "(default: bf16)",
               "unset: the model's max_seq_len", "(default: 512)"]),
    ("longest-context", ["(default: llama2-7b)", "(default: 256)", "required here"]),
])
def test_each_plan_subcommand_shows_its_defaults(capsys, sub, shown):
  with pytest.raises(SystemExit) as done:
    plan_cli.plan_main([sub, "--help"])
  assert done.value.code == 0
  text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
  for part in shown:
    assert part in text, part
  assert "(default: None)" not in text and "(default: False)" not in text
  assert plan_serve.parser().formatter_class is plan_cli.train_parser().formatter_class
