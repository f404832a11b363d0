"""Pipeline parallelism: the stacked layers split over the `stage` mesh axis, microbatches
flowing through the stages (GPipe; circular when `repeats` > 1).

The parameters keep their stored shape (N layers first, logical name `layers`); the rules
place `layers` on `stage`, and the layer scan (parallel/scan.py) runs this schedule
instead when that axis has more than one device. Nothing about the pipeline is stored, so a
checkpoint restores onto any stage count.

Schedule, with S stages, R repeats and M microbatches, for N = S·R·K layers. Layer group
g = r·S + s (K consecutive layers) runs on stage s in repeat r: a reshape view (R, S, K) of
the layer dim, stage-sharded on S. Microbatch m enters stage 0 at iteration r·M + m of repeat
r and reaches stage s at r·M + m + s; each iteration every stage applies its group to what it
holds, then passes the result one stage on (ppermute, S−1 wrapping to 0). Stage 0 keeps what
comes back round in a buffer until that microbatch's next repeat (M ≥ S makes it wait ≥ 0
iterations). T = R·M + S − 1 iterations, of which each stage idles S − 1 (it computes on
zeros there, and the result is dropped): the bubble, (S − 1) / (R·M + S − 1). R = 1 is GPipe: autodiff of this forward scan runs all forwards,
then all backwards (ppermute's transpose sends the other way), each stage keeping the inputs
of its K layers for all M microbatches (less under remat).

With R = 1 the group layout equals the stored one (stage s holds layers s·K …), so weights
never move. With R > 1 (circular) the stored contiguous blocks are not the round-robin groups
a stage runs: the step moves the layer weights into the (R, S, K) view and the gradients back,
about (S − 1)/S of the layer bytes through the stage axis per step, the price of keeping the
checkpoint independent of the layout.

Embedding, final norm and head sit outside the pipeline, replicated over `stage` (sharded as
the strategy says over the other axes): they are small beside the layers, and every stage
then holds the input to feed stage 0 and the output the loss reads (one all-reduce over
`stage` brings the last stage's output to all; the input's gradient is summed likewise).

Shape suffixes: M microbatches, b rows per microbatch, B = M·b, L length, D d_model, R
repeats, S stages, K layers per group.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardlab import remat as remat_lib
from shardlab.errors import ConfigError, unknown
from shardlab.sharding import activations

# train.pipeline_schedule: "gpipe" runs in the layer scan (circular with repeats > 1); "1f1b"
# owns the loss (parallel/schedule_1f1b.py, through parallel/stack_1f1b.py).
SCHEDULES = ("gpipe", "1f1b")


def stages(n_layers: int):
  """(mesh, axis, S) when the active rules split `layers` over a mesh axis of S > 1
  devices, else None."""
  where = activations.current(("layers",), (n_layers,))
  if where is None or not len(where[1]) or where[1][0] is None:
    return None
  mesh, spec = where
  axis = spec[0]
  if not isinstance(axis, str):
    raise ConfigError(f"the rules split the logical axis `layers` over the mesh axes {axis}; "
                      f"a pipeline runs over exactly one mesh axis: set rules.params.layers "
                      f"and rules.activations.layers to 'stage' (or 'none' for no pipeline)")
  return mesh, axis, mesh.shape[axis]


def check(n_layers: int, n_stages: int, repeats: int, microbatches: int,
          batch: int | None = None, batch_name: str = "the batch"):
  """Clear errors for a schedule the model (and batch, when given) cannot follow. A run
  checks them when it is set up (shardlab/training/combinations.py); `run` again while tracing."""
  if n_layers % (n_stages * repeats):
    raise ConfigError(
        f"model.n_layers ({n_layers}) must be divisible by the pipeline stages × "
        f"train.pipeline_repeats ({n_stages} × {repeats} = {n_stages * repeats}); change the "
        f"`stage` mesh axis or train.pipeline_repeats")
  if batch is not None:
    check_microbatches(batch, microbatches, batch_name)
  if repeats > 1 and microbatches < n_stages:
    raise ConfigError(
        f"a circular pipeline (train.pipeline_repeats={repeats}) needs train.microbatches "
        f">= the stages ({n_stages}), got {microbatches}; raise train.microbatches to "
        f"{n_stages} or more, or set train.pipeline_repeats=1 (GPipe)")


def check_schedule(schedule: str, repeats: int) -> None:
  """train.pipeline_schedule is one of SCHEDULES, and 1F1B runs one layer group per stage."""
  if schedule not in SCHEDULES:
    raise unknown("train.pipeline_schedule", schedule, SCHEDULES)
  if schedule == "1f1b" and repeats > 1:
    raise ConfigError(f"train.pipeline_schedule=1f1b runs one layer group per stage; "
                      f"train.pipeline_repeats={repeats} (a circular schedule) is GPipe's "
                      f"only: set train.pipeline_repeats=1, or train.pipeline_schedule=gpipe")


def check_microbatches(batch: int, microbatches: int, name: str = "the batch") -> None:
  """The one rule for splitting a batch into microbatches, a pipeline's or a gradient
  accumulation's; `name` is what the user calls the batch size."""
  if microbatches < 1 or batch % microbatches:
    raise ConfigError(f"{name} ({batch}) must be divisible by train.microbatches "
                      f"({microbatches})")


