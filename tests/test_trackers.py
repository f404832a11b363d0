"""`train.py --logger tensorboard,wandb,mlflow`: a short run's scalars reach a real W&B run
(offline, read back from its run file) and a real MLflow run (the local SQLite store, read
through MlflowClient) at the metrics JSONL's steps and values, with the resolved config as
their config and params; unknown names and missing needs are refused before any work."""

import json
import sys
import tomllib
from pathlib import Path

import pytest

from shardlab import config
from shardlab.cli import train as train_cli
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.observe import trackers

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "model.mlp_dim=128", "train.seq_len=32", "train.global_batch=16",
         "train.log_every=2", "train.eval_batches=1", "train.warmup_steps=1",
         "data.max_bytes=400000"]
ARGS = ["--model", "tiny", "--steps", "4", "--eval-every", "2", "--quiet", "--sample-tokens",
        "0", *[a for s in SMALL for a in ("--set", s)]]
ENV_OUT = ("WANDB_PROJECT", "WANDB_NAME", "WANDB_API_KEY", "MLFLOW_TRACKING_URI",
           "MLFLOW_EXPERIMENT_NAME")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
  """One 4-step run of a 2-layer model to all three trackers, W&B offline; W&B's own
  settings and caches kept out of the home directory."""
  for package in ("wandb", "mlflow", "sqlalchemy", "alembic"):  # the trackers extra
    pytest.importorskip(package)
  home = tmp_path_factory.mktemp("wandb-home")
  with pytest.MonkeyPatch.context() as env:
    for name in ENV_OUT:
      env.delenv(name, raising=False)
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
      env.setenv(name, str(home))
    out = tmp_path_factory.mktemp("trackers") / "tiny-run"
    assert train_cli.train_main([*ARGS, "--run-dir", str(out),
                                 "--logger", "tensorboard,wandb,mlflow"]) == 0
  return out


def expected(run_dir: Path) -> dict:
  """{(tag, step): value} from metrics.jsonl, under TensorBoard's names."""
  out = {}
  for line in (run_dir / "metrics.jsonl").open():
    record = json.loads(line)
    if "loss" in record:
      out.update({(f"train/{k}", record["step"]): v for k, v in record.items() if k != "step"})
    elif "eval_loss" in record:
      out[("eval/held_out_loss", record["step"])] = record["eval_loss"]
  return out


def resolved(run_dir: Path) -> dict:
  """RUN_DIR/config.toml flat: {"train.steps": 4, ...}."""
  flat = {}

  def walk(tree: dict, prefix: str) -> None:
    for key, value in tree.items():
      walk(value, f"{prefix}{key}.") if isinstance(value, dict) else \
          flat.__setitem__(prefix + key, value)

  walk(tomllib.loads((run_dir / "config.toml").read_text()), "")
  return flat


def wandb_records(run_dir: Path) -> list:
  """The records of W&B's run file (`wandb sync` uploads it): a 7-byte header, then LevelDB's
  log format, 32 KiB blocks of chunks with a 7-byte header (CRC, length, type), each record
  a wandb_internal_pb2.Record."""
  from wandb.proto import wandb_internal_pb2

  [path] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
  data, block = path.read_bytes(), 32768
  assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
  records, pending, pos = [], b"", 7
  while pos + 7 <= len(data):
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    if block - pos % block < 7 or kind == 0:  # padding to the block's end
      pos += block - pos % block
      continue
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST: the record is whole
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def test_wandb_has_the_jsonl_scalars_and_the_config(run_dir):
  records = wandb_records(run_dir)
  logged = {}
  key = lambda item: item.key or "/".join(item.nested_key)
  history = [r.history for r in records if r.HasField("history")]
  for h in history:
    for item in h.item:
      if not key(item).startswith(("_", "goodput/")):  # W&B's own (_step, _runtime, ...)
        logged[(key(item), h.step.num)] = json.loads(item.value_json)
  want = expected(run_dir)
  assert {k for k, _ in want} >= {"train/loss", "train/mfu", "train/tokens_per_s",
                                  "eval/held_out_loss"}
  assert logged.keys() == want.keys()
  assert logged == pytest.approx(want, rel=1e-12)
  assert any(key(item).startswith("goodput/") for h in history for item in h.item)

  [run] = [r.run for r in records if r.HasField("run")]
  assert run.display_name == "tiny-run" and run.project == "shardlab"
  cfg = {}
  for r in [run.config] + [r.config for r in records if r.HasField("config")]:
    cfg.update({key(i): json.loads(i.value_json) for i in r.update})
  for key, value in resolved(run_dir).items():
    section, *rest = key.split(".")
    got = cfg[section]
    for part in rest:
      got = got[part]
    assert got == value, key


