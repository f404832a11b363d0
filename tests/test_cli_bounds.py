"""Every number a command, the pytest plugin or a config section reads has one declared range
(shardlab/bounds.py): a value outside it, NaN or inf is refused before anything runs, naming
the option (or field), the value and the range. test_cli_help.py checks that every numeric
option has such a declaration; this file checks that each one refuses what it should."""

import dataclasses
import math
import re
import types

import pytest

from shardlab import cli, config, generate
from shardlab.bounds import Float, Int
from shardlab.cli import data as data_cli
from shardlab.cli import plan as plan_cli
from shardlab.cli.generate import generate_parser
from shardlab.cli.train import train_parser
from shardlab.errors import ConfigError
from shardlab.testing import plugin

# (the command's argv before the option, after it): inputs that fail fast should a bound be
# missing (no such model, checkpoint or file), so a missing one fails the test, not a run.
TRAIN = (["train", "--model", "no-such-model", "--quiet"], [])
PLAN = (["plan", "train", "--model", "no-such-model"], [])
SERVE = (["plan", "serve", "--model", "no-such-model"], [])
LONGEST = (["plan", "longest-context", "--model", "no-such-model"], [])
GENERATE = (["generate", "--checkpoint", "no-such-checkpoint"], [])
PREPARE = (["data", "prepare", "no-such-source", "no-such-out"], [])
BPE = (["data", "train-bpe", "no-such-source", "no-such-out.json"], [])
TO_HF = (["convert", "to-hf", "no-such-checkpoint", "no-such-out"], [])
FROM_HF = (["convert", "from-hf", "no-such-hf-dir", "no-such-out"], [])
INSPECT = (["inspect", "--model", "no-such-model"], [])
EXPLAIN = (["explain", "--model", "no-such-model"], [])
LAUNCH = (["launch", "-n", "1"], ["--", "true"])
SLURM = (["launch", "--slurm", "--gpus-per-node", "1"], ["--", "true"])