def check_combination(n_stages: int, *, remat: str = "none", offload: str = "none",
                      layer_stats: str | None = None, context: int = 1) -> None:
  """Clear errors for what does not run inside a pipeline of `n_stages` stages. A run checks
  them when it is set up (shardlab/training/combinations.py), before anything is traced; the layer
  scan checks what it sees again while tracing, for modules stepped without that setup.
  `layer_stats`: who returns per-layer statistics (named in the message), None if nothing
  does; `context`: the context-parallel degree."""
  where = f"a pipeline (stage {n_stages}: `layers` split over the `stage` mesh axis)"
  off = ("turn the pipeline off (a mesh without a `stage` axis above 1, or "
         "rules.params.layers=none and rules.activations.layers=none)")
  policy = remat_lib.policy(remat)
  if policy is not None and policy.on_host:  # XLA:CPU aborts compiling the loop's transfers
    kept = [k for k, p in remat_lib.POLICIES.items()
            if k != "full" and (p is None or not p.on_host)]
    raise ConfigError(f"train.remat={remat} does not run in {where}: XLA aborts compiling "
                      f"host transfers inside its loop; use train.remat=full there (or "
                      f"another policy that keeps its residuals on the device: "
                      f"{', '.join(kept)}), or {off}")
  if offload == "opt_state":  # XLA:CPU aborts compiling it (an invalid copy instruction)
    raise ConfigError(f"train.offload=opt_state does not run with {where}: XLA aborts "
                      f"compiling its host transfers there; use train.offload=none, or {off}")
  if layer_stats is not None:
    # The schedule carries activations only; and MoE's expert dispatch is a shard_map of
    # its own, which does not nest in the pipeline's either.
    raise ConfigError(f"{layer_stats} return statistics (such as MoE router losses) that "
                      f"{where} does not carry; {off}")
  if context > 1:
    # Attention's shard_map over `context` does not lower nested in the pipeline's over
    # `stage` (its mesh differs; with the stage-manual mesh Shardy rejects the operand
    # shardings).
    raise ConfigError(f"{where} does not run with context parallelism (context {context}: "
                      f"`length` split over the `context` mesh axis); use one or the other: "
                      f"set the mesh's `stage` or `context` axis to 1")


def bubble(n_stages: int, microbatches: int, repeats: int = 1) -> float:
  """The fraction of a step each stage idles: (S − 1) / (R·M + S − 1)."""
  return (n_stages - 1) / iterations(n_stages, microbatches, repeats)


def iterations(n_stages: int, microbatches: int, repeats: int = 1) -> int:
  """T = R·M + S − 1: the schedule's loop length (the last microbatch's last repeat enters
  stage 0 at R·M − 1 and needs S − 1 more iterations to reach the last stage)."""
  return repeats * microbatches + n_stages - 1


def _slot(t, stage, microbatches: int, repeats: int):
  """What `stage` runs at iteration t: (real work?, repeat r, microbatch m). The loop and
  `occupancy` share this, so the structural check reads the schedule that runs; works on
  Python ints, NumPy and traced arrays alike."""
  total = repeats * microbatches
  u = t - stage  # microbatch-repeat u entered stage 0 at iteration u
  valid = (u >= 0) & (u < total)
  u = jnp.clip(u, 0, total - 1)  # bubble slots compute on a clamped index; dropped later
  return valid, u // microbatches, u % microbatches


def occupancy(n_stages: int, microbatches: int, repeats: int = 1):
  """T × S booleans: whether stage s does real work at iteration t (False: a bubble slot,
  computing on zeros). Its mean is 1 − bubble."""
  t = jnp.arange(iterations(n_stages, microbatches, repeats))[:, None]
  return _slot(t, jnp.arange(n_stages)[None, :], microbatches, repeats)


def per_row(leaf, batch: int) -> bool:
  """Per-row layer inputs (positions, rope tables, segment ids) lead with the batch; the
  boolean causal mask (L×M) is shared by every row."""
  return hasattr(leaf, "ndim") and leaf.ndim >= 1 and leaf.shape[0] == batch and (
      leaf.dtype != jnp.bool_)


