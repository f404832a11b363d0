"""Resuming checks what it resumes: the saved config against this run's, a target already
reached, and damaged steps on disk (a missing metadata file, a truncated array file)."""

import json
import shutil

import pytest

from shardlab import cli, config
from shardlab.cli import generate as generate_cli
from shardlab.cli import train as train_cli
from shardlab.models import registry
from shardlab.training import checkpoint
from test_checkpoint import SMALL

RUN = [s for s in SMALL if not s.startswith("train.steps")] + ["checkpoint.every=2"]


def train(directory, steps: int, *extra: str) -> int:
  args = [a for s in RUN for a in ("--set", s)]
  return train_cli.train_main(args + ["--steps", str(steps), "--quiet", "--sample-tokens", "0",
                                      "--checkpoint-dir", str(directory), *extra])


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  """A checkpoint dir holding steps 2 and 4 of the small run, trained once."""
  directory = tmp_path_factory.mktemp("resume") / "ckpt"
  assert train(directory, 4) == 0
  return directory


@pytest.fixture
def ckpt(four_steps, tmp_path):
  """A copy of it that a test may resume, damage or refuse."""
  shutil.copytree(four_steps, tmp_path / "ckpt")
  return tmp_path / "ckpt"


def steps_on_disk(directory) -> list[str]:
  return sorted((p.name for p in directory.iterdir()), key=lambda n: (len(n), n))


def test_changed_settings_are_refused_then_allowed(ckpt, capsys):
  assert train(ckpt, 6, "--seed", "1", "--set", "train.global_batch=32") == 2
  err = capsys.readouterr().err
  assert f"error: checkpoint {ckpt}/4 was saved by a run with other settings (2 differ" in err
  assert "  train.global_batch: 16 → 32\n  train.seed: 0 → 1\n" in err
  assert "pass --allow-config-change to resume anyway" in err
  assert steps_on_disk(ckpt) == ["2", "4"]  # nothing trained, nothing written

  # lr and steps may change freely; the seed only with the flag, which lists what changed.
  assert train(ckpt, 6, "--seed", "1", "--set", "train.lr=1e-3",
               "--allow-config-change") == 0
  out = capsys.readouterr().out
  assert "warning: resuming from step 4 with 1 changed setting(s) (--allow-config-change)" \
      in out and "train.seed: 0 → 1" in out and "train.lr" not in out
  assert "resuming from the checkpoint at step 4" in out
  assert checkpoint.saved_config(ckpt)["train"]["seed"] == 1  # step 6 records the new one


def test_changes_that_matter_and_those_that_do_not():
  cfg = config.apply_overrides(config.Config(model=registry.load("tiny")), RUN)
  saved = config.to_dict(cfg)
  free = config.apply_overrides(cfg, ["train.lr=1", "train.steps=9", "train.warmup_steps=0",
                                      "train.log_every=3", "train.eval_batches=2",
                                      "train.remat=full", "checkpoint.every=5"])
  assert config.resume_changes(saved, config.to_dict(free)) == []
  bound = config.apply_overrides(cfg, ["model.rope_theta=500000.0", "train.b2=0.99",
                                       "train.precision=bf16", "train.microbatches=2",
                                       "data.corpus=other.txt"])
  assert config.resume_changes(saved, config.to_dict(bound)) == [
      'data.corpus: "stdlib" → "other.txt"', "model.rope_theta: 10000.0 → 500000.0",
      "train.b2: 0.95 → 0.99", 'train.microbatches: 1 → 2', 'train.precision: "auto" → "bf16"']
  renamed = json.loads(json.dumps(saved))
  renamed["model"]["name"] = "my-copy"
  del renamed["train"]["seed"]  # an older checkpoint that did not record a field
  assert config.resume_changes(renamed, config.to_dict(bound), ("model", "train.seed")) == [
      "model.rope_theta: 10000.0 → 500000.0"]


def test_a_target_already_reached_trains_nothing(ckpt, capsys):
  assert train(ckpt, 2) == 0
  out = capsys.readouterr().out
  assert "checkpoint at step 4 already reached train.steps 2: nothing to train" in out
  assert "held-out loss" not in out and "compiled" not in out
  assert steps_on_disk(ckpt) == ["2", "4"]


