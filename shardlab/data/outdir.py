"""The output directory of `shardlab data prepare`, and how it is told apart from text.

A prepare writes a marker (prepare.json, holding the command) before anything else and
index.json last, atomically, then removes the marker: a directory is a finished prepared
dataset exactly when it has index.json. One with the marker or token shards but no index is
an interrupted (or failed) prepare: readers of text refuse it, naming the command that
redoes it, instead of reading its .npy shards as text.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

from shardlab.errors import ConfigError

INDEX, MARKER = "index.json", "prepare.json"
SHARD = re.compile(r"^(train|held_out)-\d{5}(\.docs|\.mask)?\.npy$")


def claim(out: Path, overwrite: bool, command: str) -> None:
  """Makes `out` an empty directory holding only the marker: a new or empty one, or, with
  `overwrite`, one a prepare wrote (finished or not), removed first. Anything else is
  refused: --overwrite never removes a directory of other files."""
  if out.exists() and not out.is_dir():
    raise ConfigError(f"output {str(out)!r} is a file, not a directory; choose another")
  if out.is_dir() and any(out.iterdir()):
    what = describe(out)
    if what is None:
      raise ConfigError(f"output directory {str(out)!r} is not empty and not a prepared "
                        f"data directory; choose another (--overwrite replaces only a "
                        f"directory `shardlab data prepare` wrote)")
    if not overwrite:
      raise ConfigError(f"output directory {str(out)!r} already holds {what}; pass "
                        f"--overwrite to replace it, or choose another")
    shutil.rmtree(out)
  out.mkdir(parents=True, exist_ok=True)
  write_atomic(out / MARKER, json.dumps({"command": command, "started": time.time()}) + "\n")


def finish(out: Path, index: dict) -> None:
  """Writes index.json (the mark of a finished prepare), then removes the marker."""
  write_atomic(out / INDEX, json.dumps(index, indent=2) + "\n")
  (out / MARKER).unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
  tmp = path.with_name(f".{path.name}.tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def describe(out: Path) -> str | None:
  """What a prepare left in `out`: a finished or an unfinished prepared dataset; None when
  it holds anything else."""
  if (out / INDEX).is_file():
    return "a finished prepared dataset"
  names = [p.name for p in out.iterdir()]
  if MARKER in names or (names and all(SHARD.match(n) or n.startswith("tokenizer")
                                       or n.endswith(".model") for n in names)):
    return "an unfinished prepare (no index.json)"
  return None


def refuse_unfinished(files: list[Path]) -> None:
  """Refuses a text source whose files include a prepare's output: its token shards are
  not text. Names the directory, what is missing and the command that finishes it."""
  for path in files:
    if path.name != MARKER and not SHARD.match(path.name):
      continue
    where = path.parent
    if (where / INDEX).is_file():
      raise ConfigError(f"{where} is a prepared dataset (it has {INDEX}) inside a text "
                        f"directory: its .npy shards are not text; give {where} itself as "
                        f"data.corpus, or move it out")
    raise ConfigError(f"{where} is an unfinished `shardlab data prepare` output: it has no "
                      f"{INDEX}, which a prepare writes last (it was interrupted or failed), "
                      f"and its files are not text to read; redo it with: "
                      f"{_command(where)} --overwrite")


def _command(where: Path) -> str:
  try:
    command = json.loads((where / MARKER).read_text())["command"]
    if isinstance(command, str) and command:
      return command
  except (OSError, ValueError, KeyError, TypeError):
    pass
  return f"shardlab data prepare SOURCE {where}"
