"""What a prepared data directory's index.json and shards must hold before a run reads them
(shardlab/data/tokens.py read_prepared): the index's fields by type and range, each shard's
arrays by dtype, shape and content. A damaged or hand-edited directory is a ConfigError
naming the file, the field and what is valid, never a traceback or a run on garbage ids.
"""

import os
from pathlib import Path

import numpy as np

from shardlab.errors import ConfigError

SPLITS = ("train", "held_out")
DTYPES = ("uint16", "uint32")
FILE_KEYS = ("tokens", "docs", "mask")


def _natural(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_index(directory: Path, index) -> None:
  """The index's fields a reader uses: a ConfigError naming index.json and the field."""
  where = directory / "index.json"
  bad = lambda field, value, valid: ConfigError(
      f"{where}: {field} = {str(value)[:200]} is not valid; valid: {valid}; rerun "
      f"shardlab data prepare")
  if not isinstance(index, dict):
    raise bad("the index", index, "a JSON object")
  vocab = index.get("vocab_size")
  if not _natural(vocab) or vocab < 1:
    raise bad("vocab_size", vocab, "an integer >= 1")
  eos = index.get("eos_id")
  if eos is not None and not (_natural(eos) and eos < vocab):
    raise bad("eos_id", eos, f"null or an id below vocab_size {vocab}")
  if index.get("dtype") not in DTYPES:
    raise bad("dtype", index.get("dtype"), " or ".join(DTYPES))
  if np.iinfo(index["dtype"]).max < vocab - 1:
    raise bad("dtype", index["dtype"], f"a dtype holding ids up to {vocab - 1}")
  tok = index.get("tokenizer")
  if not isinstance(tok, str) or not tok or Path(tok).name != tok:
    raise bad("tokenizer", tok, "'bytes' or the name of the tokenizer file in the directory")
  splits = index.get("splits")
  if not isinstance(splits, dict) or any(not isinstance(splits.get(s), list) for s in SPLITS):
    raise bad("splits", splits, f"an object with lists {', '.join(SPLITS)}")
  for split in SPLITS:
    for k, entry in enumerate(splits[split]):
      names = [entry.get(key) for key in FILE_KEYS if key in entry] \
          if isinstance(entry, dict) else None
      if (names is None or "tokens" not in entry or "docs" not in entry
          or not all(isinstance(n, str) and n and Path(n).name == n for n in names)):
        raise bad(f"splits.{split}[{k}]", entry,
                  "an object naming its shard files (tokens, docs, optional mask) in the "
                  "directory")


def _load(path: Path) -> np.ndarray:
  """A .npy file memory-mapped, or a ConfigError naming it. numpy parses the header with
  Python's tokenizer: a damaged one raises ValueError, SyntaxError, TokenError, EOFError..."""
  try:
    return np.load(path, mmap_mode="r")
  except Exception as e:
    raise ConfigError(f"{path} is not a readable .npy array ({type(e).__name__}: "
                      f"{str(e)[:200]}); the directory is damaged: rerun shardlab data "
                      f"prepare") from None


def load_shard(directory: Path, entry: dict, index: dict):
  """(tokens, doc_starts, loss_mask) of one shard, memory-mapped (so a header claiming more
  elements than its file holds is refused by the map, never allocated), then checked."""
  tokens, docs = (_load(directory / entry[k]) for k in ("tokens", "docs"))
  mask = _load(directory / entry["mask"]) if "mask" in entry else None
  name = directory / entry["tokens"]
  if tokens.ndim != 1 or tokens.dtype != np.dtype(index["dtype"]):
    raise ConfigError(f"{name} holds a {tokens.dtype} array of shape {tokens.shape}; valid: "
                      f"1-D {index['dtype']} token ids (index.json's dtype)")
  docs = np.array(docs)  # small: one offset per document
  # Non-decreasing: an empty document (an empty text file) starts where the next one does.
  if (docs.ndim != 1 or docs.dtype != np.int64 or (len(tokens) and (len(docs) == 0 or docs[0]))
      or np.any(np.diff(docs) < 0) or (len(docs) and docs[-1] > len(tokens))):
    raise ConfigError(f"{directory / entry['docs']} does not hold ascending int64 document "
                      f"starts from 0 within the {len(tokens)} tokens of {name.name}; the "
                      f"directory is damaged: rerun shardlab data prepare")
  if mask is not None and (mask.shape != tokens.shape or mask.dtype != np.uint8):
    raise ConfigError(f"{directory / entry['mask']} holds a {mask.dtype} array of shape "
                      f"{mask.shape}; valid: uint8 of the shape of {name.name} "
                      f"{tokens.shape}")
  # A first look at each shard's head: reading every shard whole here would cost a pass over
  # the whole dataset at every start; the feed checks each batch's ids as it builds it.
  check_ids(tokens[:FIRST_LOOK], index["vocab_size"], name)
  return tokens, docs, mask


FIRST_LOOK = 1 << 20  # token ids of each shard checked when the directory is read


def check_ids(tokens: np.ndarray, vocab_size: int, where) -> None:
  """An id at or past the vocabulary is garbage (a damaged or foreign shard): refused."""
  top = int(tokens.max()) if len(tokens) else 0
  if top >= vocab_size:
    raise ConfigError(f"{where} holds token id {top}, outside the vocabulary of {vocab_size} "
                      f"ids (index.json's vocab_size); the directory is damaged: rerun "
                      f"shardlab data prepare")


def file_state(array) -> tuple | None:
  """(path, inode, size, modification time) of the file a memory-mapped array reads, or
  None for an array in memory."""
  path = getattr(array, "filename", None)
  if path is None:
    return None
  st = os.stat(path)
  return (path, st.st_ino, st.st_size, st.st_mtime_ns)


def unchanged(state: tuple | None) -> None:
  """A memory-mapped shard must stay as it was mapped: truncated, the next read of a missing
  page kills the process with SIGBUS and no message; rewritten, the run would train on other
  data than it resumed with. Checked before each batch reads it (os.stat: microseconds)."""
  if state is None:
    return
  path, inode, size, mtime = state
  try:
    now = os.stat(path)
  except OSError as e:
    raise ConfigError(f"{path} went away while this run reads it ({e.strerror}); a prepared "
                      f"directory must stay as it is for the whole run") from None
  if (now.st_ino, now.st_size, now.st_mtime_ns) != (inode, size, mtime):
    raise ConfigError(f"{path} changed while this run reads it ({size:,} bytes when the run "
                      f"mapped it, {now.st_size:,} now); a prepared directory must stay as it "
                      f"is for the whole run: prepare into a new directory, and restart the "
                      f"run (it resumes from its last checkpoint)")
