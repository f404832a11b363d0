"""Strategies as rules tables: logical axis name → mesh axes.

Each strategy has three tables (after Levanter: where a tensor lives is not where it is
computed on, and that difference *is* FSDP/ZeRO):
  params      where parameters (and, unless `opt_state` differs, gradients) live;
  opt_state   where optimizer state lives (ZeRO-1/2 shard it over the batch axes);
  activations where the compute happens: batch over data×fsdp, heads/mlp/vocab over tensor.
A known logical name absent from a table is replicated; a name no table and no registration
knows is an error (a typo such as "mpl" would otherwise silently replicate). This module is
the only place that turns logical names into PartitionSpecs.
"""

import dataclasses

from jax.sharding import Mesh, PartitionSpec

from shardlab.errors import ConfigError, unknown
from shardlab.sharding.mesh import AXES as MESH_AXES

# The names the bundled strategies speak. A module may use any of these, or register its own
# (`register_axes("patches")`) and map them with rule overrides.
# `length` is the sequence where attention reads it (queries, keys, values, MLP, logits);
# `residual_length` the residual stream's and the norms' (Megatron-SP splits only that one).
# `lora_rank` is a LoRA adapter's rank dim (parallel/lora.py): small, replicated everywhere.
# `experts` is the expert dim of a mixture of experts' weights (models/experts.py).
BUILTIN_AXES = ("batch", "length", "residual_length", "embed", "heads", "kv_heads",
                "head_dim", "mlp", "vocab", "layers", "lora_rank", "experts")
_registered: set[str] = set(BUILTIN_AXES)


def register_axes(*names: str) -> None:
  """Declares new logical axis names (replicated unless a rule maps them)."""
  for name in names:
    if not isinstance(name, str) or not name.isidentifier():
      raise ConfigError(f"a logical axis name must be an identifier, got {name!r}")
  _registered.update(names)


# Context parallelism: every strategy splits the sequence over the `context` mesh axis, a
# no-op on meshes without one (a mesh axis the mesh lacks counts as size 1).
# Expert parallelism: the `expert` axis splits the batch like a data axis and holds 1/n of
# each layer's experts (tokens travel to them by all-to-all, parallel/dispatch.py); a no-op on
# meshes without one.
BATCH = {"batch": ("data", "fsdp", "expert"), "length": "context",
         "residual_length": "context"}
EXPERT = "expert"
# Megatron sequence parallelism: the residual stream between TP regions split over `tensor`.
SEQUENCE = {"residual_length": ("context", "tensor")}
TENSOR = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# Devices that split the sequence hold the same weights, as batch replicas do: FSDP and ZeRO
# shard the state over them too (else at a large context degree the whole state sits on each
# of them).
# An expert weight's `experts` dim claims the expert axis first, so its embed dim is split
# over the others.
FSDP = {"embed": ("fsdp", "context", "expert")}
ZERO = {"embed": ("data", "fsdp", "context", "expert")}  # over every axis that splits tokens
WHOLE: dict = {}  # every name replicated
# Pipeline parallelism: every strategy places the stacked layers on the `stage` axis (each
# stage stores and runs its own layers), a no-op on meshes without one, as `context` is.
PIPELINE = "stage"

# ZeRO (Rajbhandari et al. 2020) in these terms: the stored weights (the fp32 master under a
# bf16 policy) and the optimizer state are sharded over the batch axes from stage 1 on; the
# working copy the forward and backward read is gathered whole once per step (`working`);
# stage 2 also reduce-scatters the gradients; stage 3 (fsdp) leaves the working copy sharded,
# so XLA gathers each weight where it is used.
STRATEGIES = {
    # name: (params, opt_state, activations, reduce-scatter grads to opt_state sharding,
    #        working copy: a table, or None to read the weights where they are stored)
    "dp": (WHOLE, WHOLE, BATCH, False, None),
    "zero1": (ZERO, ZERO, BATCH, False, WHOLE),
    "zero2": (ZERO, ZERO, BATCH, True, WHOLE),
    "fsdp": (FSDP, FSDP, BATCH, False, None),
    "tp": (TENSOR, TENSOR, {**BATCH, **TENSOR}, False, None),
    "fsdp_tp": ({**FSDP, **TENSOR}, {**FSDP, **TENSOR}, {**BATCH, **TENSOR}, False, None),
    "tp_sp": (TENSOR, TENSOR, {**BATCH, **TENSOR, **SEQUENCE}, False, None),
    "fsdp_tp_sp": ({**FSDP, **TENSOR}, {**FSDP, **TENSOR}, {**BATCH, **TENSOR, **SEQUENCE},
                   False, None),
}


