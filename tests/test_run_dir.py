"""A run directory: JSONL with MFU, TensorBoard event files, the PNG plot and a profile, all
written and readable; the progress bar and the live timer."""

import dataclasses
import io
import json
import re
import time

import pytest

from shardlab import config
from shardlab.observe import profiling
from shardlab.cli import train as train_cli
from shardlab.training import loop as train
from shardlab.errors import ConfigError
from shardlab.observe.progress import Activity, Progress
from shardlab.models import registry

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "model.mlp_dim=128", "train.seq_len=32", "train.global_batch=16",
         "train.steps=4", "train.log_every=2", "train.eval_batches=1", "train.warmup_steps=1",
         "data.max_bytes=400000"]


def test_run_dir_holds_metrics_events_plot_and_profile(tmp_path, capsys):
  cfg = config.apply_overrides(config.Config(model=registry.load("tiny")), SMALL)
  cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"), profile_steps="1:2")
  summary = train.train(cfg, quiet=True, on_finish=train_cli.sampler(8))
  out = capsys.readouterr().out
  assert "compiled train step, per device" in out and "over fsdp" in out
  assert "fp32 matmul" in out

  lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  records = [r for r in lines if "loss" in r]
  assert [r["step"] for r in records] == [1, 2, 4]  # step 1, then every log_every
  # The final held-out loss ends the file, as train.eval_every's losses are recorded.
  assert lines[-1] == {"step": 4, "eval_loss": pytest.approx(summary["held_out_loss"])}
  assert all(r["tflops_per_device"] > 0 and 0 < r["mfu"] <= 1 for r in records)

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(tmp_path / "run"))
  events.Reload()
  scalars = events.Tags()["scalars"]
  assert {"train/loss", "train/mfu", "train/tokens_per_s", "eval/held_out_loss"} <= set(scalars)
  assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == \
      [(r["step"], r["loss"]) for r in records]

  import matplotlib.image
  image = matplotlib.image.imread(tmp_path / "run" / "plot.png")
  assert image.shape[0] > 100 and image.shape[1] > 100 and summary["plot"].endswith(".png")

  assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
  assert summary["compiled"]["collectives"] and summary["compiled"]["argument_bytes"] > 0
  assert summary["sample"].startswith("def ") and "sample (temperature" in out


def test_profile_steps_are_checked():
  assert profiling.parse_steps("3:5", 10) == (3, 5)
  assert profiling.parse_steps(None, 10) is None
  for bad in ("5", "5:3", "a:b", "-1:2"):
    with pytest.raises(ConfigError, match="profile_steps"):
      profiling.parse_steps(bad, 10)
  with pytest.raises(ConfigError, match="past the last step"):
    profiling.parse_steps("3:11", 10)
  with pytest.raises(ConfigError, match="run_dir"):
    profiling.Window((1, 2), None)


class Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_progress_bar_and_activity_on_a_terminal(monkeypatch):
  monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: nothing cut short
  stream = Terminal()
  progress = Progress(100, stream=stream)
  progress.update({"step": 25, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5,
                   "tokens_per_s": 1000.0, "step_time_s": 0.1, "tflops_per_device": 0.01,
                   "mfu": 0.25})
  progress.message("a message above the bar")
  progress.close()
  screen = stream.getvalue()
  assert " 25%" in screen and "step  25/100" in screen and "MFU 25.0%" in screen
  assert "ETA 0:00:07" in screen and "a message above the bar" in screen
  assert "\x1b[" in screen  # drawn in place with terminal control codes
  # Narrower terminals: the bar stays and fields are dropped by priority, never tokens/s, MFU
  # or ETA: at 80 columns all four and the loss fit; below, the rest is cut short (…).
  for columns, kept, dropped in ((80, ("loss", "tok/s", "MFU", "ETA 0:00:50"), ("lr", "grad")),
                                 (60, ("tok/s", "MFU"), ("loss", "lr", "grad", "TFLOP/s"))):
    monkeypatch.setenv("COLUMNS", str(columns))
    stream = Terminal()
    progress = Progress(1000, stream=stream)
    progress.update({"step": 500, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5,
                     "tokens_per_s": 123456.0, "step_time_s": 0.1, "tflops_per_device": 0.01,
                     "mfu": 0.25})
    progress.close()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue()).replace("\r", "\n")
    assert " 50%" in screen and "500/1000" in screen
    assert all(f in screen for f in kept) and not any(f in screen for f in dropped), screen
    assert max(len(line) for line in screen.splitlines()) <= columns

  logs = io.StringIO()  # not a terminal: a plain line per update
  Progress(100, stream=logs).update({"step": 50, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5,
                                     "tokens_per_s": 10.0, "step_time_s": 1.0})
  assert logs.getvalue() == ("step  50/100  loss 1.0000  lr 1.00e-03  grad_norm 0.500  "
                             "10 tok/s  1000 ms/step  ETA 0:00:50\n")

  stream = Terminal()
  with Activity("searching meshes", total=4, stream=stream) as activity:
    activity.advance(2)
    time.sleep(0.6)
  assert "searching meshes 2/4" in stream.getvalue() and "ETA" in stream.getvalue()

  logs = io.StringIO()  # not a terminal: no live line at all
  with Activity("compiling", stream=logs):
    time.sleep(0.3)
  assert logs.getvalue() == ""


def test_the_plot_shows_a_short_run_the_final_held_out_loss_and_the_data_unit():
  from shardlab.observe import plots
  lines = [{"step": 4, "loss": 2.5, "tokens_per_s": 100.0}, {"step": 4, "eval_loss": 2.7}]
  fig = plots.figure(lines, unit="byte")
  loss_ax, speed_ax = fig.axes[:2]
  assert loss_ax.get_ylabel() == "loss (nats/byte)"  # the console's unit, not always tokens
  train, held_out = loss_ax.get_lines()
  assert train.get_marker() == "o" and speed_ax.get_lines()[0].get_marker() == "o"
  assert list(held_out.get_xdata()) == [4] and list(held_out.get_ydata()) == [2.7]
  assert plots.figure([{"step": 1, "eval_loss": 3.0}]) is None  # nothing trained: no plot
