"""Sharded Orbax checkpoints: async saves, exact resume, restore onto any mesh.

Layout: DIR/<step>/{params, opt_state}/ hold the arrays (OCDBT/tensorstore, written shard by
shard by every process), DIR/<step>/config/metadata the run's resolved config and
DIR/<step>/progress/metadata the step, seed and data position, both JSON. A step directory
counts only once Orbax has committed it (written under a temporary name, then renamed), so
an interrupted save is never chosen for a restore.

Restore targets come from `state.shardings`, the function training uses: a checkpoint saved
under one mesh and strategy loads under any other, each process reading only its shards.

A step whose files are missing, truncated or corrupt is `DamagedCheckpoint` (never a
model mismatch); a resume sets it aside and falls back to the newest intact step, unless
`checkpoint.strict` is set; the readers (`restore_params`, `restore_newest`) fall back the
same way, leaving the directory as it is (checkpoint_disk.py). A step the OS will not let
us read (permissions) is `UnreadableCheckpoint`: an error naming the path, nothing renamed.

A Checkpointer holds the directory's lock (checkpoint_lock.py) from its start to `close`:
a second run on the same directory is refused, naming the first. Readers take no lock.

A save that fails (a full disk, a directory gone read-only) raises CheckpointWriteError from
the next `save` or `wait`: step directories are created synchronously, so no Orbax thread is
left waiting for one and the process can exit.
"""

import contextlib
from pathlib import Path
from typing import Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from shardlab.config import CheckpointConfig
from shardlab.errors import ConfigError
from shardlab.training import checkpoint_lock
from shardlab.training.checkpoint_disk import DamagedCheckpoint, check_shapes, newest_intact
from shardlab.training.checkpoint_disk import UnreadableCheckpoint, prepare, restore_item
from shardlab.training.checkpoint_disk import saved_steps, stderr
from shardlab.training.checkpoint_lock import CheckpointDirInUse
from shardlab.training.state import Abstract, Shardings, TrainState, placed

__all__ = ["Checkpointer", "CheckpointDirInUse", "CheckpointWriteError", "DamagedCheckpoint",
           "UnreadableCheckpoint", "prepare", "restore_newest", "restore_params",
           "saved_config", "saved_steps"]

ARRAY_ITEMS = ("params", "opt_state")
JSON_ITEMS = ("config", "progress")


def _restore_args(abstract_tree, sharding_tree) -> ocp.args.PyTreeRestore:
  """Restore onto these shardings: each process reads only the shards it holds."""
  target = placed(abstract_tree, sharding_tree)
  return ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def _open(directory: str | Path, options: CheckpointConfig = CheckpointConfig(),
          create: bool = False):
  # No zstd: it costs more CPU than it saves bytes on float weights (~8%), and halves
  # save throughput on a small host (bench/checkpoint.py). Step directories are made in
  # `save` itself: made in the background, a failure left Orbax's other threads waiting
  # for them (20 min), holding the process at exit.
  handlers = {**{k: ocp.PyTreeCheckpointHandler(use_compression=False) for k in ARRAY_ITEMS},
              **{k: ocp.JsonCheckpointHandler() for k in JSON_ITEMS}}
  return ocp.CheckpointManager(
      Path(directory).absolute(), item_handlers=handlers,
      options=ocp.CheckpointManagerOptions(
          save_interval_steps=options.every, max_to_keep=options.keep, create=create,
          cleanup_tmp_directories=True, enable_async_checkpointing=options.async_save,
          async_options=ocp.AsyncOptions(create_directories_asynchronously=False)))


def _existing(directory: str | Path) -> ocp.CheckpointManager:
  """Opens a directory that must hold a complete checkpoint."""
  path = Path(directory)
  if not path.is_dir():
    raise ConfigError(f"checkpoint directory {str(directory)!r} does not exist")
  manager = _open(path)
  if manager.latest_step() is None:
    manager.close()
    found = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
    raise ConfigError(f"checkpoint directory {str(directory)!r} holds no complete checkpoint "
                      f"(found: {found})")
  return manager


