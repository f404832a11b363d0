"""A run's input: which rows each step trains on, where the input stands (saved in every
checkpoint), held-out batches, and a background prefetcher.

Two kinds, picked by the data config (`feed(...)`):
  ByteFeed    the byte-level default (data/corpus.py): random windows, a pure function of
              (seed, step); its position is the step.
  PackedFeed  tokenized documents packed into rows (data/packing.py), read in an order
              shuffled per epoch from the seed; its position is the number of rows consumed,
              saved in the checkpoint's progress so a resume continues exactly there (also
              when train.global_batch changed under --allow-config-change).
Each process builds only its own rows of a global batch (process_rows) and hands them to
jax.make_array_from_process_local_data. The position is global (a step, or rows), never a
process's own count: a resume on another process count or mesh, with the same global batch,
reads the same batches, each process its block of them (tests/test_restart_resize.py).
"""

import functools
import queue
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from shardlab.config import DataConfig
from shardlab.errors import ConfigError
from shardlab.data import chat, chat_tokens, corpus as corpus_lib, packing, prepared_check
from shardlab.data import sources, tokens
from shardlab.data import tokenizer as tokenizer_lib

EVAL_SEED_OFFSET = 1_000_003  # held-out batches never share a seed with training batches


def is_packed(cfg: DataConfig) -> bool:
  """Whether this data config reads tokenized, packed documents (else bytes)."""
  corpus = cfg.corpus
  return (cfg.tokenizer != tokenizer_lib.BYTES or tokens.is_prepared(corpus)
          or corpus.endswith(tokens.TOKEN_FILES) or sources.is_records(corpus))


def place(local, sharding, global_rows: int):
  """The global batch (an array, or a dict of them) from this process's rows."""
  return jax.tree.map(lambda a: jax.make_array_from_process_local_data(
      sharding, a, (global_rows, *a.shape[1:])), local)


class ByteFeed:
  kind, unit = "bytes", "byte"

  def __init__(self, corpus: corpus_lib.Corpus, seed: int, global_batch: int, seq_len: int):
    self.corpus, self.seed, self.batch_rows, self.seq_len = corpus, seed, global_batch, seq_len
    self.tokenizer = tokenizer_lib.ByteTokenizer()

  def start(self, step: int, saved: dict | None) -> int:
    return step

  def advance(self, position: int) -> int:
    return position + 1

  def host(self, position: int, rows: tuple[int, int]) -> np.ndarray:
    return corpus_lib.rows(self.corpus.train, self.seed, position, self.batch_rows, self.seq_len, rows)

  def held_out(self, i: int, rows: tuple[int, int]) -> np.ndarray:
    return corpus_lib.rows(self.corpus.held_out, self.seed + EVAL_SEED_OFFSET, i, self.batch_rows,
                     self.seq_len, rows)

  def state(self, position: int) -> dict:
    return {"kind": self.kind, "step": position}

  @functools.cached_property
  def _unigram(self) -> float:  # said at the start and again in the summary: computed once
    return self.corpus.unigram_loss()

  def unigram_loss(self) -> float:
    return self._unigram

  def describe(self) -> str:
    return (f"{self.corpus.source}: {len(self.corpus.train):,} train / "
            f"{len(self.corpus.held_out):,} held-out bytes; unigram baseline "
            f"{self.unigram_loss():.3f} nats/byte")