@dataclasses.dataclass(frozen=True)
class Rules:
  name: str
  params: dict
  opt_state: dict
  activations: dict
  scatter_grads: bool
  working: dict | None = None  # where the compute-dtype copy lives while the step runs

  @property
  def grads(self) -> dict:
    """The table gradients are reduced to: the optimizer's shards (scatter), else where the
    weights are read."""
    if self.scatter_grads:
      return self.opt_state
    return self.params if self.working is None else self.working

  @property
  def batch_axes(self) -> tuple[str, ...]:
    return _axes(self.activations.get("batch"))

  @property
  def token_axes(self) -> tuple[str, ...]:
    """The axes that split the tokens (batch rows and sequence): a weight's gradient is a
    partial sum over each of them."""
    length = _axes(self.activations.get("length"))
    return self.batch_axes + tuple(a for a in length if a not in self.batch_axes)


SEQUENCE_NAMES = ("length", "residual_length")


def sequence_unsplit(rules: Rules) -> Rules:
  """`rules` with the sequence whole, for sampling: a decode step holds one token, which no
  mesh axis divides, so context parallelism (and sequence parallelism's `tensor` split of the
  residual stream) leave the sequence and the KV cache whole; the devices of those axes
  compute the same rows. The weights keep their placement."""
  activations = {name: None if name in SEQUENCE_NAMES else axes
                 for name, axes in rules.activations.items()}
  return dataclasses.replace(rules, activations=activations)


def _axes(value) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def strategy(name: str, overrides: dict | None = None) -> Rules:
  """The named strategy's tables, with single rules overridden: {"params": {"mlp": None}}."""
  if name not in STRATEGIES:
    raise unknown("strategy", name, STRATEGIES)
  params, opt, acts, scatter, working = STRATEGIES[name]
  tables = {"params": dict(params), "opt_state": dict(opt), "activations": dict(acts)}
  if working is not None:
    tables["working"] = dict(working)
  for table in tables.values():  # pipeline stages and experts, no-ops on meshes without them
    table.setdefault("layers", PIPELINE)
    table.setdefault("experts", EXPERT)
  for table, rules in (overrides or {}).items():
    if table not in tables:
      raise unknown("rules table", table, tables)
    if not isinstance(rules, dict):
      raise ConfigError(f"rules.{table} must be a table of logical axis = mesh axes (e.g. "
                        f"rules.{table}.mlp=tensor), got {rules!r}")
    for logical, axes in rules.items():
      if logical not in _registered:
        raise unknown(f"logical axis in rules.{table}", logical, _registered)
      if not (axes is None or isinstance(axes, str) or
              (isinstance(axes, (list, tuple)) and all(isinstance(a, str) for a in axes))):
        raise ConfigError(f"rules.{table}.{logical} must be a mesh axis name, a list of "
                          f"them, or none; got {axes!r}")
      tables[table][logical] = None if axes in (None, "", "none") else axes
  return Rules(name, tables["params"], tables["opt_state"], tables["activations"], scatter,
               tables.get("working"))


def pipeline_stages(rules: Rules, mesh) -> int:
  """Over how many devices the rules split the stacked layers' compute (1: no pipeline)."""
  n = 1
  for axis in _axes(rules.activations.get("layers")):
    n *= mesh.shape.get(axis, 1)
  return n


def spec(names: tuple, shape: tuple, table: dict, mesh: Mesh, what: str) -> PartitionSpec:
  """PartitionSpec for a tensor whose dims carry logical `names`, under one rules table.

  Raises ConfigError naming `what` when a dim does not divide its mesh axes.
  """
  if len(names) != len(shape):
    raise ConfigError(f"{what}: {len(names)} logical names {names} for shape {shape}")
  used, out = set(), []
  for dim, (name, size) in enumerate(zip(names, shape)):
    if name is not None and name not in _registered and name not in table:
      raise unknown(f"logical axis name of {what} (dim {dim}); register new names with "
                    f"shardlab.register_axes, or give", name, _registered)
    axes = []
    for axis in _axes(table.get(name)):
      if axis not in mesh.shape:
        if axis in MESH_AXES:  # a mesh without this axis: size 1
          continue
        raise unknown(f"mesh axis in the rule for {name!r}", axis, mesh.axis_names)
      if axis in used:  # a mesh axis can shard only one dim of a tensor
        continue
      axes.append(axis)
    n = 1
    for axis in axes:
      n *= mesh.shape[axis]
    if size % n:
      detail = " × ".join(f"{a!r} (size {mesh.shape[a]})" for a in axes)
      raise ConfigError(
          f"{what} dim {dim} ({name}, size {size}) is not divisible by mesh axis {detail}; "
          f"change the mesh or the rule for {name!r}")
    used.update(axes)
    axes = [a for a in axes if mesh.shape[a] > 1] or [None]
    out.append(axes[0] if len(axes) == 1 else tuple(axes))
  while out and out[-1] is None:
    out.pop()
  return PartitionSpec(*out)