def truncate_an_array_file(step_dir) -> None:
  biggest = max((f for f in (step_dir / "params").rglob("*") if f.is_file()),
                key=lambda f: f.stat().st_size)
  with open(biggest, "r+b") as f:
    f.truncate(100)


@pytest.mark.parametrize("damage,detail", [
    (lambda d: (d / "params" / "_METADATA").unlink(),
     "(its params metadata (params/_METADATA) is missing)"),
    (truncate_an_array_file, "is not valid for value of size 100"),
], ids=["metadata-deleted", "array-truncated"])
def test_damaged_newest_step_falls_back_to_the_intact_one(ckpt, capsys, damage, detail):
  damage(ckpt / "4")
  assert train(ckpt, 6) == 0
  out = capsys.readouterr().out
  assert f"warning: checkpoint {ckpt}/4 could not be read; it is damaged" in out
  assert detail in out and "does not match this model" not in out
  assert f"warning: moved the damaged step 4 to {ckpt.absolute()}/4.damaged" in out
  assert "resuming from the checkpoint at step 2" in out
  assert steps_on_disk(ckpt) == ["2", "4", "6", "4.damaged"]  # 4 trained again


def test_strict_refuses_a_damaged_step_and_none_intact_is_an_error(ckpt, capsys):
  (ckpt / "4" / "progress" / "metadata").unlink()
  assert train(ckpt, 6, "--set", "checkpoint.strict=true") == 2
  err = capsys.readouterr().err
  assert f"checkpoint {ckpt}/4 could not be read; it is damaged" in err
  assert "checkpoint.strict is set, so nothing falls back to an older step" in err
  assert steps_on_disk(ckpt) == ["2", "4"]  # left as it was

  (ckpt / "2" / "opt_state" / "_METADATA").unlink()
  assert train(ckpt, 6) == 2
  err = capsys.readouterr().err
  assert f"error: no intact checkpoint in {ckpt}: checkpoint {ckpt}/4 could not be read" in err
  assert f"checkpoint {ckpt}/2 could not be read" in err
  assert steps_on_disk(ckpt) == ["2", "4"]


def read_with(reader: str, ckpt, tmp_path, *extra: str) -> int:
  """`reader` of the checkpoint dir: a fine-tuning run's --init-from, generate or to-hf."""
  if reader == "init-from":
    return train(tmp_path / "tuned", 1, "--init-from", str(ckpt), *extra)
  if reader == "generate":
    return generate_cli.generate_main(["--checkpoint", str(ckpt), "--prompt", "def ",
                                       "--max-new-tokens", "2", *extra])
  return cli.main(["convert", "to-hf", str(ckpt), str(tmp_path / "hf"), *extra])


@pytest.mark.parametrize("reader", ["init-from", "generate", "to-hf"])
def test_readers_fall_back_from_a_damaged_newest_step_or_refuse_it(ckpt, tmp_path, capsys,
                                                                     reader):
  (ckpt / "4" / "params" / "_METADATA").unlink()
  strict = ["--set", "checkpoint.strict=true"] if reader == "init-from" else ["--strict"]
  assert read_with(reader, ckpt, tmp_path, *strict) == 2
  err = capsys.readouterr().err
  assert f"checkpoint {ckpt}/4 could not be read; it is damaged" in err
  assert ("checkpoint.strict is set" if reader == "init-from" else
          "--strict is set, so nothing falls back to an older step") in err

  assert read_with(reader, ckpt, tmp_path) == 0
  captured = capsys.readouterr()
  said = captured.out + captured.err
  assert (f"warning: checkpoint {ckpt}/4 could not be read; it is damaged or not a shardlab "
          f"checkpoint (its params metadata (params/_METADATA) is missing); trying the step "
          f"before it") in said
  assert "does not match this model" not in said
  used = {"init-from": f"initialised params from {ckpt} (step 2)",
          "generate": f"at step 2 from {ckpt}", "to-hf": "wrote config.json"}[reader]
  assert used in said
  assert steps_on_disk(ckpt) == ["2", "4"]  # a reader moves nothing
