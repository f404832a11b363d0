"""The table of which settings combine (shardlab/training/combinations.py): each row is
(setting, setting) → verdict, "ok", "refused: <regex>" (the first refusal's message) or
"warning: <regex>" (a warning, nothing refused). The rows call the check directly on a mesh
shape (nothing is built, traced or compiled); a few CLI rows check that the commands refuse
the same in-process, with exit 2 and the message. docs/guarantees.md lists the verdicts.
"""

import dataclasses
import math
import re

import pytest

import helpers as H
from shardlab import config, generate
from shardlab.cli import inspect as inspect_cli
from shardlab.cli import plan as plan_cli
from shardlab.cli import train as train_cli
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.plan.serving import planner as serve_planner
from shardlab.plan.serving import terms as serve_terms
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.training import combinations

MODEL = dataclasses.replace(H.MICRO, n_layers=4)  # dense, 4 layers: 2 or 4 stages divide it
MOE = registry.load("moe-tiny")  # 4 layers, 8 experts, no LoRA targets
GPT2 = registry.load("gpt2-tiny")  # LoRA targets without a gate
PIPE = "stage:2,fsdp:4"
LORA = config.LoraConfig(rank=2, alpha=4.0)


def cfg_of(mesh: str = "fsdp:8", strategy: str = "fsdp", model=MODEL, lora=None, **train):
  cfg = H.make_config(strategy, mesh, model, **train)
  return dataclasses.replace(cfg, lora=lora) if lora else cfg


# name: (config settings, verdict)
ROWS = {
    # pipeline × …
    "pipeline × gpipe": (dict(mesh=PIPE, microbatches=4), "ok"),
    "pipeline × circular": (dict(mesh=PIPE, microbatches=2, pipeline_repeats=2), "ok"),
    "pipeline × context": (
        dict(mesh="stage:2,context:2,fsdp:2", microbatches=2),
        r"refused: a pipeline \(stage 2: .*\) does not run with context parallelism \(context "
        r"2: .*set the mesh's `stage` or `context` axis to 1"),
    "pipeline × moe": (
        dict(mesh=PIPE, model=MOE, microbatches=4),
        r"refused: model 'moe-tiny' is a mixture of experts \(model.n_experts=8\): its layers "
        r"return statistics .* pipeline \(stage 2.*turn the pipeline off"),
    "pipeline × offload opt_state": (
        dict(mesh=PIPE, microbatches=4, offload="opt_state"),
        r"refused: train.offload=opt_state does not run with a pipeline \(stage 2.*"
        r"use train.offload=none"),
    "pipeline × remat offload": (
        dict(mesh=PIPE, microbatches=4, remat="offload"),
        r"refused: train.remat=offload does not run in a pipeline \(stage 2.*"
        r"use train.remat=full"),
    "pipeline × 1f1b + repeats": (
        dict(mesh=PIPE, microbatches=4, pipeline_schedule="1f1b", pipeline_repeats=2),
        r"refused: train.pipeline_schedule=1f1b runs one layer group per stage; "
        r"train.pipeline_repeats=2 .* set train.pipeline_repeats=1"),
    "pipeline × layers": (
        dict(mesh="stage:4,fsdp:2", model=dataclasses.replace(MODEL, n_layers=6)),
        r"refused: model.n_layers \(6\) must be divisible by the pipeline stages × "
        r"train.pipeline_repeats \(4 × 1 = 4\)"),
    "pipeline × circular short of microbatches": (
        dict(mesh=PIPE, microbatches=1, pipeline_repeats=2),
        r"refused: a circular pipeline \(train.pipeline_repeats=2\) needs train.microbatches "
        r">= the stages \(2\), got 1"),
    # the same settings without a pipeline
    "no pipeline × moe": (dict(model=MOE), "ok"),
    "no pipeline × remat offload": (dict(remat="offload"), "ok"),
    "no pipeline × offload opt_state": (dict(offload="opt_state"), "ok"),
    # LoRA × architecture
    "lora × llama": (dict(lora=LORA), "ok"),
    "lora × moe (no targets)": (
        dict(model=MOE, lora=LORA),
        r"refused: lora.targets q, .* not offered by model moe-tiny; valid: none \(no LoRA\): "
        r"it offers no LoRA targets, so set lora.rank=0"),
    "lora × target not offered": (
        dict(lora=dataclasses.replace(LORA, targets="q,qq")),
        r"refused: lora.targets qq not offered by model micro; valid: q, k, v, o, gate, up, "
        r"down$"),
    "lora × gpt2 (no gate)": (
        dict(model=GPT2, lora=LORA),
        r"refused: lora.targets gate not offered by model gpt2-tiny; valid: q, k, v, o"),
    # context × the sequence
    "context × seq_len": (
        dict(mesh="context:4,fsdp:2", seq_len=12),
        r"refused: train.seq_len \(12\) must be divisible by 2 × the context-parallel degree "
        r"\(4\)"),
    # expert axis × model
    "expert × dense model": (dict(mesh="expert:2,fsdp:4"), "ok"),  # a batch axis there
    "expert × moe": (dict(mesh="expert:8", model=MOE), "ok"),
    "expert × moe not dividing": (
        dict(mesh="expert:3,fsdp:1", model=MOE),
        r"refused: model.n_experts \(8\) must be divisible by the expert-parallel degree \(3"),
}

# strategy × mesh axis: which axes each strategy leaves idle (no rule splits over them).
IDLE = {"dp": {"tensor"}, "zero1": {"tensor"}, "zero2": {"tensor"}, "fsdp": {"tensor"},
        "tp": set(), "fsdp_tp": set(), "tp_sp": set(), "fsdp_tp_sp": set()}