def _split(leaf, m: int):
  """B×… → M×b×…; microbatch j takes rows j, j+M, …, so each device keeps its own rows."""
  return leaf.reshape(leaf.shape[0] // m, m, *leaf.shape[1:]).swapaxes(0, 1)


def _merge(leaf):
  return leaf.swapaxes(0, 1).reshape(-1, *leaf.shape[2:])


def run(layer, stacked, x_BxLxD, args: tuple, where, microbatches: int, repeats: int):
  """The pipelined equivalent of scanning `layer(x, layer_params, args) -> x` over the
  stacked params, layer 0 first. `where` is what `stages` returned."""
  mesh, axis, n_stages = where
  n_layers = jax.tree.leaves(stacked)[0].shape[0]
  batch = x_BxLxD.shape[0]
  check(n_layers, n_stages, repeats, microbatches, batch)
  per_group = n_layers // (n_stages * repeats)
  groups = jax.tree.map(lambda p: p.reshape(repeats, n_stages, per_group, *p.shape[1:]),
                        stacked)
  args = jax.tree.map(jnp.asarray, args)  # a Python cache index of 0 becomes an array
  rows = [per_row(leaf, batch) for leaf in jax.tree.leaves(args)]
  treedef = jax.tree.structure(args)
  leaves = [_split(leaf, microbatches) if r else leaf
            for leaf, r in zip(jax.tree.leaves(args), rows)]
  x_MxbxLxD = _split(x_BxLxD, microbatches)

  def local(groups, x, leaves):
    out = _schedule(layer, groups, x, leaves, rows, treedef, axis, n_stages, repeats)
    # The last stage's output, on every stage (for the head): one all-reduce forward; its
    # gradient needs none (each stage's share of the cotangent is the whole of it).
    last = jax.lax.axis_index(axis) == n_stages - 1
    return jax.lax.psum(jnp.where(last, out, jnp.zeros_like(out)), axis)

  in_specs = (jax.tree.map(lambda _: PartitionSpec(None, axis), groups), PartitionSpec(),
              [PartitionSpec()] * len(leaves))
  out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(),
                      axis_names={axis})(groups, x_MxbxLxD, leaves)
  return _merge(out)


def _schedule(layer, groups, x_MxbxLxD, leaves, rows, treedef, axis, n_stages, repeats):
  """One stage's side of the schedule (inside shard_map over `axis`): M×b×L×D outputs,
  meaningful on the last stage."""
  n_micro = x_MxbxLxD.shape[0]
  stage = jax.lax.axis_index(axis)
  # Varying over stages from here on: the input's gradient is then summed over `stage` once,
  # not once per iteration of the loop.
  x_MxbxLxD = jax.lax.pcast(x_MxbxLxD, (axis,), to="varying")
  groups = jax.tree.map(lambda p: p[:, 0], groups)  # R×K×… : this stage's groups
  total = repeats * n_micro
  ring = [(i, (i + 1) % n_stages) for i in range(n_stages)]

  def apply_group(x, r, m):
    params = jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, r, keepdims=False),
                          groups)
    args = jax.tree.unflatten(treedef, [
        jax.lax.dynamic_index_in_dim(leaf, m, keepdims=False) if r_ else leaf
        for leaf, r_ in zip(leaves, rows)])
    return jax.lax.scan(lambda h, p: (layer(h, p, args), None), x, params)[0]

  def iteration(carry, t):
    held, loop, out = carry
    # What stage S−1 finished last iteration (now in `held` on stage 0) waits in `loop`.
    back = t - n_stages
    slot = jnp.clip(back, 0, total - 1) % n_micro
    keep = (back >= 0) & (back < total)
    loop = _put(loop, slot, jnp.where(keep, held, _get(loop, slot)))
    valid, r, m = _slot(t, stage, n_micro, repeats)
    fresh = jnp.where(r == 0, _get(x_MxbxLxD, m), _get(loop, m))
    y = apply_group(jnp.where(stage == 0, fresh, held), r, m)
    last = valid & (stage == n_stages - 1) & (r == repeats - 1)
    out = _put(out, m, jnp.where(last, y, _get(out, m)))
    return (jax.lax.ppermute(y, axis, ring), loop, out), None

  zeros = jnp.zeros_like(x_MxbxLxD)
  carry = (zeros[0], zeros, zeros)
  steps = jnp.arange(iterations(n_stages, n_micro, repeats))
  return jax.lax.scan(iteration, carry, steps)[0][2]


def _get(buffer, i):
  return jax.lax.dynamic_index_in_dim(buffer, i, keepdims=False)


def _put(buffer, i, value):
  return jax.lax.dynamic_update_index_in_dim(buffer, value, i, 0)


def layers_per_stage(n_layers: int, n_stages: int, repeats: int = 1) -> list[list[int]]:
  """Which stored layers each stage runs, in the order it runs them."""
  k = n_layers // (n_stages * repeats)
  return [[(r * n_stages + s) * k + j for r in range(repeats) for j in range(k)]
          for s in range(n_stages)]


def describe(n_layers: int, n_stages: int, repeats: int, microbatches: int,
             schedule: str = "gpipe") -> str:
  kind = "gpipe" if repeats == 1 else f"circular×{repeats}"
  loop = f"{iterations(n_stages, microbatches, repeats)} iterations"
  if schedule == "1f1b":  # 2(M + S − 1) ticks of one forward or backward each
    kind, loop = "1f1b", f"{2 * iterations(n_stages, microbatches)} ticks"
  return (f"{kind}: {n_stages} stages × {n_layers // n_stages} layers, {microbatches} "
          f"microbatches, {loop}, bubble {bubble(n_stages, microbatches, repeats):.1%}")

