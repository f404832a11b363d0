"""The planner: per-device memory, fit, minimum device count, communication, a roofline step
time, and a search over meshes — before renting any hardware.

    from shardlab.plan.training import planner as plan
    p = plan.plan(plan.Request.of(model="llama2-70b", target="a100-80g", devices=128))
    p = plan.plan(plan.Request.from_config(cfg, target="a100-80g"))  # what a run would run
    p.fits, p.estimate.memory.total, p.estimate.step_s, p.min_devices["overall"]

Every sharding comes from `state.shardings` on an abstract mesh (no devices, no memory), so
the planner and the train step cannot disagree about where a tensor lives.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from shardlab.errors import ConfigError
from shardlab.models import protocol
from shardlab.plan.training.estimate import (MAX_DEVICES, STRATEGIES, Estimate, abstract_mesh,
                                             default_shape, estimate, resolve_mesh,
                                             split_ici_dcn)
from shardlab.plan.training.request import PLANNER_TRAIN, Request, run_config, train_config
from shardlab.plan.training.scaling import thresholds
from shardlab.plan.training.fewest import min_devices
from shardlab.plan.training.search import factorizations, search
from shardlab.runtime import hardware
from shardlab.runtime.units import gib
from shardlab.training import precision as precision_lib

__all__ = ["MAX_DEVICES", "PLANNER_TRAIN", "STRATEGIES", "Estimate", "Plan", "Request",
           "abstract_mesh", "default_shape", "estimate", "factorizations", "min_devices",
           "per_strategy", "plan",
           "resolve_mesh", "run_config", "search", "split_ici_dcn", "thresholds",
           "train_config", "warnings"]


@dataclasses.dataclass(frozen=True)
class Plan:
  request: Request
  model: Any  # a bundled model config (shardlab.models)
  target: hardware.Accelerator
  estimate: Estimate
  # strategy -> fewest fitting devices (None if none); "overall" and "any_microbatches" (the
  # fewest at any microbatch count dividing the batch) -> {devices, strategy, mesh, ...}
  min_devices: dict
  thresholds: dict
  search: list[Estimate] | None = None
  compiled: dict | None = None
  warnings: tuple[str, ...] = ()
  # every strategy on this device count with its default mesh: an Estimate, or why it cannot run
  strategies: dict = dataclasses.field(default_factory=dict)

  @property
  def fits(self) -> bool:
    return self.estimate.fits


def plan(req: Request, search_meshes: bool = False) -> Plan:
  model = req.model_config()
  acc = hardware.get(req.target)
  train_config(req)  # validates optimizer / precision / remat / batch
  spec = resolve_mesh(req, model, acc)
  mins, least = min_devices(req, model, acc)
  if mins["overall"] is None:
    raise ConfigError(_nothing_fits(req, model, acc, least, mins["any_microbatches"]))
  est = estimate(req, model, acc, spec)
  train = train_config(req)
  policy = precision_lib.resolve(train.precision)
  p = jnp.dtype(policy.compute_dtype).itemsize
  g = precision_lib.gradient_dtype(policy, train.grad_dtype).itemsize
  found = search(req, model, acc, spec.n_devices) if search_meshes else None
  return Plan(req, model, acc, est, mins, thresholds(model, acc, p, g), found,
              warnings=tuple(warnings(req, model)),
              strategies=per_strategy(req, model, acc, spec.n_devices))


def _nothing_fits(req: Request, model, acc, least: Estimate | None, any_m: dict | None) -> str:
  t = req.train
  detail = (f"; the least it needs is {gib(least.memory.total, digits=1)} per device "
            f"({least.strategy} on {least.n_devices}: {least.mesh})" if least else "")
  if any_m:
    return (f"model {model.name!r} cannot fit on {acc.name} at {t.microbatches} "
            f"microbatch(es) at any device count up to {MAX_DEVICES}; with "
            f"--microbatches {any_m['microbatches']} it fits on {any_m['devices']} devices "
            f"({any_m['strategy']}: {any_m['mesh']})")
  return (f"model {model.name!r} cannot fit on {acc.name} ({gib(acc.usable_bytes)} "
          f"usable) at any device count up to {MAX_DEVICES} with global_batch "
          f"{t.global_batch} × seq_len {t.seq_len}, remat {t.remat!r}, at any "
          f"microbatch count{detail}; lower the batch or sequence, use remat='full' or a "
          f"larger target")


def warnings(req: Request, model) -> list[str]:
  out = []
  if req.train.seq_len > model.max_seq_len:
    # train.py refuses this run; a planner answers anyway (the step's cost is well defined)
    # and says what it would take.
    why = protocol.get(model, "position_limit")
    out.append(f"--seq-len {req.train.seq_len} exceeds {model.name}'s trained context "
               f"(max_seq_len {model.max_seq_len}): {why}, and train.py refuses it (raise "
               f"max_seq_len in a model TOML, and extend the context, to train this long)")
  return out


def per_strategy(req: Request, model, acc, n: int) -> dict[str, Estimate | str]:
  """Every strategy on n devices with its usual mesh; a strategy that cannot run there maps
  to the reason."""
  out: dict[str, Estimate | str] = {}
  for strategy in STRATEGIES:
    spec = split_ici_dcn(default_shape(strategy, n, model, acc), acc.ici_domain)
    try:
      out[strategy] = estimate(req, model, acc, spec, strategy)
    except ConfigError as e:
      out[strategy] = str(e)
  return out
