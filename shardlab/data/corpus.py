"""Byte-level text data: a corpus every machine has (this Python's standard library source),
or any file or directory of text, read as bytes (tokens 0–255).

Batches are a pure function of (seed, step), so the data position is just the step number
and a resumed run sees exactly the batches it would have seen. Each process builds only
its own rows of the global batch (jax.make_array_from_process_local_data).
"""

import dataclasses
import math
import stat
import sysconfig
from pathlib import Path

import jax
import numpy as np

from shardlab.config import DataConfig
from shardlab.errors import ConfigError
from shardlab.data import listing, outdir, records

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray  # uint8
  held_out: np.ndarray  # uint8
  source: str

  def unigram_loss(self) -> float:
    """Cross-entropy (nats/byte) of held-out text under the training bytes' unigram
    distribution: the loss a model that ignores context would reach."""
    counts = _byte_counts(self.train).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    held = _byte_counts(self.held_out)  # not logp[held_out]: a 8× bigger copy
    return float(-(held @ logp) / held.sum())


def _byte_counts(data: np.ndarray) -> np.ndarray:
  """How often each byte value occurs, counted a slice at a time: bincount widens its input
  to int64 first, and for the standard library's 30 MB that whole 240 MB copy took most of
  the count's 0.2 s (0.04 s in slices)."""
  step = 1 << 20
  return sum((np.bincount(data[i:i + step], minlength=VOCAB) for i in range(0, len(data), step)),
             np.zeros(VOCAB, np.int64))


def _files(cfg: DataConfig) -> tuple[list[Path], str]:
  if cfg.corpus == "stdlib":
    root = Path(sysconfig.get_paths()["stdlib"])
    files = listing.files_under(root, ".py", skip="site-packages")
    return files, f"Python {sysconfig.get_python_version()} standard library ({root})"
  path = Path(cfg.corpus)
  if not path.exists():
    raise ConfigError(f"data.corpus {cfg.corpus!r} does not exist; give a text file, a "
                      f"directory of text files, or 'stdlib'")
  if path.is_dir():  # regular files only: a FIFO or device inside would block or never end
    files = listing.files_under(path)
    outdir.refuse_unfinished(files)  # an interrupted prepare's shards are not text
    _refuse_records(files)
    return files, str(path)
  mode = path.stat().st_mode
  if not stat.S_ISREG(mode):
    raise ConfigError(f"data.corpus {cfg.corpus!r} is a {_kind(mode)}, not a regular file: "
                      f"reading it could block or never end; give a text file, a directory "
                      f"of text files, or 'stdlib'")
  return [path], str(path)


def _refuse_records(files: list[Path]) -> None:
  """Parquet and Arrow files are records, not text: read as bytes they would train on
  their binary encoding."""
  found = next((f for f in files if records.is_record_file(f)), None)
  if found is not None:
    raise ConfigError(f"data.corpus holds {found}, a Parquet/Arrow file, which is not text: "
                      f"give the file itself as data.corpus, or prepare the directory with "
                      f"`shardlab data prepare` (docs/data.md)")


def _kind(mode: int) -> str:
  kinds = ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
           (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
  return next((name for test, name in kinds if test(mode)), "special file")


def load(cfg: DataConfig, seq_len: int) -> Corpus:
  files, source = _files(cfg)
  chunks, total = [], 0
  for f in files:
    if total >= cfg.max_bytes:
      break
    with open(f, "rb") as stream:  # at most what is still wanted: never a whole big file
      data = stream.read(cfg.max_bytes - total)
    chunks.append(data)
    total += len(data)
  corpus = np.frombuffer(b"".join(chunks), np.uint8)
  held = int(len(corpus) * cfg.held_out_fraction)
  if held < seq_len + 1 or len(corpus) - held < seq_len + 1:
    raise ConfigError(
        f"data.corpus {cfg.corpus!r} is empty or too small: {len(corpus)} bytes in "
        f"{len(files)} file(s); it needs at least {math.ceil((seq_len + 1) / cfg.held_out_fraction)} "
        f"bytes for windows of train.seq_len+1 = {seq_len + 1} with "
        f"data.held_out_fraction = {cfg.held_out_fraction}")
  return Corpus(corpus[:-held], corpus[-held:], source)


def rows(tokens: np.ndarray, seed: int, step: int, global_batch: int, seq_len: int,
         row_range: tuple[int, int]) -> np.ndarray:
  """Rows [lo, hi) of the global batch for `step`: random windows of seq_len+1 tokens."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len - 1, size=global_batch)[slice(*row_range)]
  return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple) -> tuple[int, int]:
  """The contiguous block of global batch rows this process's devices hold."""
  index_map = sharding.addressable_devices_indices_map(global_shape)
  starts = [idx[0].start or 0 for idx in index_map.values()]
  stops = [idx[0].stop or global_shape[0] for idx in index_map.values()]
  return min(starts), max(stops)


def global_batch(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int,
                 sharding: jax.sharding.Sharding) -> jax.Array:
  shape = (batch, seq_len + 1)
  local = rows(tokens, seed, step, batch, seq_len, process_rows(sharding, shape))
  return jax.make_array_from_process_local_data(sharding, local, shape)