# (command, option, value, what its error says is valid: the kind of number and the range)
I, F = "an integer {}".format, "a finite number {}".format
REFUSED = [
    (TRAIN, "--steps", "0", I(">= 1")), (TRAIN, "--seed", "-1", I("in [0, 2**63)")),
    (TRAIN, "--eval-every", "-1", I(">= 0")), (TRAIN, "--eval-batches", "0", I(">= 1")),
    (TRAIN, "--sample-tokens", "-1", I(">= 0 (0: none)")),
    (TRAIN, "--stop-after", "0", I(">= 1")),
    (TRAIN, "--num-processes", "0", I(">= 1")), (TRAIN, "--process-id", "-1", I(">= 0")),
    (TRAIN, "--init-timeout", "nan", F(">= 1 (seconds)")),
    (TRAIN, "--heartbeat-timeout", "1", F(">= 2 (seconds; heartbeats are 1 s apart)")),
    (TRAIN, "--auto-top", "0", I(">= 1")), (TRAIN, "--auto-budget-s", "inf", F("> 0")),
    (TRAIN, "--simulate-devices", "0", I(">= 1")), (TRAIN, "--steps", "2.5", I(">= 1")),
    (PLAN, "--global-batch", "0", I(">= 1")), (PLAN, "--seq-len", "-5", I(">= 1")),
    (PLAN, "--microbatches", "0", I(">= 1")), (PLAN, "--devices", "0", I(">= 1")),
    (PLAN, "--top", "-1", I(">= 1")), (PLAN, "--compile-top", "0", I(">= 1")),
    (PLAN, "--compile-budget-s", "nan", F("> 0")), (LONGEST, "--devices", "0", I(">= 1")),
    (SERVE, "--batch", "0", I(">= 1")), (SERVE, "--context", "0", I(">= 1")),
    (SERVE, "--prefill-batch", "0", I(">= 1")), (SERVE, "--prefill-chunk", "0", I(">= 1")),
    (SERVE, "--devices", "-8", I(">= 1")),
    (GENERATE, "--max-new-tokens", "0", I(">= 1")),
    (GENERATE, "--temperature", "nan", F(">= 0 (0 is greedy)")),
    (GENERATE, "--temperature", "inf", F(">= 0 (0 is greedy)")),
    (GENERATE, "--temperature", "-0.5", F(">= 0 (0 is greedy)")),
    (GENERATE, "--top-k", "-1", I(">= 0 (0 keeps every token)")),
    (GENERATE, "--seed", str(2**31), I("in [0, 2**31)")),
    (GENERATE, "--num-samples", "0", I(">= 1")), (GENERATE, "--prefill-chunk", "0", I(">= 1")),
    (GENERATE, "--simulate-devices", "0", I(">= 1")),
    (PREPARE, "--held-out-fraction", "0.5", F("in (0, 0.5)")),
    (PREPARE, "--held-out-fraction", "nan", F("in (0, 0.5)")),
    (PREPARE, "--workers", "-1", I(">= 0 (0: one per core)")),
    (PREPARE, "--shard-tokens", "0", I(">= 1")), (PREPARE, "--max-bytes", "0", I(">= 1")),
    (BPE, "--vocab-size", "256", I("> 256 (the byte alphabet)")),
    (BPE, "--max-bytes", "0", I(">= 1")),
    (TO_HF, "--max-shard-gb", "0", F("> 0")), (TO_HF, "--max-shard-gb", "1e400", F("> 0")),
    (TO_HF, "--simulate-devices", "0", I(">= 1")),
    (FROM_HF, "--simulate-devices", "-2", I(">= 1")),
    (INSPECT, "--devices", "0", I(">= 1")), (INSPECT, "--simulate-devices", "0", I(">= 1")),
    (EXPLAIN, "--simulate-devices", "0", I(">= 1")),
    (LAUNCH, "-n", "0", I(">= 1")), (LAUNCH, "--devices-per-process", "0", I(">= 1")),
    (LAUNCH, "--port", "65536", I("in [0, 65535] (0: a free one)")),
    (SLURM, "--nodes", "0", I(">= 1")), (SLURM, "--gpus-per-node", "0", I(">= 1")),
    (SLURM, "--cpus-per-task", "0", I(">= 1")), (SLURM, "--cpu-devices", "0", I(">= 1")),
    (SLURM, "--signal-seconds", "-1", I(">= 1")),
]


@pytest.mark.parametrize("command,flag,value,valid", REFUSED,
                         ids=[f"{' '.join(c[0][:2])} {f}={v}" for c, f, v, _ in REFUSED])
def test_a_value_out_of_range_exits_2_naming_the_option_value_and_range(command, flag, value,
                                                                       valid, capsys):
  before, after = command
  with pytest.raises(SystemExit) as got:
    cli.main([*before, flag, value, *after])
  assert got.value.code == 2
  err = capsys.readouterr().err
  named = rf"argument ([\w-]+/)?{re.escape(flag)}(/[\w-]+)?"  # -n/--num-processes
  assert re.search(rf"error: {named}: must be {re.escape(valid)}, got '{re.escape(value)}'$",
                   err, re.M), err


def test_the_pytest_option_and_ini_value_are_bounded():
  with pytest.raises(pytest.UsageError, match=r"argument --shardlab-devices: must be an "
                                              r"integer >= 0, got '-1'"):
    _plugin_options().parse_args(["--shardlab-devices", "-1"])

  def requested(option, ini):
    return plugin.requested_devices(types.SimpleNamespace(
        known_args_namespace=types.SimpleNamespace(shardlab_devices=option),
        getini=lambda name: ini))

  assert requested(3, "8") == 3 and requested(None, "8") == 8 and requested(0, "8") == 8
  assert requested(None, "") == 0
  for ini in ("-1", "x", "2.5"):
    with pytest.raises(pytest.UsageError,
                       match=rf"shardlab_devices must be an integer >= 0, got '{ini}'"):
      requested(None, ini)


def _plugin_options():
  from _pytest.config.argparsing import Parser
  parser = Parser(_ispytest=True)
  plugin.pytest_addoption(parser)
  return parser.optparser


