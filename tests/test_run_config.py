"""`train.py --config run.toml`: the Config's sections and keys as TOML, under the flags given;
every run directory gets the resolved config, and `--config RUN_DIR/config.toml` reruns the
run to the same losses."""

import json
import re
from pathlib import Path

import pytest

from shardlab import cli
from shardlab.cli import run_config
from shardlab.cli import train as train_cli
from shardlab.models import registry

RUN = """
mesh = "data:2,fsdp:-1"
strategy = "fsdp"

[model]
vocab_size = 256
d_model = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
head_dim = 16
mlp_dim = 128
max_seq_len = 64

[train]
steps = 3
global_batch = 16
seq_len = 32
lr = 0.01
warmup_steps = 1
seed = 3
log_every = 1
eval_batches = 1

[data]
max_bytes = 400000

[checkpoint]
every = 7
"""
QUIET = ["--quiet", "--sample-tokens", "0"]


def config(*argv: str):
  return train_cli.config_from_args(train_cli.train_parser().parse_args(list(argv)))


def records(run_dir: Path) -> list[dict]:
  lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
  return [r for r in lines if "loss" in r or "eval_loss" in r]


@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("config") / "run.toml"
  path.write_text(RUN)
  return path


@pytest.fixture(scope="module")
def first_run(run_file) -> Path:
  """The file's run, trained once (3 steps of a 2-layer model on 8 simulated devices)."""
  run_dir = run_file.parent / "first"
  assert train_cli.train_main(["--config", str(run_file), "--run-dir", str(run_dir), *QUIET]) == 0
  return run_dir


def test_the_file_sets_the_config_and_no_flag_default_hides_it(run_file):
  cfg = config("--config", str(run_file))
  # Not the flags' defaults (cpu-8, fsdp_tp, tiny, 300 steps): the file's values.
  assert (cfg.mesh, cfg.strategy) == ("data:2,fsdp:-1", "fsdp")
  assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.name) == (2, 64, "run")
  assert (cfg.train.steps, cfg.train.lr, cfg.train.seed, cfg.train.log_every) == (3, 0.01, 3, 1)
  assert (cfg.data.max_bytes, cfg.checkpoint.every) == (400000, 7)
  assert cfg.train.b2 == 0.95 and cfg.data.corpus == "stdlib"  # unset: the Config's defaults


def test_flags_given_override_the_file(run_file):
  cfg = config("--config", str(run_file), "--steps", "5", "--strategy", "dp", "--seed", "9",
               "--set", "train.lr=2e-3", "--set", "model.n_layers=3")
  assert (cfg.train.steps, cfg.strategy, cfg.train.seed, cfg.train.lr) == (5, "dp", 9, 2e-3)
  assert cfg.model.n_layers == 3 and cfg.model.d_model == 64  # --set on the file's model
  assert cfg.mesh == "data:2,fsdp:-1" and cfg.train.warmup_steps == 1  # not given: the file's
  assert config("--config", str(run_file), "--model", "gpt2-tiny").model == \
      registry.load("gpt2-tiny")
  assert config().mesh == "cpu-8" and config().model == registry.load("tiny")  # no file


@pytest.mark.parametrize("text, named", [
    ("[train]\nstepz = 5\n", ["unknown key train.stepz = 5", "did you mean: train.steps",
                              "valid keys of [train]: train.steps,"]),
    ('[train]\nsteps = "ten"\n', ["train.steps must be int, got 'ten'"]),
    ("[train]\nsteps = 2.5\n", ["train.steps must be int, got 2.5"]),
    ('meshh = "cpu-8"\n', ["unknown key meshh = 'cpu-8'", "did you mean: mesh", "valid keys: "]),
    ("[model]\nd_modle = 64\n", ["unknown key model.d_modle = 64", "model.d_model"]),
    ("[data]\nmax_bytes = true\n", ["data.max_bytes must be int, got True"]),
    ("model = 3\n", ["model must be a preset name", "got 3", "tiny"]),
])
def test_unknown_keys_and_wrong_types_are_refused_by_name(tmp_path, capsys, text, named):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  assert train_cli.train_main(["--config", str(path), *QUIET]) == 2
  err = capsys.readouterr().err
  assert f"error: run config {str(path)!r}: " in err
  for part in named:
    assert part in err


def test_shardlab_train_takes_the_file_too(tmp_path, capsys):
  (tmp_path / "bad.toml").write_text("[train]\nsteps = 0\n")
  assert cli.main(["train", "--config", str(tmp_path / "bad.toml"), *QUIET]) == 2
  assert "train.steps must be >= 1, got 0" in capsys.readouterr().err


def test_the_run_uses_the_file_and_writes_the_resolved_config(run_file, first_run):
  got = records(first_run)
  assert [r["step"] for r in got] == [1, 2, 3, 3]  # train.steps 3, log_every 1, final eval
  assert got[1]["lr"] == pytest.approx(0.01, rel=1e-6)  # train.lr, past one warmup step
  resolved = first_run / run_config.RESOLVED
  text = resolved.read_text()
  # Every field, the model's included, as the run used it.
  assert re.search(r"^seed = 3$", text, re.M) and re.search(r"^n_layers = 2$", text, re.M)
  assert re.search(r"^rope_theta = 10000.0$", text, re.M)  # a model default, written out
  assert f'run_dir = "{first_run}"' in text
  assert run_config.load(str(resolved)) == config("--config", str(run_file), "--run-dir",
                                                  str(first_run))


def test_rerunning_the_resolved_config_gives_the_same_losses(first_run, tmp_path):
  again = tmp_path / "again"
  resolved = str(first_run / run_config.RESOLVED)
  assert train_cli.train_main(["--config", resolved, "--run-dir", str(again), *QUIET]) == 0
  first, second = records(first_run), records(again)
  assert len(first) == 4 and [r["step"] for r in second] == [r["step"] for r in first]
  for a, b in zip(first, second):  # bitwise: the same mesh, the same program
    assert (a.get("loss"), a.get("grad_norm"), a.get("eval_loss")) == \
        (b.get("loss"), b.get("grad_norm"), b.get("eval_loss"))
  # The flag given (--run-dir) is the one difference between the two resolved configs.
  differ = [(x, y) for x, y in zip(Path(resolved).read_text().splitlines(),
                                   (again / run_config.RESOLVED).read_text().splitlines())
            if x != y]
  assert differ == [(f'run_dir = "{first_run}"', f'run_dir = "{again}"')]



def test_the_readme_example_is_a_valid_run_config(tmp_path):
  readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
  example = re.search(r"### Run config file\n.*?```toml\n(.*?)```", readme, re.S).group(1)
  (tmp_path / "run.toml").write_text(example)
  cfg = config("--config", str(tmp_path / "run.toml"))
  assert (cfg.model, cfg.mesh, cfg.strategy) == (registry.load("tiny"), "data:1,fsdp:-1,tensor:2",
                                                 "fsdp_tp")
  assert (cfg.train.steps, cfg.train.seed, cfg.train.eval_every) == (200, 1, 100)
  assert (cfg.run_dir, cfg.checkpoint.dir) == ("runs/example", "runs/example/ckpt")
