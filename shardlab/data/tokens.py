"""Tokenized documents: read text (sources.py), tokenize once in parallel (workers.py), write shards plus an
index (`shardlab data prepare`), and read them back memory-mapped.

A prepared directory holds index.json (written last: outdir.py), a copy of the tokenizer,
and per split (`train`, `held_out`) shards `<split>-NNNNN.npy` (the token ids, uint16 or
uint32, documents back to back, each followed by EOS when the tokenizer has one) with
`<split>-NNNNN.docs.npy` (each document's start offset). A shard ends at a document
boundary. nanoGPT-style token files (`.bin`: raw uint16; `.npy`) are read as one stream,
split into documents after each EOS.
"""

import dataclasses
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from shardlab.bounds import Int
from shardlab.config import BOUNDS
from shardlab.errors import ConfigError
from shardlab.data import outdir, prepared_check, sources, workers as workers_lib
from shardlab.data import tokenizer as tokenizer_lib

INDEX = outdir.INDEX
SPLITS = ("train", "held_out")
TOKEN_FILES = (".bin", ".npy")
# prepare()'s ranges, which `data prepare --workers/--shard-tokens` parse with.
WORKERS = Int(min=0, note="0: one per core")
SHARD_TOKENS = Int(min=1)


@dataclasses.dataclass(frozen=True)
class Shard:
  tokens: np.ndarray  # 1-D ids (memory-mapped when read from disk)
  doc_starts: np.ndarray  # int64 offsets into `tokens`, ascending, the first 0
  loss_mask: np.ndarray | None = None  # chat data: 1 where a token is trained on (data/chat.py)


_WORKER_TOKENIZER = None


def _start_worker(spec: str) -> None:
  global _WORKER_TOKENIZER
  _WORKER_TOKENIZER = tokenizer_lib.load(spec)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
  tok = _WORKER_TOKENIZER
  eos = [] if tok.eos_id is None else [tok.eos_id]
  dtype = tokenizer_lib.token_dtype(tok.vocab_size)
  return [np.asarray(tok.encode(t) + eos, dtype) for t in texts]


def _chunks(docs: Iterator[str], size: int) -> Iterator[list[str]]:
  chunk = []
  for doc in docs:
    chunk.append(doc)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


class _Writer:
  """Collects one split's documents into shards of about `shard_tokens` tokens, written
  under `out` (or kept in memory when `out` is None)."""

  def __init__(self, split: str, out: Path | None, shard_tokens: int, dtype):
    self.split, self.out, self.limit, self.dtype = split, out, shard_tokens, dtype
    self.docs, self.count, self.shards, self.files = [], 0, [], []

  def add(self, ids: np.ndarray) -> None:
    self.docs.append(ids)
    self.count += len(ids)
    if self.count >= self.limit:
      self.flush()

  def flush(self) -> None:
    if not self.docs:
      return
    tokens = np.concatenate(self.docs).astype(self.dtype)
    starts = np.cumsum([0] + [len(d) for d in self.docs[:-1]]).astype(np.int64)
    if self.out is None:
      self.shards.append(Shard(tokens, starts))
    else:
      name = f"{self.split}-{len(self.files):05d}"
      np.save(self.out / f"{name}.npy", tokens)
      np.save(self.out / f"{name}.docs.npy", starts)
      self.files.append({"tokens": f"{name}.npy", "docs": f"{name}.docs.npy",
                         "n_tokens": len(tokens), "n_docs": len(starts)})
    self.docs, self.count = [], 0


def tokenize(docs: Iterator[str], tokenizer_spec: str, held_out_fraction: float,
             out: Path | None = None, workers: int = 0, shard_tokens: int = 2**27,
             say=None) -> dict:
  """Tokenizes `docs` in `workers` processes (0: every core), sending every ⌈1/fraction⌉-th
  document to the held-out split; returns {split: _Writer}. Reports progress to `say`."""
  tok = tokenizer_lib.load(tokenizer_spec)
  dtype = tokenizer_lib.token_dtype(tok.vocab_size)
  writers = {s: _Writer(s, out, shard_tokens, dtype) for s in SPLITS}
  workers = workers or os.cpu_count() or 1
  start, last, n, total = time.perf_counter(), 0.0, 0, 0
  with workers_lib.Pool(workers, _start_worker, (tokenizer_spec,)) as pool:
    for encoded in pool.map(_encode_chunk, _chunks(docs, 64)):
      for ids in encoded:
        held = int((n + 1) * held_out_fraction) > int(n * held_out_fraction)
        writers["held_out" if held else "train"].add(ids)
        n, total = n + 1, total + len(ids)
      now = time.perf_counter()
      if say and now - last > 1.0:
        say(f"tokenized {n:,} documents, {total:,} tokens ({total / (now - start):,.0f} "
            f"tokens/s)")
        last = now
  for w in writers.values():
    w.flush()
  if say:
    say(f"tokenized {n:,} documents, {total:,} tokens in {time.perf_counter() - start:.1f} s")
  return writers


