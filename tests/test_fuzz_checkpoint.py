"""A checkpoint's metadata fuzzed: the saved run config and progress JSON of a step
(training/checkpoint.py saved_config) and the run Config rebuilt from it
(models/registry.py run_config_from_dict). Each is read back, or refused by a ConfigError
naming the checkpoint directory (a damaged step is never a traceback)."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from fuzz_harness import ODD, _count_inputs, damaged, mutations, outcome, write  # noqa: F401
from shardlab import config as config_lib
from shardlab.models import registry
from shardlab.training import checkpoint, state
from test_checkpoint import small_config
from test_checkpoint_unreadable import one_device


@pytest.fixture(scope="module")
def saved():
  """One step of an initial state (nothing trained: only reading is fuzzed)."""
  top = Path(tempfile.mkdtemp(prefix="shardlab-fuzz-ckpt-"))
  cfg = small_config(top)
  abstract, sh = one_device(cfg)
  saver = checkpoint.Checkpointer(config_lib.CheckpointConfig(dir=str(top / "ckpt"),
                                                              async_save=False))
  saver.save(state.init_state(abstract, sh), config_lib.to_dict(cfg), {"step": 2}, force=True)
  saver.close()
  yield top / "ckpt", config_lib.to_dict(cfg)
  shutil.rmtree(top, ignore_errors=True)


def _json_files(directory: Path) -> list[Path]:
  return sorted(p for p in (directory / "2").rglob("*")
                if p.is_file() and p.parent.name in ("config", "progress"))


def _read_config(d: Path):
  """The run Config of the newest step, as generate, convert and peft export read it."""
  return checkpoint.restore_newest(d, lambda restore, step: registry.run_config_from_dict(
      restore("config"), f"checkpoint {d}/{step}"), warn=lambda _: None)[0]


def _copy(directory: Path, tmp_path_factory) -> Path:
  d = tmp_path_factory.mktemp("c") / "ckpt"
  shutil.copytree(directory, d)
  return d


def test_metadata_files(saved, tmp_path_factory):
  """Every file Orbax wrote for the config and progress items, damaged byte by byte."""
  directory, _ = saved
  names = [p.relative_to(directory) for p in _json_files(directory)]
  assert names, list((directory / "2").rglob("*"))

  @given(name=st.sampled_from(names), data=st.data())
  def check(name, data):
    d = _copy(directory, tmp_path_factory)
    write(d / name, data.draw(damaged((directory / name).read_bytes())))
    read = outcome(lambda: _read_config(d), str(d))
    assert read is None or isinstance(read, config_lib.Config)
  check()


def test_saved_config_fields(saved, tmp_path_factory):
  """The saved config's JSON, its values swapped for wrong types, huge numbers, NaN, inf."""
  directory, valid = saved
  config_file = (directory / "2" / "config" / "metadata").relative_to(directory)
  assert json.loads((directory / config_file).read_text()) == valid  # the file Orbax reads

  @given(fields=st.one_of(mutations(valid), mutations(valid["train"]).map(
      lambda t: {**valid, "train": t}), mutations(valid["model"]).map(
      lambda m: {**valid, "model": m})))
  def check(fields):
    d = _copy(directory, tmp_path_factory)
    write(d / config_file, json.dumps(fields))
    outcome(lambda: _read_config(d), str(d))
  check()
