"""The weights' collectives, per parameter leaf (comm.py's conventions): the gathers of the
stored weights for compute (ZeRO-1/2's working copy once per step, FSDP's per use), the
gradients' reductions, and the gather after the update where the optimizer's shards are finer
than the stored weights."""

import dataclasses
import math

import jax.numpy as jnp

from shardlab.plan.training.comm import Backend, Transfer, _axes, _shards
from shardlab.sharding import rules as rules_lib
from shardlab.training.state import flat_by_path

EMBEDDING = ("vocab", "embed")  # a tied table: looked up and used as the output head


@dataclasses.dataclass(frozen=True)
class ParamAxes:
  """One param's shape and the mesh axes each rules table shards it over."""
  key: tuple[str, ...]
  names: tuple
  shape: tuple[int, ...]
  itemsize: int
  params: frozenset  # where it is stored
  compute: frozenset  # where the layers read it (rules.activations)
  grads: frozenset
  opt_state: frozenset
  working: frozenset  # the compute-dtype copy (the stored weights' axes without one)
  frozen: bool


def param_axes(abstract, rules: rules_lib.Rules, mesh) -> list[ParamAxes]:
  """Every param's axes under each table: all param_transfers needs of the state and the
  rules (a search computes it once per placement: plan/training/placed.py)."""
  names = flat_by_path(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  frozen = {key for key, f in flat_by_path(abstract.frozen or {}).items() if f}
  out = []
  for key, leaf in flat_by_path(abstract.state.params).items():
    n, shape, label = names[key], leaf.shape, ".".join(key)
    spec = lambda table: frozenset(_axes(rules_lib.spec(n, shape, table, mesh,
                                                        f"param {label}")))
    p_axes = spec(rules.params)
    out.append(ParamAxes(key, tuple(n), tuple(shape), jnp.dtype(leaf.dtype).itemsize, p_axes,
                         spec(rules.activations), spec(rules.grads), spec(rules.opt_state),
                         p_axes if rules.working is None else spec(rules.working),
                         key in frozen))
  return out


def param_transfers(leaves: list[ParamAxes], rules: rules_lib.Rules, mesh, policy,
                    microbatches: int, tied: bool, backend: Backend,
                    layer_uses: float | None = None) -> list[Transfer]:
  """Weight gathers (ZeRO-1/2's working copy once per step, FSDP's per use), gradient
  reductions, and a gather after the update where the optimizer's shards are finer than the
  stored weights, per leaf (`param_axes`). Uses per step: `microbatches`; `layer_uses` for
  stacked layers (a pipeline stage's once per iteration:
  shardlab.plan.training.pipeline.passes)."""
  batch = {a for a in rules.token_axes if mesh.shape.get(a, 1) > 1}
  compute_bytes = jnp.dtype(policy.compute_dtype).itemsize
  reduce_scatter = backend.reduce_scatter
  out = []
  for leaf in leaves:
    n, label = leaf.names, ".".join(leaf.key)
    elems, pbytes = math.prod(leaf.shape), leaf.itemsize
    wire = compute_bytes if backend.compute_dtype_collectives else pbytes
    p_axes, c_axes, g_axes, w_axes = leaf.params, leaf.compute, leaf.grads, leaf.working
    c_elems = elems // _shards(c_axes, mesh)
    whole = tuple(sorted(a for a in p_axes - w_axes if mesh.shape[a] > 1))
    if whole:  # ZeRO-1/2: the working copy, gathered once per step
      out.append(Transfer("all-gather", elems // _shards(w_axes, mesh) * wire, whole,
                          f"{label} working copy"))
    gather = tuple(sorted(a for a in w_axes - c_axes if mesh.shape[a] > 1))
    table = n == EMBEDDING
    # The embedding is looked up where it is stored (its rows travel, not the table) unless
    # the activations split its vocabulary (then XLA gathers the rest for a masked lookup);
    # tied, it is gathered once more as the head. Layers: forward and backward. Other
    # weights: once, kept for the backward.
    local = table and not c_axes
    stacked = bool(n) and n[0] == "layers"
    times = layer_uses if stacked and layer_uses is not None else microbatches
    uses = 2 if stacked else (0 if local else 1) + (1 if table and tied else 0)
    if gather and uses:
      out.append(Transfer("all-gather", uses * times * c_elems * wire, gather,
                          f"{label} for compute"))
    trains = not leaf.frozen  # a frozen param has no gradient and no update
    grads = _gradients(table, local, tied, batch, (w_axes, c_axes, g_axes),
                       (elems // _shards(w_axes, mesh), c_elems)) if trains else []
    for reduce, g_elems in grads:
      if reduce:
        out.extend(_reduction(reduce, g_axes, g_elems * wire * times, mesh,
                              reduce_scatter, f"{label} grad"))
    regather = tuple(sorted(a for a in leaf.opt_state - p_axes if mesh.shape[a] > 1))
    if regather and trains:
      out.append(Transfer("all-gather", elems // _shards(p_axes, mesh) * pbytes, regather,
                          f"{label} after the update"))
  return out


def _gradients(table: bool, local: bool, tied: bool, batch: set, axes: tuple,
               elems: tuple) -> list[tuple[set, int]]:
  """(axes its partial sums are reduced over, elements) of each gradient of a trained weight;
  `axes` its (working, compute, gradient) axes, `elems` its working and compute elements.
  A local lookup's gradient is scattered into the stored shard, reduced only over the batch
  axes that shard does not split; any other gradient over those its compute layout does
  not. A tied table gets two (the lookup's and the head's); XLA sums them before reducing
  when they reduce alike onto a finer sharding than they are computed in (ZeRO-2,
  fsdp_tp), else reduces each on its own (dp, tp)."""
  (w_axes, c_axes, g_axes), (w_elems, c_elems) = axes, elems
  grads = []
  if table:
    grads.append((batch - w_axes, w_elems) if local else (batch - c_axes, c_elems))
  if not table or tied:
    grads.append((batch - c_axes, c_elems))
  if len(grads) == 2 and grads[0][0] == grads[1][0] and (g_axes - c_axes) & batch:
    grads = grads[1:]
  return grads


def _reduction(reduce: set, g_axes: set, g_bytes: float, mesh, reduce_scatter: bool,
               what: str) -> list[Transfer]:
  """A gradient's partial sums over `reduce`: reduce-scattered onto the axes its sharding
  keeps (where the backend can), all-reduced over the rest."""
  scatter = tuple(sorted(a for a in reduce if a in g_axes))
  rest = tuple(sorted(reduce - set(scatter)))
  if not (scatter and reduce_scatter):
    return [Transfer("all-reduce", g_bytes, tuple(sorted(reduce)), what)]
  out = [Transfer("reduce-scatter", g_bytes, scatter, what)]
  if rest:
    out.append(Transfer("all-reduce", g_bytes / _shards(scatter, mesh), rest, what))
  return out
