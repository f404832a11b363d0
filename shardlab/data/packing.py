"""Documents packed into fixed-length rows, with segment ids and per-document positions.

Rows are filled greedily in document order: a document goes into the current row if it
fits, else the row is closed (its rest is padding, segment id 0) and a new one started; a
document longer than a row is cut into row-sized pieces. So every row is one contiguous
slice of a shard's token stream, and the plan is just (shard, start, length) per row.
Segment ids number the documents of a row from 1; positions restart at 0 at each document
(and at a row's first token). The model masks attention by segment (parallel/context.py) and
the loss skips targets across documents and padding (models/lm.py). Chat data's loss mask
(data/chat.py) is cut with the same slice as its tokens, so a row's mask is always its own.
"""

import numpy as np

from shardlab.data import prepared_check
from shardlab.errors import ConfigError

PAD_ID = 0


def plan(doc_starts: np.ndarray, n_tokens: int, row_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(starts, lengths) of the rows packing one shard's documents into rows of `row_len`."""
  ends = np.append(doc_starts[1:], n_tokens)
  starts, lengths = [], []
  row_start, used = 0, 0
  for doc_start, doc_end in zip(doc_starts.tolist(), ends.tolist()):
    n = doc_end - doc_start
    if used and used + n > row_len:  # does not fit: close the row (padding follows)
      starts.append(row_start)
      lengths.append(used)
      used = 0
    if not used:
      row_start = doc_start
    while n > row_len - used:  # a document longer than a row: whole-row pieces
      starts.append(row_start)
      lengths.append(row_len)
      row_start, n, used = row_start + row_len, n - (row_len - used), 0
    used += n
  if used:
    starts.append(row_start)
    lengths.append(used)
  return np.asarray(starts, np.int64), np.asarray(lengths, np.int64)


def row(tokens: np.ndarray, doc_starts: np.ndarray, start: int, length: int,
        row_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens, segment_ids, positions) of one packed row, each int32 of `row_len`."""
  ids = np.full(row_len, PAD_ID, np.int32)
  ids[:length] = tokens[start:start + length]
  doc = np.searchsorted(doc_starts, np.arange(start, start + length), side="right")
  segments = np.zeros(row_len, np.int32)
  segments[:length] = doc - doc[0] + 1
  first = np.concatenate([[True], segments[1:] != segments[:-1]])
  index = np.arange(row_len)
  positions = (index - np.maximum.accumulate(np.where(first, index, 0))).astype(np.int32)
  return ids, segments, positions


class Rows:
  """Every packed row of a split's shards, addressed by one global row index."""

  def __init__(self, shards, row_len: int, what: str):
    self.shards, self.row_len = shards, row_len
    plans = [plan(s.doc_starts, len(s.tokens), row_len) for s in shards]
    self.shard_of = np.concatenate([np.full(len(p[0]), i, np.int64)
                                    for i, p in enumerate(plans)] or [np.zeros(0, np.int64)])
    self.starts = np.concatenate([p[0] for p in plans] or [np.zeros(0, np.int64)])
    self.lengths = np.concatenate([p[1] for p in plans] or [np.zeros(0, np.int64)])
    if len(self.starts) == 0:
      raise ConfigError(f"the {what} split holds no tokens")
    self.n_tokens = int(self.lengths.sum())
    if len({s.loss_mask is None for s in shards}) > 1:
      raise ConfigError(f"the {what} split mixes shards with and without a loss mask")
    # Each shard's files as mapped: a batch checks the ones it reads are still so.
    self.files = [[prepared_check.file_state(a) for a in (s.tokens, s.loss_mask)
                   if a is not None] for s in shards]

  def __len__(self) -> int:
    return len(self.starts)

  def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """{"tokens", "segment_ids", "positions"} (and "loss_mask" for chat data): int32
    len(indices) × row_len."""
    for shard in np.unique(self.shard_of[indices]):
      for state in self.files[shard]:
        prepared_check.unchanged(state)
    parts = [row(self.shards[self.shard_of[i]].tokens, self.shards[self.shard_of[i]].doc_starts,
                 int(self.starts[i]), int(self.lengths[i]), self.row_len) for i in indices]
    names = ("tokens", "segment_ids", "positions")
    out = {name: np.stack([p[k] for p in parts]) for k, name in enumerate(names)}
    if self.shards[0].loss_mask is not None:
      out["loss_mask"] = np.stack([self._mask(i) for i in indices])
    return out

  def _mask(self, i: int) -> np.ndarray:
    """Row i's loss mask (int32; 0 on padding), the same slice of its shard as its tokens."""
    start, length = int(self.starts[i]), int(self.lengths[i])
    mask = np.zeros(self.row_len, np.int32)
    mask[:length] = self.shards[self.shard_of[i]].loss_mask[start:start + length]
    return mask

  def padding_fraction(self) -> float:
    return 1 - self.n_tokens / (len(self) * self.row_len)