def test_mlflow_has_the_jsonl_scalars_and_the_config_as_params(run_dir):
  from mlflow.tracking import MlflowClient
  client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
  experiment = client.get_experiment_by_name("shardlab")
  [run] = client.search_runs([experiment.experiment_id])
  assert run.info.run_name == "tiny-run" and run.info.status == "FINISHED"
  logged = {(m.key, m.step): m.value for key in run.data.metrics
            if not key.startswith("goodput/")
            for m in client.get_metric_history(run.info.run_id, key)}
  assert logged == pytest.approx(expected(run_dir), rel=1e-12)
  assert logged.keys() == expected(run_dir).keys()
  assert any(key.startswith("goodput/") for key in run.data.metrics)

  params, flat = run.data.params, resolved(run_dir)
  assert params["loggers"] == "tensorboard,wandb,mlflow" and params["train.steps"] == "4"
  for key, value in flat.items():
    assert params[key] == (value if isinstance(value, str) else json.dumps(value)), key


def test_tensorboard_still_has_them(run_dir):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(run_dir))
  events.Reload()
  want = expected(run_dir)
  for tag in {k for k, _ in want}:
    got = {(tag, e.step): e.value for e in events.Scalars(tag)}
    assert got == pytest.approx({k: v for k, v in want.items() if k[0] == tag}, rel=1e-6)


def cfg_with(**fields):
  cfg = config.Config(model=registry.load("tiny"))
  return config.set_values(cfg, fields)


def test_unknown_names_and_missing_needs_are_refused(capsys, monkeypatch):
  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  assert train_cli.train_main([*ARGS, "--logger", "tensorboard,wandbb"]) == 2
  err = capsys.readouterr().err
  assert "unknown logger 'wandbb'" in err and "did you mean: wandb" in err
  assert "valid: tensorboard, wandb, mlflow" in err
  with pytest.raises(ConfigError, match="--logger wandb needs --run-dir"):
    trackers.names(cfg_with(loggers="wandb"))
  with pytest.raises(ConfigError, match="needs --run-dir .* or MLFLOW_TRACKING_URI"):
    trackers.names(cfg_with(loggers="mlflow"))
  monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
  assert trackers.names(cfg_with(loggers=" mlflow, tensorboard ")) == ("mlflow", "tensorboard")
  with pytest.raises(ConfigError, match="stands alone"):
    trackers.names(cfg_with(loggers="none,wandb"))
  with pytest.raises(ConfigError, match="loggers is empty"):
    trackers.names(cfg_with(loggers=" , "))
  assert trackers.names(cfg_with(loggers="none")) == ()
  assert trackers.open(cfg_with(loggers="none", run_dir="x"), "x") is None
  assert trackers.open(cfg_with(), None) is None  # TensorBoard needs a run directory


def test_a_missing_package_names_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
  with pytest.raises(ConfigError, match=r"needs the wandb package.*shardlab\[trackers\]"):
    trackers.open(cfg_with(loggers="wandb", run_dir=str(tmp_path)), str(tmp_path))
