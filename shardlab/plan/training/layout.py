"""Where every tensor of a run lives: shapes, logical axes, PartitionSpecs, per-device bytes.

Everything comes from `state.abstract_state` and `state.shardings` (no memory is allocated,
and no spec is written here); activation specs come from `rules.spec` over the strategy's
activation table, with the logical names the model declares (its config's `activations`).
The mesh may be abstract, so any preset can be inspected from a laptop.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardlab.sharding import rules as rules_lib
from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.training import schedule
from shardlab.training.state import Abstract, Shardings

WARN_FRACTION = 0.01  # a replicated parameter above this share of the model is reported


@dataclasses.dataclass(frozen=True)
class Row:
  path: str
  shape: tuple[int, ...]
  dtype: str
  names: tuple  # logical axes; None for a dim without a name
  spec: PartitionSpec
  local_shape: tuple[int, ...]
  local_bytes: int  # on each device holding a shard

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def replicated(self) -> bool:
    return self.local_shape == self.shape

  def as_dict(self) -> dict:
    return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
            "names": list(self.names), "spec": _spec_text(self.spec),
            "local_shape": list(self.local_shape), "local_bytes": self.local_bytes}


@dataclasses.dataclass(frozen=True)
class Layout:
  params: list[Row]
  opt_state: list[Row]
  step: list[Row]
  activations: list[Row]
  warnings: list[str]

  def bytes_per_device(self) -> dict:
    out = {k: sum(r.local_bytes for r in getattr(self, k))
           for k in ("params", "opt_state", "step")}
    out["state"] = sum(out.values())
    return out


def _spec_text(spec: PartitionSpec) -> str:
  parts = ["*" if e is None else e if isinstance(e, str) else "×".join(e) for e in spec]
  return "(" + ", ".join(parts) + ")" if parts else "replicated"


def _keystr(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator=".")


def _row(path: str, abstract_leaf, sharding, names) -> Row:
  shape = tuple(abstract_leaf.shape)
  local = tuple(sharding.shard_shape(shape))
  itemsize = jnp.dtype(abstract_leaf.dtype).itemsize
  return Row(path, shape, str(jnp.dtype(abstract_leaf.dtype)), tuple(names), sharding.spec,
             local, math.prod(local) * itemsize)


def _rows(abstract_tree, sharding_tree, names_by_path: dict | None = None) -> list[Row]:
  leaves = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
  shardings = jax.tree.leaves(sharding_tree)
  rows = []
  for (path, leaf), sharding in zip(leaves, shardings):
    key = _keystr(path)
    names = (names_by_path or {}).get(key, (None,) * len(leaf.shape))
    rows.append(_row(key, leaf, sharding, names))
  return rows


def axis_sizes(cfg: Config) -> dict:
  """The size of every logical axis in one microbatch of this run."""
  t = cfg.train
  return {"batch": t.global_batch // t.microbatches, "length": t.seq_len,
          "residual_length": t.seq_len, **cfg.model.axis_sizes()}


def activation_rows(cfg: Config, abstract: Abstract, sh: Shardings) -> tuple[list[Row], list]:
  """One row per activation the model constrains (the KV cache at model.max_seq_len), and
  error lines for those the rules cannot shard."""
  sizes = axis_sizes(cfg)
  rows, errors = [], []
  for what, names in cfg.model.activations.items():
    shape = tuple(cfg.model.max_seq_len if (what == "kv_cache" and n == "length") else sizes[n]
                  for n in names)
    dtype = jnp.float32 if what == "logits" else abstract.policy.compute_dtype
    try:
      spec = rules_lib.spec(names, shape, sh.rules.activations, sh.mesh, f"activation {what}")
    except ConfigError as e:
      errors.append(str(e))
      continue
    sharding = jax.sharding.NamedSharding(sh.mesh, spec)
    rows.append(_row(what, jax.ShapeDtypeStruct(shape, dtype), sharding, names))
  return rows, errors


def replication_warnings(rows: list[Row], sh: Shardings) -> list[str]:
  """Large parameters left whole on every device by a strategy that shards parameters."""
  if not any(sh.mesh.shape.get(a, 1) > 1 for v in sh.rules.params.values()
             for a in rules_lib._axes(v)):
    return []  # dp / zero1 / zero2 replicate parameters by design (but for pipeline stages)
  total = sum(r.size for r in rows)
  replicated = [r for r in rows if r.replicated]
  out = [f"param {r.path} {r.shape} ({r.size / total:.1%} of the parameters) is replicated "
         f"on every device under {sh.rules.name}: no rule in the params table shards its axes "
         f"{r.names} on this mesh" for r in replicated if r.size > WARN_FRACTION * total]
  share = sum(r.size for r in replicated) / total if total else 0.0
  if share > WARN_FRACTION and not out:
    out.append(f"{share:.1%} of the parameters ({len(replicated)} small tensors) are "
               f"replicated on every device under {sh.rules.name}")
  return out


def state_layout(abstract: Abstract, sh: Shardings) -> Layout:
  """Every param and optimizer-state leaf of any module's abstract state (no activations)."""
  flat_names = {_keystr(p): n for p, n in jax.tree_util.tree_flatten_with_path(
      abstract.names, is_leaf=lambda x: isinstance(x, tuple))[0]}
  params = _rows(abstract.state.params, sh.state.params, flat_names)
  opt_state = _rows(abstract.state.opt_state, sh.state.opt_state)
  step = [_row("step", abstract.state.step, sh.state.step, ())]
  return Layout(params, opt_state, step, [], replication_warnings(params, sh))


