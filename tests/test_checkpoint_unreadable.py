"""A step the OS will not let us read is not a damaged step: the run stops with an error
naming the path and the OS's reason, and nothing is renamed or skipped."""

import contextlib
import grp
import os
import pwd
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

from shardlab import config as config_lib
from shardlab.sharding import mesh, rules
from shardlab.training import checkpoint, state
from shardlab.training import run as run_lib
from test_checkpoint import small_config
from test_resume_checks import steps_on_disk

# Imported now: as `nobody`, the interpreter's own library (under /root) is unreadable.
PRELOADED = (grp, pwd)


@contextlib.contextmanager
def without_read_permission():
  """Root reads through permissions: as root, act as `nobody` for the block (the effective
  uid only, so root can take it back)."""
  if os.geteuid() != 0:
    yield
    return
  os.seteuid(65534)
  try:
    yield
  finally:
    os.seteuid(0)


@pytest.fixture(scope="module")
def four_steps():
  """Steps 2 and 4 of an initial state (nothing to train: only reading is tested), in a
  directory `nobody` can reach (pytest's own tmp dirs are root's); and the abstract state
  and shardings to restore them onto."""
  top = Path(tempfile.mkdtemp(prefix="shardlab-unreadable-"))
  top.chmod(0o755)
  cfg = small_config(top)
  abstract, sh = one_device(cfg)
  saver = checkpoint.Checkpointer(config_lib.CheckpointConfig(dir=str(top / "trained"),
                                                          async_save=False))
  initial = state.init_state(abstract, sh)
  for step in (2, 4):
    saver.save(initial, config_lib.to_dict(cfg), {"step": step}, force=True)
  saver.close()
  yield top, abstract, sh
  shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("denied", ["4/params/_METADATA", "4"])
def test_an_unreadable_newest_step_is_an_error_never_renamed(four_steps, capsys, denied):
  top, abstract, sh = four_steps
  ckpt = top / f"copy-{denied.replace('/', '-')}"
  shutil.copytree(top / "trained", ckpt)
  ckpt.chmod(0o777)  # the run may write its lock and probe files
  (ckpt / denied).chmod(0)
  saver = checkpoint.Checkpointer(ckpt)  # a resume (it would rename a damaged step)
  try:
    with without_read_permission(), pytest.raises(checkpoint.UnreadableCheckpoint) as error:
      saver.restore(abstract, sh)
  finally:
    saver.close()
  assert str(error.value).startswith(
      f"checkpoint {ckpt}/4 cannot be read: Permission denied: {ckpt}/{denied}. It is not "
      f"damaged"), error.value
  assert "trying the step before it" not in capsys.readouterr().err
  with without_read_permission(), pytest.raises(checkpoint.UnreadableCheckpoint,
                                                match="Permission denied: "):
    checkpoint.restore_params(ckpt, abstract, sh)  # the readers do not fall back either
  (ckpt / denied).chmod(0o755)
  assert steps_on_disk(ckpt) == ["2", "4"]  # nothing renamed


def one_device(cfg):
  abstract = run_lib.abstract_state(cfg)
  one = mesh.build(mesh.parse_inline("data:1"), devices=jax.devices()[:1])
  return abstract, state.shardings(abstract, rules.strategy("dp"), one)
