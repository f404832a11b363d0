"""A mixture of experts in the plan: total and active parameters, the expert weights each
device stores, and the bytes expert parallelism moves by all-to-all.

A model config offers this by having `n_active_params`, `n_experts`, `experts_per_token`,
`n_expert_params`, `dispatch` and `capacity(tokens)` (models/moe_config.py; the contract's
EXPERTS group, shardlab.models.protocol); the FLOPs per
token it reports already count the active parameters only.

All-to-all bytes follow parallel/dispatch.py: each layer sends each device's dispatch buffer
there and back in the forward, again in the backward, and once more each way when full
remat reruns the forward. Capacity's buffer is E × C × D (C for the device's tokens);
dropless's is N × K·T × D (a worst-case slot for every assignment at every peer). Counted
as shardlab.observe.hlo counts an all-to-all: the buffer itself (what leaves the device is
(N − 1)/N of it).
"""

import dataclasses
import math

import jax.numpy as jnp

from shardlab import remat as remat_lib
from shardlab.models import protocol
from shardlab.plan.training import activations, comm as plan_comm
from shardlab.sharding import rules as rules_lib
from shardlab.training import precision as precision_lib
from shardlab.runtime.units import gib

EXPERT_WEIGHT = ("layers", "experts", "embed", "mlp")


@dataclasses.dataclass(frozen=True)
class Experts:
  total_params: int
  active_params: int
  expert_parallel: int  # devices the experts are split over
  expert_bytes_per_device: float  # the stored expert weights (all layers) on one device
  all_to_all_bytes: float  # per device per step


def is_moe(model) -> bool:
  # n_experts stands for the group: a config that has it registers only with all of
  # shardlab.models.protocol.EXPERTS.
  return protocol.has(model, "n_experts")


def figures(model, strategy: str, rule_overrides, mesh_shape: dict, global_batch: int,
            seq_len: int, param_bytes: int, act_bytes: int, remat: str) -> Experts | None:
  if not is_moe(model):
    return None
  rules = rules_lib.strategy(strategy, rule_overrides)
  mesh = _ShapeOnly(mesh_shape)
  stored = rules_lib.spec(EXPERT_WEIGHT, _expert_shape(model), rules.params, mesh,
                          "expert weights")
  ep, _, moved = _dispatch(model, rules, mesh_shape, global_batch, seq_len, act_bytes, remat)
  per_device = model.n_expert_params / math.prod(_factor(e, mesh_shape) for e in stored)
  return Experts(model.n_params, model.n_active_params, ep, per_device * param_bytes, moved)


def transfers(model, rules: rules_lib.Rules, mesh, global_batch: int, seq_len: int,
              act_bytes: int, remat: str) -> list[plan_comm.Transfer]:
  """The dispatch's all-to-alls as a transfer over the expert axes (none for a dense model
  or experts on every device), so the step time counts them."""
  if not is_moe(model):
    return []
  ep, axes, moved = _dispatch(model, rules, dict(mesh.shape), global_batch, seq_len,
                              act_bytes, remat)
  return [plan_comm.Transfer("all-to-all", moved, axes, "expert dispatch")] if moved else []


def _expert_shape(model) -> tuple:
  return (model.n_layers, model.n_experts, model.d_model, model.mlp_dim)


def _dispatch(model, rules, mesh_shape: dict, global_batch: int, seq_len: int,
              act_bytes: int, remat: str) -> tuple[int, tuple, float]:
  """(expert-parallel degree, its mesh axes, all-to-all bytes per device per step)."""
  split = rules_lib.spec(EXPERT_WEIGHT, _expert_shape(model), rules.activations,
                         _ShapeOnly(mesh_shape), "expert weights")
  entry = split[1] if len(split) > 1 else None
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  ep = _factor(entry, mesh_shape)
  tokens = global_batch * seq_len / math.prod(mesh_shape.get(a, 1) for a in rules.token_axes)
  rows = tokens * activations.expert_rows_per_token(model, tokens, ep)
  passes = 6 if remat_lib.recomputes_all(remat) else 4
  moved = 0.0 if ep == 1 else passes * model.n_layers * rows * model.d_model * act_bytes
  return ep, axes, moved


def for_plan(result) -> Experts | None:
  """The figures of a planner result (shardlab.plan.training.planner.Plan)."""
  r, e = result.request, result.estimate
  t = r.train
  policy = precision_lib.resolve("bf16" if t.precision == "auto" else t.precision)
  return figures(result.model, e.strategy, r.rules, e.mesh_shape, t.global_batch, t.seq_len,
                 jnp.dtype(policy.param_dtype).itemsize,
                 jnp.dtype(policy.compute_dtype).itemsize, t.remat)


def _factor(entry, mesh_shape: dict) -> int:
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh_shape.get(a, 1) for a in axes)


class _ShapeOnly:
  """What rules.spec reads of a mesh."""

  def __init__(self, shape: dict):
    self.shape, self.axis_names = dict(shape), tuple(shape)


def lines(e: Experts | None) -> list[str]:
  if e is None:
    return []
  return ["mixture of experts",
          f"  parameters        {e.total_params / 1e9:.2f}B total, "
          f"{e.active_params / 1e9:.2f}B active per token (FLOPs count these)",
          f"  expert weights    {gib(e.expert_bytes_per_device)} per device "
          f"(experts split {e.expert_parallel}-way over the expert axis)",
          f"  all-to-all        {gib(e.all_to_all_bytes)} per device per step", ""]
