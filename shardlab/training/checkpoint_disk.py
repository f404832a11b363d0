"""The checkpoint directory on disk: checked before a run (a directory, writable, locked by
no other run), and read step by step, telling a damaged step (missing, truncated or corrupt
files) from a model mismatch, and falling back from a damaged newest step to the newest
intact one.

Every reader goes through `newest_intact`: a resume, `--init-from`, `generate` and
`convert to-hf` all fall back the same way (with a warning), or refuse under strictness.
A step the OS will not let us read (permissions) is not damaged: it is an error naming the
path and the reason, and nothing falls back or is renamed, since its contents may be fine.
"""

import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardlab.errors import ConfigError
from shardlab.training import checkpoint_lock

T = TypeVar("T")


class DamagedCheckpoint(ConfigError):
  """A step whose files are missing, truncated or corrupt."""

  def __init__(self, directory, step: int, detail: str):
    self.step, self.detail = step, detail
    super().__init__(f"checkpoint {directory}/{step} could not be read; it is damaged or not "
                     f"a shardlab checkpoint ({detail})")


class UnreadableCheckpoint(ConfigError):
  """A step the OS refuses to read (permissions): its contents may be intact."""

  def __init__(self, directory, step: int, reason: str):
    self.step = step
    super().__init__(f"checkpoint {directory}/{step} cannot be read: {reason}. It is not "
                     f"damaged as far as shardlab can tell, so nothing was skipped or "
                     f"renamed: fix its permissions (e.g. chmod -R u+rwX {directory}) and "
                     f"rerun")


def os_problem(step_dir: Path, detail: str = "") -> str | None:
  """'Permission denied: PATH' (the OS's reason) for the first file or directory of
  `step_dir` that cannot be opened, or None. Asked only once a read has failed, to tell
  an unreadable step from a damaged one: the open calls cost nothing next to a restore."""
  found: list[OSError] = []
  try:
    os.listdir(step_dir)
  except FileNotFoundError:
    return None
  except OSError as e:
    found.append(e)
  for root, _, files in os.walk(step_dir, onerror=found.append) if not found else ():
    for name in files:
      try:
        os.close(os.open(os.path.join(root, name), os.O_RDONLY))
      except FileNotFoundError:  # gone meanwhile, or a dangling link: damage
        pass
      except OSError as e:
        found.append(e)
  found = [e for e in found if not isinstance(e, FileNotFoundError)]
  if found:
    e = found[0]
    return f"{e.strerror or os.strerror(e.errno)}: {e.filename}"
  if "PERMISSION_DENIED" in detail or os.strerror(errno.EACCES) in detail:
    return detail  # denied somewhere the walk cannot see (an ACL, a mount): say it as is
  return None


def unreadable(directory, step: int, error: Exception) -> DamagedCheckpoint:
  while error.__cause__ is not None:  # Orbax wraps tensorstore's error, which names the file
    error = error.__cause__
  detail = str(error).split(" [tensorstore_spec")[0].split(" See full TensorStore")[0][:400]
  return DamagedCheckpoint(directory, step, f"{type(error).__name__}: {detail}")


def restore_item(manager, step: int, directory, args):
  try:
    return manager.restore(step, args=args)
  except Exception as e:  # tensorstore/json errors on damaged files: say which checkpoint
    raise unreadable(directory, step, e) from e