def prepare(source: str, out: str | Path, tokenizer_spec: str, text_field: str = "text",
            held_out_fraction: float = 0.02, workers: int = 0, shard_tokens: int = 2**27,
            max_bytes: int | None = None, say=None, stdlib_files=None,
            overwrite: bool = False) -> dict:
  """`shardlab data prepare`: tokenizes `source` into shards + index.json under `out`
  (new or empty; with `overwrite`, an earlier prepare's output, finished or not, is
  replaced); returns the index. The index is written last (outdir.py): until then `out`
  is an unfinished prepare, and after a failure (not an interruption) it is removed."""
  out = Path(out)
  WORKERS.check(workers, "--workers")
  SHARD_TOKENS.check(shard_tokens, "--shard-tokens")
  if max_bytes is not None:  # None: all the text
    BOUNDS["data.max_bytes"].check(max_bytes, "--max-bytes")
  tok = tokenizer_lib.load(tokenizer_spec)  # settings checked before `out` is touched
  docs = sources.documents(source, text_field, max_bytes, stdlib_files)
  outdir.claim(out, overwrite, _command(source, out, tokenizer_spec, text_field,
                                        held_out_fraction, workers, shard_tokens, max_bytes))
  try:
    writers = tokenize(docs, tokenizer_spec, held_out_fraction, out, workers, shard_tokens, say)
    path = tokenizer_lib.find(tokenizer_spec)
    if path is not None:
      shutil.copy2(path, out / path.name)
    index = write_index(out, source, path.name if path else "bytes", tok, writers,
                        "documents", held_out_fraction)
  except ConfigError:
    shutil.rmtree(out, ignore_errors=True)  # nothing usable: a rerun may use the name
    raise
  return index


def write_index(out: Path, source, tokenizer_name: str, tok, writers: dict, what: str,
                held_out_fraction: float, **extra) -> dict:
  """The finished directory's index.json (outdir.finish: written last), once both splits
  hold something; `extra` sections (chat's) beside the common fields."""
  index = {"format": 1, "source": str(source), "tokenizer": tokenizer_name,
           "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
           "dtype": tokenizer_lib.token_dtype(tok.vocab_size).name,
           "splits": {s: w.files for s, w in writers.items()}, **extra}
  if not index["splits"]["held_out"] or not index["splits"]["train"]:
    raise ConfigError(f"{source} gave too few {what} for a train and a held-out split "
                      f"(held-out fraction {held_out_fraction}); give more or a larger "
                      f"fraction")
  outdir.finish(out, index)
  return index


def _command(source, out, tokenizer_spec, text_field, held_out_fraction, workers,
             shard_tokens, max_bytes) -> str:
  """The command line that redoes this prepare (saved in its marker, for the message that
  refuses an unfinished one)."""
  given = [("--tokenizer", tokenizer_spec, "bytes"), ("--text-field", text_field, "text"),
           ("--held-out-fraction", held_out_fraction, 0.02), ("--workers", workers, 0),
           ("--shard-tokens", shard_tokens, 2**27), ("--max-bytes", max_bytes, None)]
  flags = [str(x) for name, value, default in given if value != default
           for x in (name, value)]
  return shlex.join(["shardlab", "data", "prepare", str(source), str(out), *flags])


def is_prepared(source: str) -> bool:
  return (Path(source) / INDEX).is_file()


def read_prepared(directory: str | Path) -> tuple[dict, dict[str, list[Shard]]]:
  """(index, {split: shards}) of a prepared directory, memory-mapped."""
  directory = Path(directory)
  try:
    index = json.loads((directory / INDEX).read_bytes())
    prepared_check.check_index(directory, index)
    splits = {s: [Shard(*prepared_check.load_shard(directory, f, index))
                  for f in index["splits"][s]] for s in SPLITS}
  except (OSError, EOFError, KeyError, ValueError, SyntaxError, RecursionError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f"{directory} is not a complete prepared data directory "
                      f"({type(e).__name__}: {e}); rerun shardlab data prepare") from None
  return index, splits


def read_token_file(path: str | Path, tok, held_out_fraction: float):
  """{split: [Shard]} of a nanoGPT-style token file of `tok`'s ids: documents end after each
  EOS; the last `held_out_fraction` of the tokens (from a document start) is held out."""
  path = Path(path)
  try:  # numpy's own errors for a damaged file are of many kinds (prepared_check._load)
    tokens = (np.memmap(path, np.uint16, mode="r") if path.suffix == ".bin"
              else np.load(path, mmap_mode="r"))
  except Exception as e:
    raise ConfigError(f"data.corpus {str(path)!r} is not a readable token file "
                      f"({type(e).__name__}: {str(e)[:200]}); valid: raw uint16 ids (.bin) "
                      f"or a 1-D integer .npy array") from None
  if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
    raise ConfigError(f"data.corpus {str(path)!r} holds a {tokens.ndim}-D {tokens.dtype} "
                      f"array; a token file is one 1-D stream of integer ids")
  top = int(tokens.max()) if len(tokens) else 0
  if tokens.dtype.kind == "i" and len(tokens) and int(tokens.min()) < 0:
    top = int(tokens.min())  # a negative id is as outside the vocabulary as a large one
  if not 0 <= top < tok.vocab_size:  # one pass; an id past the vocabulary trains on garbage
    raise ConfigError(f"data.corpus {str(path)!r} holds token id {top}, outside the "
                      f"vocabulary of data.tokenizer {tok.spec!r} ({tok.vocab_size} ids); set "
                      f"data.tokenizer to the tokenizer that wrote the file")
  ends = [] if tok.eos_id is None else np.flatnonzero(np.asarray(tokens) == tok.eos_id) + 1
  starts = np.unique(np.concatenate([[0], ends])).astype(np.int64)
  starts = starts[starts < len(tokens)]
  cut = int(starts[np.searchsorted(starts, int(len(tokens) * (1 - held_out_fraction)))
                   - 1]) if len(starts) > 1 else int(len(tokens) * (1 - held_out_fraction))
  train = starts[starts < cut]
  return {"train": [Shard(tokens[:cut], train)],
          "held_out": [Shard(tokens[cut:], np.concatenate([[0], starts[starts > cut] - cut]))]}
