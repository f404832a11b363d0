"""The data of `sl.fit`: a source of train batches whose position a checkpoint can hold, so
a resumed run sees the batches an uninterrupted one would have.

Two kinds resume exactly:
  a function `batch(step) -> batch`   stateless: batch k is the same whenever it is asked
                                      for (nothing is saved; a resume asks from its step on)
  an iterator with `state()` and      `state()` is the JSON-able position of the batch
  `restore(state)`                    `next()` returns next; it is saved with every
                                      checkpoint and `restore`d on resume
A plain iterator (no state/restore) is taken only without a checkpoint directory.
A batch is any tree of arrays whose leading dimension is the batch: this process's rows
(all of them in a one-process run).
"""

import copy
import threading

import jax

from shardlab.data import feed as feed_lib
from shardlab.errors import ConfigError


def place(batch, sharding):
  """This process's rows of a batch tree as global arrays split over the batch axes."""
  rows = jax.tree.leaves(batch)[0].shape[0]
  return feed_lib.place(batch, sharding, rows * jax.process_count())


class StepFunction:
  """`batch(step)`: nothing to save."""
  kind = "batch(step) function"

  def __init__(self, fn):
    self.fn = fn

  def start(self, saved: dict | None) -> None:
    pass

  def produce(self, step: int):
    return self.fn(step)

  def state(self, step: int):
    return None


class Iterated:
  """An iterator, with `state()`/`restore(state)` if it resumes. Batches are built ahead in
  the prefetch thread, so the position of each is taken just before it is made and kept
  until the checkpoint of the step before it has been written."""

  def __init__(self, iterator, resumable: bool):
    self.iterator, self.resumable = iterator, resumable
    self.kind = "iterator, its position saved with checkpoints" if resumable else "iterator"
    self.lock, self.positions = threading.Lock(), {}

  def start(self, saved: dict | None) -> None:
    if saved is not None and self.resumable:
      self.iterator.restore(saved["data"])

  def produce(self, step: int):
    with self.lock:
      if self.resumable:
        self.positions[step] = copy.deepcopy(self.iterator.state())  # not a live view
      try:
        return next(self.iterator)
      except StopIteration:
        raise ConfigError(f"sl.fit: the data iterator ran out at step {step}; give fewer "
                          f"steps, or an iterator that repeats") from None

  def state(self, step: int):
    """The position of batch `step` (the next one the run will take)."""
    if not self.resumable:
      return None
    with self.lock:
      # Not built yet (no prefetch, or the thread is behind): the iterator stands there.
      position = self.positions.get(step)
      if position is None:
        position = self.iterator.state()
      for k in [k for k in self.positions if k < step]:
        del self.positions[k]
      return position


def source(data, checkpointing: bool):
  """The run's source for `data`; an iterator that cannot resume is refused when the run
  checkpoints (its resume would replay the data from the start)."""
  if callable(data) and not hasattr(data, "__next__"):
    return StepFunction(data)
  if not hasattr(data, "__iter__"):
    raise ConfigError(f"sl.fit: data must be a function batch(step) -> batch or an "
                      f"iterator of batches, got {type(data).__name__}")
  iterator = data if hasattr(data, "__next__") else iter(data)
  resumable = callable(getattr(iterator, "state", None)) and callable(
      getattr(iterator, "restore", None))
  if checkpointing and not resumable:
    raise ConfigError(f"sl.fit: data is an iterator ({type(iterator).__name__}) without "
                      f"state() and restore(state), so a resumed run could not continue "
                      f"where it stopped; give a function batch(step) -> batch, add those "
                      f"two methods, or run without checkpoint_dir")
  # Positions are kept only for checkpoints (a run without them would hoard one a step).
  return Iterated(iterator, resumable and checkpointing)


def eval_batches(eval_data):
  """The held-out batches of one evaluation: a sequence of batches, or a function () -> an
  iterable of them (called at every evaluation)."""
  if callable(eval_data):
    return eval_data()
  if isinstance(eval_data, (list, tuple)):
    return eval_data
  raise ConfigError(f"sl.fit: eval_data must be a list of batches or a function () -> "
                    f"iterable of batches, got {type(eval_data).__name__}")