def _shapes_by_path(tree) -> dict:
  """{'1.0.mu.blocks.attn.q_DxHxE': shape}: key names only, since Orbax stores optax's
  named tuples as dicts and lists."""
  return {jax.tree_util.keystr(path, simple=True, separator="."): leaf.shape
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_shapes(manager, step: int, item: str, abstract_tree, directory) -> None:
  """Raises ConfigError listing every leaf whose saved shape differs from the model's, and
  DamagedCheckpoint when the item's metadata is missing or unreadable."""
  try:
    saved = manager.item_metadata(step)[item]
  except Exception as e:  # unreadable metadata: a damaged or foreign checkpoint
    raise unreadable(directory, step, e) from e
  if saved is None:  # Orbax reports a missing _METADATA file as no metadata at all
    raise DamagedCheckpoint(directory, step, f"its {item} metadata ({item}/_METADATA) is "
                            f"missing")
  saved = saved.tree if hasattr(saved, "tree") else saved
  flat_saved, flat_want = _shapes_by_path(saved), _shapes_by_path(abstract_tree)
  problems = [f"  {k}: checkpoint {flat_saved.get(k, 'missing')}, model {flat_want.get(k, 'missing')}"
              for k in sorted(set(flat_saved) | set(flat_want))
              if flat_saved.get(k) != flat_want.get(k)]
  if problems:
    raise ConfigError(
        f"checkpoint {directory}/{step} does not match this model ({len(problems)} "
        f"{item} leaves differ):\n" + "\n".join(problems[:20]) +
        ("\n  ..." if len(problems) > 20 else ""))


OK, DAMAGED, UNREADABLE = 0, 1, 2  # a step's verdict on one process; the worst one counts


def _on_any_process(verdict: int) -> int:
  """The worst of every process's verdict: a damaged shard may be read by only one."""
  if jax.process_count() == 1:
    return verdict
  return int(np.max(multihost_utils.process_allgather(np.array([verdict]))))


def stderr(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def newest_intact(directory, steps: list[int], read: Callable[[int], T], strict: str | None,
                  warn: Callable[[str], None] = stderr) -> tuple[T, int, list]:
  """(read(step), step, the DamagedCheckpoint of each newer step) for the newest of `steps`
  that `read` takes without DamagedCheckpoint, warning about each damaged one. `strict`
  names the setting that refuses the first damaged step instead ("checkpoint.strict",
  "--strict"), or is None. Every process walks the steps together."""
  if not steps:
    raise ConfigError(f"checkpoint directory {str(directory)!r} holds no complete checkpoint")
  damaged = []
  for step in sorted(steps, reverse=True):
    error, verdict = None, OK
    try:
      result = read(step)
    except DamagedCheckpoint as e:
      reason = os_problem(Path(directory) / str(step), e.detail)
      error, verdict = (e, DAMAGED) if reason is None else (
          UnreadableCheckpoint(directory, step, reason), UNREADABLE)
    verdict = _on_any_process(verdict)
    if verdict == OK:
      return result, step, damaged
    if verdict == UNREADABLE:
      if not isinstance(error, UnreadableCheckpoint):
        error = UnreadableCheckpoint(directory, step, "not readable on another process")
      raise error
    error = error or DamagedCheckpoint(directory, step, "on another process")
    if strict:
      undo = f"leave out {strict}" if strict.startswith("--") else f"set {strict}=false"
      raise ConfigError(f"{error}; {strict} is set, so nothing falls back to an older step: "
                        f"repair or move {directory}/{step}, or {undo}") from error
    if jax.process_index() == 0:
      warn(f"warning: {error}; trying the step before it")
    damaged.append(error)
  raise ConfigError(f"no intact checkpoint in {directory}: " +
                    "; ".join(str(e) for e in damaged) +
                    "; repair one, or start over with --fresh --overwrite")


def saved_steps(directory) -> list[int]:
  """The complete steps in `directory`, oldest first, without opening any (Orbax names a
  step's directory by its number only once the step is committed)."""
  try:
    return sorted(int(p.name) for p in Path(directory).iterdir()
                  if p.name.isdigit() and p.is_dir())
  except OSError:
    return []


PROBE = ".shardlab-write-test-"  # a file each process writes once to test the directory


def _check_writable(path: Path, flag: str) -> None:
  """Creates `path` and writes a file into it, so an unusable directory fails before
  compiling, not in the first async save (where Orbax's threads would hold the exit)."""
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"{flag} {str(path)!r} cannot be created ({e.strerror or e}); choose "
                      f"a directory you can write to") from None
  probe = path / f"{PROBE}{os.getpid()}-{jax.process_index()}"
  try:
    probe.write_bytes(b"ok")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"{flag} {str(path)!r} is not writable ({e.strerror or e}); fix its "
                      f"permissions or choose another directory") from None


def prepare(directory: str | Path, fresh: bool, overwrite: bool,
            flag: str = "--checkpoint-dir") -> None:
  """Checks that `directory` can hold checkpoints (creating it), and refuses to start fresh
  on top of existing checkpoints unless told to overwrite."""
  path = Path(directory)
  if path.exists() and not path.is_dir():
    raise ConfigError(f"{flag} {str(directory)!r} exists and is not a directory")
  _check_writable(path, flag)
  checkpoint_lock.lock(path, flag)  # before deleting anything: it may be another run's
  # Another process's probe may come and go meanwhile: it is not content; nor is our lock.
  content = [c for c in path.iterdir()
             if not c.name.startswith(PROBE) and c.name != checkpoint_lock.LOCK_NAME]
  if not fresh or not content:
    return
  if not overwrite:
    raise ConfigError(
        f"--fresh: checkpoint directory {str(directory)!r} is not empty; pass --overwrite to "
        f"delete what is there, or choose another directory")
  if jax.process_index() == 0:  # one process deletes; the others wait for it
    for child in content:
      shutil.rmtree(child) if child.is_dir() else child.unlink()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("shardlab checkpoint.prepare")