class CheckpointWriteError(ConfigError):
  """A save that failed: the directory went away, filled up or became read-only."""


class Checkpointer:
  """Saves a run's state every `options.every` steps into `options.dir` (a directory name
  alone takes the CheckpointConfig defaults)."""

  def __init__(self, options: CheckpointConfig | str | Path):
    if not isinstance(options, CheckpointConfig):
      options = CheckpointConfig(dir=str(options))
    self.directory = Path(options.dir)
    self.every, self.strict = options.every, options.strict
    checkpoint_lock.lock(self.directory)  # held until close(); a no-op after prepare()
    try:
      self.manager = _open(self.directory, options, create=True)
    except BaseException:
      checkpoint_lock.unlock(self.directory)
      raise
    self._saving: int | None = None  # the step of the save in flight
    self._failed = False  # a failed save was reported

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, state: TrainState, config: dict | None = None,
           progress: dict | None = None, force: bool = False) -> bool:
    """Starts an async save if due (or forced); returns whether one started. `config` and
    `progress` are saved as JSON beside the arrays (progress defaults to the step). Raises
    CheckpointWriteError if this save, or the one before it, failed."""
    progress = {"step": int(state.step)} if progress is None else progress
    config = {} if config is None else config
    step = int(progress["step"])
    if not self.due(step, force):
      return False
    args = ocp.args.Composite(
        params=ocp.args.PyTreeSave(state.params),
        opt_state=ocp.args.PyTreeSave(state.opt_state),
        config=ocp.args.JsonSave(config), progress=ocp.args.JsonSave(progress))
    self.wait()  # Orbax waits for the save before anyway; here a failure names its step
    with self._failures(step):
      started = self.manager.save(step, args=args, force=True)
    self._saving = step
    return started

  def due(self, step: int, force: bool = False) -> bool:
    """Whether `save` at `step` would write (the loop checks the state first)."""
    return (force or step % self.every == 0) and step not in self.manager.all_steps()

  @contextlib.contextmanager
  def _failures(self, step: int | None):
    """Turns an error of Orbax's save machinery into CheckpointWriteError naming the step,
    the directory, the cause and the newest complete step."""
    try:
      yield
    except ConfigError:
      raise
    except Exception as error:
      failed = self._saving if self._saving is not None else step
      self._saving, self._failed = None, True
      complete = [s for s in self.manager.all_steps() if s != failed]
      newest = (f"the newest complete checkpoint is step {max(complete)}" if complete
                else "no complete checkpoint was written")
      raise CheckpointWriteError(
          f"could not write checkpoint step {failed} to {self.directory} "
          f"({type(error).__name__}: {error}); {newest}. Free space or fix the directory, "
          f"then rerun to resume") from error

  def restore(self, abstract: Abstract, sh: Shardings, step: int | None = None,
              check_config: Callable[[dict, int], None] | None = None,
              warn: Callable[[str], None] = stderr):
    """(TrainState on `sh`'s mesh, progress dict) from the given step or else the newest
    intact one: a damaged newer step is set aside (renamed <step>.damaged) with a warning,
    or refused under checkpoint.strict. `check_config(saved config, step)` runs before any
    array is read and may raise."""
    read = lambda s: self._restore_step(abstract, sh, s, check_config)
    if step is not None:
      return read(step)
    result, restored, damaged = newest_intact(
        self.directory, list(self.manager.all_steps()), read,
        "checkpoint.strict" if self.strict else None, warn)
    self._set_aside(damaged, restored, warn)
    return result

  def _restore_step(self, abstract: Abstract, sh: Shardings, step: int, check_config):
    for item in ARRAY_ITEMS:
      check_shapes(self.manager, step, item, getattr(abstract.state, item), self.directory)
    saved = _read_json(self.manager, step, self.directory)
    if check_config is not None:
      check_config(saved["config"], step)
    restored = restore_item(self.manager, step, self.directory, ocp.args.Composite(
        params=_restore_args(abstract.state.params, sh.state.params),
        opt_state=_restore_args(abstract.state.opt_state, sh.state.opt_state)))
    state = TrainState(step=jax.device_put(jax.numpy.int32(step), sh.state.step),
                       params=restored["params"], opt_state=restored["opt_state"])
    return state, saved["progress"]

  def _set_aside(self, damaged: list[DamagedCheckpoint], restored: int, warn) -> None:
    """Renames damaged steps out of Orbax's view (so this run can save those steps again),
    keeping their files for inspection."""
    if not damaged:
      return
    root = Path(self.manager.directory)
    for error in damaged if jax.process_index() == 0 else ():  # one process renames
      target, n = root / f"{error.step}.damaged", 1
      while target.exists():
        target, n = root / f"{error.step}.damaged-{n}", n + 1
      (root / str(error.step)).rename(target)
      warn(f"warning: moved the damaged step {error.step} to {target}; resuming from step "
           f"{restored}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("shardlab checkpoint set aside")
    self.manager.reload()

  def check(self) -> None:
    """Raises CheckpointWriteError if a save failed in the background; does not wait.
    (Orbax's check_for_errors misses a failed commit; a finished save's wait returns it.)"""
    if self._saving is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Waits for the save in flight; raises CheckpointWriteError if it failed."""
    with self._failures(self._saving):
      self.manager.wait_until_finished()
    self._saving = None

  def close(self) -> None:
    """Waits for the save in flight, closes and releases the directory's lock; a failure
    already raised is not raised again (close runs in `finally` blocks)."""
    try:
      if self._failed:
        try:
          self.manager.close()
        except Exception:
          pass
        return
      with self._failures(self._saving):
        self.manager.close()
    finally:
      checkpoint_lock.unlock(self.directory)


def _read_json(manager, step: int, directory) -> dict:
  """The step's saved config and progress; a progress naming another step is damage."""
  saved = restore_item(manager, step, directory, ocp.args.Composite(
      config=ocp.args.JsonRestore(), progress=ocp.args.JsonRestore()))
  if saved["progress"].get("step") != step:
    raise DamagedCheckpoint(directory, step, f"its progress metadata says step "
                            f"{saved['progress'].get('step')}")
  return saved


def restore_newest(directory: str | Path, read: Callable[[Callable, int], object],
                   strict: str | None = None, warn: Callable[[str], None] | None = None):
  """(read(restore, step), step) for the newest step of `directory` that reads intact:
  `read` calls `restore(item="config"|"params", abstract=, shardings=)` for what it needs.
  A damaged newer step is skipped with a warning (left on disk), or refused if `strict`
  names the setting that asks for that."""
  manager = _existing(directory)

  def read_step(step: int):
    def restore(item: str, abstract=None, shardings=None):
      if item == "config":
        return _read_json(manager, step, directory)["config"]
      check_shapes(manager, step, item, abstract, directory)
      return restore_item(manager, step, directory, ocp.args.Composite(
          **{item: _restore_args(abstract, shardings)}))[item]
    return read(restore, step)

  try:
    result, step, _ = newest_intact(directory, list(manager.all_steps()), read_step, strict,
                                    warn or stderr)
    return result, step
  finally:
    manager.close()


def restore_params(directory: str | Path, abstract: Abstract, sh: Shardings,
                   strict: str | None = None, warn: Callable[[str], None] | None = None):
  """(params, step): only the params of the newest intact checkpoint in `directory`,
  placed on `sh` (fine-tuning)."""
  return restore_newest(directory, lambda restore, step: restore(
      "params", abstract.state.params, sh.state.params), strict, warn)


def saved_config(directory: str | Path, strict: str | None = None,
                 warn: Callable[[str], None] | None = None) -> dict:
  """The resolved config JSON of the newest intact checkpoint."""
  return restore_newest(directory, lambda restore, step: restore("config"), strict, warn)[0]