for _strategy, _idle in IDLE.items():
  for _axis in mesh_lib.AXES:
    _mesh = "data:2,fsdp:4" if _axis == "data" else f"{_axis}:2,data:4"
    ROWS[f"{_strategy} × {_axis}"] = (
        dict(strategy=_strategy, mesh=_mesh),
        f"warning: mesh axis {_axis} \\(size 2\\) is split by no rule of strategy "
        f"{_strategy}: .* use a strategy that splits over it" if _axis in _idle else "ok")


def verdict(review: combinations.Review) -> str:
  if review.refusals:
    return f"refused: {review.refusals[0]}"
  return "\n".join(f"warning: {w.removeprefix('warning: ')}" for w in review.warnings) or "ok"


def test_every_strategy_is_in_the_table():
  assert set(IDLE) == set(rules_lib.STRATEGIES)


@pytest.mark.parametrize("row", ROWS)
def test_combination(row):
  settings, expected = ROWS[row]
  cfg = cfg_of(**settings)
  got = verdict(combinations.review(cfg, mesh_lib.load(cfg.mesh).shape))
  if expected == "ok":
    assert got == "ok"
  else:
    assert re.search(expected, got), got
  if expected.startswith("refused"):  # check raises what review lists first
    with pytest.raises(ConfigError):
      combinations.check(cfg, mesh_lib.load(cfg.mesh).shape)


def test_review_lists_every_refusal():
  """pipeline × context × remat offload × LoRA on a model without targets: all four."""
  cfg = cfg_of(mesh="stage:2,context:2,fsdp:2", model=MOE, lora=LORA, microbatches=2,
               remat="offload")
  found = combinations.review(cfg, mesh_lib.load(cfg.mesh).shape)
  assert len(found.refusals) == 2  # model settings (LoRA); the pipeline's first (remat)
  assert "offers no LoRA targets" in str(found.refusals[0])
  assert "train.remat=offload" in str(found.refusals[1])


# The bounds of generate and the serving planner: (what, verdict).
BOUNDS = {
    "generate seed 99999999999": (lambda: generate.Sampling(seed=99999999999),
                                  r"refused: seed must be in \[0, 2\*\*31\), got 99999999999"),
    "generate seed -1": (lambda: generate.Sampling(seed=-1), r"refused: seed must be in"),
    "generate seed 2**31 - 1": (lambda: generate.Sampling(seed=2**31 - 1), "ok"),
    "generate temperature nan": (lambda: generate.Sampling(temperature=math.nan),
                                 r"refused: temperature must be a finite number >= 0"),
    "generate temperature inf": (lambda: generate.Sampling(temperature=math.inf),
                                 r"refused: temperature must be a finite number >= 0"),
    "generate temperature 0": (lambda: generate.Sampling(temperature=0.0), "ok"),
    "serve 3 devices × 80 layers": (
        lambda: serve_planner.plan(serve_terms.Request(model="llama2-70b", devices=3)),
        r"refused: no layout of 3 devices .* the stages must divide its 80 layers"),
    "serve stage 3 × 80 layers": (
        lambda: serve_planner.plan(serve_terms.Request(model="llama2-70b",
                                                       mesh="tensor:8,stage:3")),
        r"refused: mesh 'tensor:8,stage:3': stage 3 does not divide llama2-70b's 80 layers"),
    "serve stage 4 × 80 layers": (
        lambda: serve_planner.plan(serve_terms.Request(model="llama2-70b",
                                                       mesh="tensor:8,stage:4")), "ok"),
}


@pytest.mark.parametrize("row", BOUNDS)
def test_bound(row):
  make, expected = BOUNDS[row]
  try:
    make()
    got = "ok"
  except ConfigError as e:
    got = f"refused: {e}"
  assert got == "ok" if expected == "ok" else re.search(expected, got), got


def test_the_serving_planner_never_weighs_uneven_stages(monkeypatch):
  """Every layout the planner estimates (fewest devices, and on a given count) splits the
  layers evenly: llama3-405b's 126 layers need many stages, and 4, 5, 8 … do not divide them."""
  real, stages = serve_planner.inf_estimate.estimate, []

  def estimate(req, model, acc, layout):
    stages.append(layout.stage)
    return real(req, model, acc, layout)

  monkeypatch.setattr(serve_planner.inf_estimate, "estimate", estimate)
  req = serve_terms.Request(model="llama3-405b")
  serve_planner.plan(req)
  serve_planner.plan(dataclasses.replace(req, devices=48))
  assert max(stages) > 8 and all(126 % s == 0 for s in stages), sorted(set(stages))


# The commands refuse the same, in-process: exit 2 and the message on stderr (a single
# option's range is argparse's to refuse: tests/test_cli_bounds.py).
CLI = {
    "train pipeline × context": (
        train_cli.train_main, ["--model", "tiny", "--mesh", "stage:2,context:4", "--steps",
                               "1", "--quiet"], r"does not run with context parallelism"),
    "train pipeline × moe": (
        train_cli.train_main, ["--model", "moe-tiny", "--mesh", PIPE, "--steps", "1",
                               "--quiet"], r"mixture of experts .* pipeline"),
    "inspect pipeline × moe": (
        inspect_cli.inspect_main, ["--model", "moe-tiny", "--mesh", PIPE],
        r"mixture of experts .* pipeline"),
    "plan pipeline × context": (
        plan_cli.plan_main, ["--model", "tiny", "--mesh", "stage:2,context:4"],
        r"does not run with context parallelism"),
    "plan serve --devices 3": (plan_cli.plan_main,
                               ["serve", "--model", "llama2-70b", "--devices", "3"],
                               r"the stages must divide its 80 layers"),
}


@pytest.mark.parametrize("row", CLI)
def test_cli_refuses(row, capsys):
  main, argv, message = CLI[row]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert re.search(message, err) and "Traceback" not in err, err