def layout(cfg: Config, abstract: Abstract, sh: Shardings) -> Layout:
  """A bundled model's layout, with the activations it constrains."""
  lay = state_layout(abstract, sh)
  acts, errors = activation_rows(cfg, abstract, sh)
  return dataclasses.replace(lay, activations=acts, warnings=lay.warnings + errors)


def _bytes(n: float) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _table(rows: list[Row], title: str) -> list[str]:
  shape = lambda s: "×".join(map(str, s)) or "()"
  names = lambda n: "(" + ", ".join(str(x) for x in n) + ")"
  cols = [(r.path, shape(r.shape), names(r.names), _spec_text(r.spec), shape(r.local_shape),
           _bytes(r.local_bytes)) for r in rows]
  head = (title, "shape", "logical axes", "PartitionSpec", "per device", "bytes/device")
  widths = [max(len(c[i]) for c in cols + [head]) for i in range(len(head))]
  fmt = lambda c: "  ".join(x.ljust(w) if i < 5 else x.rjust(w)
                            for i, (x, w) in enumerate(zip(c, widths)))
  return [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(c) for c in cols]


def render_state(lay: Layout, sh: Shardings, name: str = "model") -> str:
  """The parameter table and per-device totals of any module's layout."""
  mesh = " ".join(f"{a}={s}" for a, s in sh.mesh.shape.items())
  n_params = sum(r.size for r in lay.params)
  lines = [f"{name} ({n_params:,} params)   strategy {sh.rules.name}   mesh {mesh} "
           f"({math.prod(sh.mesh.shape.values())} devices)", ""]
  return "\n".join(lines + _state_lines(lay) + [f"warning: {w}" for w in lay.warnings])


def _state_lines(lay: Layout) -> list[str]:
  total = lay.bytes_per_device()
  lines = _table(lay.params, "parameter")
  lines += ["", "per device: " + "   ".join(
      f"{k} {_bytes(v)}" for k, v in (("params", total["params"]),
                                      ("optimizer state", total["opt_state"]),
                                      ("step", total["step"]), ("state", total["state"])))]
  return lines


def render(cfg: Config, lay: Layout, sh: Shardings, activations: bool = False) -> str:
  mesh = " ".join(f"{a}={s}" for a, s in sh.mesh.shape.items())
  lines = [f"model {cfg.model.name} ({sum(r.size for r in lay.params):,} params)   strategy "
           f"{cfg.strategy}   mesh {mesh} ({math.prod(sh.mesh.shape.values())} devices)   "
           f"optimizer {cfg.train.optimizer}", ""]
  lines += _state_lines(lay)
  lines += schedule.lines(cfg.model.n_layers, sh.rules, sh.mesh,
                          cfg.train.microbatches, cfg.train.pipeline_repeats)
  if activations:
    micro = cfg.train.global_batch // cfg.train.microbatches
    lines += ["", f"activations (one microbatch of {micro} × {cfg.train.seq_len} tokens; the "
                  f"KV cache at {cfg.model.max_seq_len})"]
    lines += _table(lay.activations, "activation")
  lines += [f"warning: {w}" for w in lay.warnings]
  return "\n".join(lines)
