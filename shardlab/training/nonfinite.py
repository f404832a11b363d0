"""The guard against non-finite steps (train.nonfinite): counted on the device, checked at
log steps and before every save, so no step waits for the host."""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardlab.config import TrainConfig


class NonFiniteError(RuntimeError):
  """Training hit a non-finite loss or gradient norm (see train.nonfinite); the CLI exits 3."""


def _tally(counts: dict, finite, loss, grad_norm, limit: int) -> dict:
  """One step's finiteness folded into the running counts, on the device."""
  bad = jnp.logical_not(finite)
  step = counts["step"] + 1
  run = jnp.where(bad, counts["run"] + 1, 0)
  trip = (counts["trip"] < 0) & (run >= limit)
  return {"step": step, "bad": counts["bad"] + bad.astype(jnp.int32), "run": run,
          "last": jnp.where(bad, step, counts["last"]),
          "trip": jnp.where(trip, step, counts["trip"]),
          "loss": jnp.where(trip, loss, counts["loss"]),
          "grad_norm": jnp.where(trip, grad_norm, counts["grad_norm"])}


class NonFiniteGuard:
  """Counts non-finite steps on the device, so no step waits for the host. The loop fetches
  the counts at log steps and before every save, and `check` raises NonFiniteError once the
  policy's limit is reached: one such step under "stop", max_skipped in a row under "skip"."""

  def __init__(self, cfg: TrainConfig, mesh, first_step: int, skipped: int = 0):
    self.cfg = cfg
    self.limit = 1 if cfg.nonfinite == "stop" else cfg.max_skipped
    ints = {"step": first_step, "bad": skipped, "run": 0, "last": -1, "trip": -1}
    counts = {**{k: np.int32(v) for k, v in ints.items()},
              "loss": np.float32(0), "grad_norm": np.float32(0)}
    self.counts = jax.device_put(counts, NamedSharding(mesh, PartitionSpec()))
    self._tally = jax.jit(functools.partial(_tally, limit=self.limit))

  def after_step(self, metrics: dict) -> None:
    self.counts = self._tally(self.counts, metrics["finite"], metrics["loss"],
                              metrics["grad_norm"])

  def fetch(self) -> dict:
    """The counts on the host: this waits for the steps dispatched so far."""
    return {k: v.item() for k, v in jax.device_get(self.counts).items()}

  def check(self, counts: dict, newest: Callable[[], str]) -> None:
    """Raises NonFiniteError if the limit was reached; `newest()` names the newest
    checkpoint (every saved one is finite)."""
    if counts["trip"] >= 0:
      raise NonFiniteError(self.message(counts, newest()))

  def message(self, counts: dict, newest: str) -> str:
    t, step = self.cfg, counts["trip"]
    values = f"loss {counts['loss']:.4g}, grad_norm {counts['grad_norm']:.4g}"
    if t.nonfinite == "stop":
      what = (f"step {step}: the loss or gradient norm is not finite ({values}); "
              f"train.nonfinite=stop: stopped without saving step {step} or later")
      other = "; or set train.nonfinite=skip to skip such steps"
    else:
      what = (f"steps {step - self.limit + 1}-{step}: {self.limit} non-finite steps in a row "
              f"(train.max_skipped {t.max_skipped}; the last: {values}); stopped without "
              f"saving")
      other = ""
    return (f"{what}. {newest}. Training diverged: lower train.lr (now {t.lr:g}) or raise "
            f"train.warmup_steps (now {t.warmup_steps}){other}")



def last_good(ckpt) -> str:
  """Names the newest checkpoint once pending saves are durable: all saved states are
  finite, since the counts are checked before every save."""
  if ckpt is None:
    return "No checkpoint was kept (no --checkpoint-dir)"
  ckpt.wait()
  step = ckpt.latest_step()
  if step is None:
    return f"No checkpoint was saved in {ckpt.directory} before it"
  return (f"Last good checkpoint: step {step} in {ckpt.directory} (a rerun resumes from it; "
          f"train.lr and train.warmup_steps may change on resume)")