class PackedFeed:
  kind, unit = "packed", "token"

  def __init__(self, cfg: DataConfig, seed: int, global_batch: int, seq_len: int,
               say: Callable[[str], None] | None = None):
    self.seed, self.batch_rows = seed, global_batch
    splits, self.tokenizer, self.source = _splits(cfg, say)
    self.train = packing.Rows(splits["train"], seq_len + 1, "train")
    self.held = packing.Rows(splits["held_out"], seq_len + 1, "held-out")
    self._orders: dict[int, np.ndarray] = {}

  def start(self, step: int, saved: dict | None) -> int:
    """The position of `step`'s batch: the saved rows consumed on a resume (whatever
    train.global_batch was then); else step × batch rows, where a run on this data from the
    start would be (a fresh run, or a byte-level checkpoint resumed under
    --allow-config-change)."""
    state = (saved or {}).get("data")
    if not isinstance(state, dict) or state.get("kind") != self.kind:
      return step * self.batch_rows
    natural = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not all(natural(state.get(k)) for k in ("rows_consumed", "rows_per_epoch")):
      raise ConfigError(f"the checkpoint's data position {state!r} is damaged: rows_consumed "
                        f"and rows_per_epoch must be integers >= 0; start over with --fresh")
    if state["rows_per_epoch"] != len(self.train):
      raise ConfigError(f"the checkpoint's data had {state['rows_per_epoch']} rows per epoch, "
                        f"this data has {len(self.train)}: the data or train.seq_len changed, "
                        f"so its position cannot be resumed; start over with --fresh")
    return int(state["rows_consumed"])

  def advance(self, position: int) -> int:
    return position + self.batch_rows

  def order(self, g: np.ndarray) -> np.ndarray:
    """Row indices of global positions `g`: a fresh permutation per epoch, from the seed."""
    n, out = len(self.train), np.empty(len(g), np.int64)
    for epoch in np.unique(g // n):
      if epoch not in self._orders:
        self._orders = {epoch: np.random.default_rng([self.seed, int(epoch)]).permutation(n)}
      picked = g // n == epoch
      out[picked] = self._orders[epoch][g[picked] % n]
    return out

  def host(self, position: int, rows: tuple[int, int]) -> dict:
    return self._checked(self.train.batch(self.order(np.arange(position + rows[0],
                                                               position + rows[1]))))

  def held_out(self, i: int, rows: tuple[int, int]) -> dict:
    start = i * self.batch_rows
    return self._checked(self.held.batch(np.arange(start + rows[0], start + rows[1]) %
                                         len(self.held)))

  def _checked(self, batch: dict) -> dict:
    """Every id a batch holds, checked against the vocabulary as the batch is built (the
    directory's read looked at each shard's head only: prepared_check.FIRST_LOOK)."""
    prepared_check.check_ids(batch["tokens"], self.tokenizer.vocab_size,
                             f"a batch of {self.source}")
    return batch

  def state(self, position: int) -> dict:
    return {"kind": self.kind, "rows_consumed": position, "rows_per_epoch": len(self.train),
            "epoch": position // len(self.train)}

  def unigram_loss(self) -> float:
    """Held-out cross-entropy (nats/token) under the train tokens' unigram distribution
    (for chat data, of the assistant tokens: those the loss reads)."""
    return self._unigram

  @functools.cached_property
  def _unigram(self) -> float:  # a pass over the train split: once a run
    vocab = self.tokenizer.vocab_size
    counts = np.ones(vocab, np.float64)
    for shard in self.train.shards:
      counts += np.bincount(_trained_tokens(shard, 2**24), minlength=vocab)[:vocab]
    logp = np.log(counts / counts.sum())
    held = np.concatenate([_trained_tokens(s) for s in self.held.shards])
    return float(-logp[held].mean())

  def describe(self) -> str:
    return (f"{self.source}: {self.train.n_tokens:,} train / {self.held.n_tokens:,} held-out "
            f"tokens ({self.tokenizer.spec}, vocab {self.tokenizer.vocab_size}) in "
            f"{len(self.train):,} packed rows ({self.train.padding_fraction():.1%} padding); "
            f"unigram baseline {self.unigram_loss():.3f} nats/token{self._trained()}")

  def _trained(self) -> str:
    """For chat data, how much of the train split the loss reads."""
    shards = self.train.shards
    if shards[0].loss_mask is None:
      return ""
    trained = sum(int(np.asarray(s.loss_mask).sum()) for s in shards)
    return f"; the loss reads {trained:,} assistant tokens ({trained / self.train.n_tokens:.1%})"


def _trained_tokens(shard, limit: int = 2**22) -> np.ndarray:
  """A shard's first `limit` tokens the loss reads: all, or for chat data the assistant
  ones (so the unigram baseline compares with a masked loss)."""
  ids = np.asarray(shard.tokens[:limit])
  return ids if shard.loss_mask is None else ids[np.asarray(shard.loss_mask[:limit]) == 1]


def _splits(cfg: DataConfig, say):
  """({split: shards}, tokenizer, description) for a packed data config."""
  if tokens.is_prepared(cfg.corpus):
    index, splits = tokens.read_prepared(cfg.corpus)
    return splits, _prepared_tokenizer(cfg.corpus, index), f"{cfg.corpus} (prepared)"
  tok = tokenizer_lib.load(cfg.tokenizer)
  if cfg.corpus.endswith(tokens.TOKEN_FILES):
    return tokens.read_token_file(cfg.corpus, tok, cfg.held_out_fraction), tok, cfg.corpus
  if chat.is_chat(cfg.corpus):  # conversations: the chat template, assistant turns trained on
    writers = chat_tokens.tokenize(cfg.corpus, cfg.tokenizer, cfg.held_out_fraction, say=say)
    return {s: w.shards for s, w in writers.items()}, tok, f"{cfg.corpus} (chat)"
  files, source = (corpus_lib._files(cfg) if cfg.corpus == "stdlib" else (None, cfg.corpus))
  docs = sources.documents(cfg.corpus, cfg.text_field, cfg.max_bytes, files)
  writers = tokens.tokenize(docs, cfg.tokenizer, cfg.held_out_fraction, workers=0,
                            say=say)
  return {s: w.shards for s, w in writers.items()}, tok, source


def feed(cfg: DataConfig, seed: int, global_batch: int, seq_len: int, say=None):
  if is_packed(cfg):
    return PackedFeed(cfg, seed, global_batch, seq_len, say)
  return ByteFeed(corpus_lib.load(cfg, seq_len), seed, global_batch, seq_len)


class Prefetcher:
  """Builds batch k+1.. (up to `depth` ahead) in a background thread while step k runs;
  `wait_s` is the time the caller spent waiting for input."""

  def __init__(self, produce: Callable[[int], object], first: int, depth: int):
    self.produce, self.next, self.depth, self.wait_s = produce, first, depth, 0.0
    self.queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self.stop, self.thread, self.kept = threading.Event(), None, None
    if depth > 0:
      self.thread = threading.Thread(target=self._work, args=(first,), daemon=True,
                                     name="shardlab-prefetch")
      self.thread.start()

  def _work(self, k: int) -> None:
    while not self.stop.is_set():
      try:
        item = (k, self.produce(k), None)
      except BaseException as error:  # handed to the caller, raised there
        item = (k, None, error)
      while not self.stop.is_set():
        try:
          self.queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[2] is not None:
        return
      k += 1

  def peek(self, k: int):
    """Batch k, kept for the `get(k)` that follows (the first batch, to compile with)."""
    self.kept = (k, self.get(k))
    return self.kept[1]

  def get(self, k: int):
    """Batch k (the calls come in order: first, first+1, ...)."""
    if self.kept is not None and self.kept[0] == k:
      batch, self.kept = self.kept[1], None
      return batch
    start = time.perf_counter()
    if self.thread is None:
      batch = self.produce(k)
    else:
      got, batch, error = self.queue.get()
      if error is not None:
        raise error
      assert got == k, f"prefetcher out of order: asked for {k}, had {got}"
    self.wait_s += time.perf_counter() - start
    return batch

  def close(self) -> None:
    self.stop.set()
    if self.thread is not None:
      self.thread.join(timeout=5)
      if self.thread.is_alive():
        print("warning: the prefetch thread did not stop", file=sys.stderr)


def tokenizer_for(cfg: DataConfig):
  """The tokenizer a run with this data config trained with (a prepared directory's own)."""
  if tokens.is_prepared(cfg.corpus):
    return _prepared_tokenizer(cfg.corpus, tokens.read_prepared(cfg.corpus)[0])
  return tokenizer_lib.load(cfg.tokenizer)


def _prepared_tokenizer(directory: str, index: dict):
  """A prepared directory's own tokenizer (the copy `data prepare` wrote beside its index)."""
  spec = index["tokenizer"]
  return tokenizer_lib.load(spec if spec == tokenizer_lib.BYTES else f"{directory}/{spec}")