def test_every_number_of_a_config_section_and_of_sampling_is_declared():
  sections = {"train": config.TrainConfig, "data": config.DataConfig,
              "checkpoint": config.CheckpointConfig, "lora": config.LoraConfig}
  missing = [f"{name}.{f.name}" for name, cls in sections.items()
             for f in dataclasses.fields(cls) if f.type in (int, float, "int", "float")
             and f"{name}.{f.name}" not in config.BOUNDS]
  # Sampling.vocab is the tokenizer's, set by the program, never by a user.
  missing += [f.name for f in dataclasses.fields(generate.Sampling)
              if f.type in (int, float, "int", "float") and f.name != "vocab"
              and f.name not in generate.BOUNDS]
  assert not missing, missing


def _option(parser, flag):
  return next(a for a in parser._actions if flag in a.option_strings)


def test_an_option_that_sets_a_field_parses_with_the_fields_declaration():
  """The range lives in one place: the option's `type` is the field's Bound itself."""
  prepare = data_cli.data_parser()._actions[-1].choices["prepare"]
  same = [(_option(train_parser(), "--steps"), config.BOUNDS["train.steps"]),
          (_option(train_parser(), "--seed"), config.BOUNDS["train.seed"]),
          (_option(plan_cli.train_parser(), "--global-batch"),
           config.BOUNDS["train.global_batch"]),
          (_option(prepare, "--held-out-fraction"), config.BOUNDS["data.held_out_fraction"]),
          (_option(generate_parser(), "--seed"), generate.BOUNDS["seed"]),
          (_option(generate_parser(), "--temperature"), generate.BOUNDS["temperature"])]
  for action, bound in same:
    assert action.type is bound, action.option_strings


@pytest.mark.parametrize("key,value,message", [
    ("train.lr", "nan", "train.lr must be a finite number, got nan"),
    ("train.lr", "-inf", "train.lr must be a finite number, got -inf"),
    ("train.lr", "0", "train.lr must be > 0, got 0.0"),
    ("train.steps", "0", "train.steps must be >= 1, got 0"),
    ("train.loss_chunk", "-1", "train.loss_chunk must be >= 0 (0: off), got -1"),
    ("data.held_out_fraction", "0.5", "data.held_out_fraction must be in (0, 0.5), got 0.5"),
    ("lora.alpha", "inf", "lora.alpha must be a finite number, got inf"),
    ("checkpoint.keep", "0", "checkpoint.keep must be >= 1, got 0"),
])
def test_set_values_are_held_to_the_same_ranges(key, value, message):
  cfg = config.Config(model=None)
  with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
    config.apply_overrides(cfg, [f"{key}={value}"])


def test_a_field_built_directly_is_held_to_its_range_and_nan_is_named():
  with pytest.raises(ConfigError, match=r"^train.b1 must be a finite number in \[0, 1\), "
                                        r"got nan$"):
    config.TrainConfig(b1=math.nan)
  with pytest.raises(ConfigError, match=r"^temperature must be a finite number >= 0 "
                                        r"\(0 is greedy\), got inf$"):
    generate.Sampling(temperature=math.inf)


def test_the_declaration_renders_and_parses():
  shown = {Int(min=1): ">= 1", Float(gt=0): "> 0", Float(max=1): "<= 1", Int(lt=5): "< 5",
           Float(gt=0, lt=0.5): "in (0, 0.5)", Int(min=0, lt=2**63): "in [0, 2**63)",
           Float(min=0, max=1): "in [0, 1]", Int(min=0, note="0: off"): ">= 0 (0: off)"}
  for bound, text in shown.items():
    assert str(bound) == text
  # Valid values parse as int() and float() do.
  assert Int(min=1)("007") == 7 and Int(min=1)(" 12 ") == 12
  assert Float(gt=0)("1e-3") == 1e-3 and Float(min=0)("0") == 0.0
  for bound, text in ((Float(), "nan"), (Float(), "-inf"), (Float(), "1e999"), (Int(), "1.0"),
                      (Int(), "")):
    with pytest.raises(ValueError, match=f"got {re.escape(repr(text))}$"):
      bound.parse(text)
