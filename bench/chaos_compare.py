"""Bit-for-bit comparison of a killed-and-resumed run with the straight run (bench/chaos.py).

Training: every loss and held-out loss logged, by step, including the steps a resume did
again (each time it logged them), and the final checkpoint's params, optimizer state and
progress (step, data position). Prepare: every file of the output, byte for byte.
"""

import json
import logging
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from chaos_kill import committed

KEYS = ("loss", "eval_loss")
logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on the items it reads


def _records(path: Path) -> list[tuple]:
  lines = path.read_text().splitlines() if path.exists() else []
  return [(r["step"], k, r[k]) for r in map(json.loads, lines) for k in KEYS if k in r]


def _arrays(item_dir: Path) -> dict:
  """The arrays Orbax saved in `item_dir`, as numpy, by tree path (any mesh it was saved
  on: each is read whole)."""
  with ocp.PyTreeCheckpointer() as reader:
    tree = reader.metadata(item_dir).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = reader.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=args))
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(restored)}


def _same_arrays(want: dict, got: dict, item: str) -> str:
  if want.keys() != got.keys():
    return f"{item}: other leaves ({sorted(want.keys() ^ got.keys())[:3]})"
  for name, w in want.items():
    g = got[name]
    if w.dtype != g.dtype or w.shape != g.shape or w.tobytes() != g.tobytes():
      return f"{item}{name} differs (max |diff| {np.max(np.abs(w - g)):.3g})"
  return ""


def train_difference(straight: Path, resumed: Path) -> str:
  """'' when the resumed run's metrics and final checkpoint equal the straight run's."""
  want = {(s, k): v for s, k, v in _records(straight / "metrics.jsonl")}
  got = _records(resumed / "metrics.jsonl")
  for step, key, value in got:
    if want.get((step, key)) != value:
      return f"{key} at step {step}: {value!r}, straight run {want.get((step, key))!r}"
  missing = sorted(want.keys() - {(s, k) for s, k, _ in got})
  if missing:
    return f"no {missing[0][1]} logged for step {missing[0][0]}"
  last = committed(straight / "ckpt")[-1]
  if committed(resumed / "ckpt")[-1:] != [last]:
    return f"last checkpoint {committed(resumed / 'ckpt')[-1:]}, straight run [{last}]"
  a, b = straight / "ckpt" / str(last), resumed / "ckpt" / str(last)
  for item in ("params", "opt_state"):
    diff = _same_arrays(_arrays(a / item), _arrays(b / item), item)
    if diff:
      return diff
  progress = [json.loads((d / "progress" / "metadata").read_text()) for d in (a, b)]
  return "" if progress[0] == progress[1] else f"progress {progress[1]} != {progress[0]}"


def prepare_difference(straight: Path, resumed: Path) -> str:
  """'' when the redone prepare wrote the files the straight one wrote, byte for byte."""
  a, b = straight / "out", resumed / "out"
  names = [sorted(p.name for p in d.iterdir()) if d.is_dir() else [] for d in (a, b)]
  if names[0] != names[1]:
    return f"files {sorted(set(names[0]) ^ set(names[1]))[:4]} in only one of the outputs"
  for name in names[0]:
    if (a / name).read_bytes() != (b / name).read_bytes():
      return f"{name} differs"
  return ""
