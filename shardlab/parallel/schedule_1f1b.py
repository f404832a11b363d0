"""1F1B pipeline schedule: each stage alternates one forward and one backward, so it holds
the inputs of at most S microbatches in flight, where GPipe (parallel/pipeline.py) holds its
layers' saved tensors for all M.

1F1B needs microbatch m's loss gradient while later microbatches are still going forward,
so this schedule owns the loss: it runs forwards, the loss and backwards itself, in one
lax.scan inside jax.shard_map over the stage axis, and returns the loss with its gradients.
`loss` wraps that in jax.custom_vjp (the forward pass runs the whole schedule and keeps the
gradients; the backward pass scales them by the incoming cotangent), so an outer
jax.value_and_grad over the whole train loss composes with it.

Schedule, S stages, M microbatches, T = 2(M + S − 1) ticks; every stage does one op a tick:
  forward of m on stage s at tick  s + 2m
  backward of m on stage s at tick 2m + 2S − 1 − s
Forwards fall on ticks of stage s's parity, backwards on the other, so no stage ever has two
ops in one tick; each value sent (an activation forward, a cotangent back, by ppermute) is
used by its neighbour on the very next tick, so nothing queues. The last stage's forward
tick only stores its input: its backward tick (the next one) computes stage, loss and their
gradients together. Microbatch m lives on stage s from its forward to its backward,
2(S − s) − 1 ticks, one new every 2 ticks: at most S − s at once, so a ring of S slots
(slot m mod S) holds every stage's stored inputs. The bubble is GPipe's, (S − 1)/(M + S − 1):
the classic 1F1B runs its S − s − 1 warm-up forwards back to back, this one spaces them
two ticks apart, with the same length and the same peak memory when a forward and a
backward take one tick each, and one uniform rule for every tick.

The backward recomputes the stage's forward from its stored input (jax.vjp): stage-level
remat, so one stage input per microbatch in flight is all that is stored, whatever the
layers save inside. The price: each stage runs its forward twice per microbatch (as
train.remat=full does).

Shape suffixes: M microbatches, b rows per microbatch, B = b·M, L length, D d_model,
S stages, T ticks.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import Mesh, PartitionSpec

from shardlab.errors import ConfigError
from shardlab.parallel.pipeline import per_row

IDLE, FORWARD, BACKWARD, LOSS_BACKWARD, STORE = range(5)


def ticks(n_stages: int, microbatches: int) -> int:
  """T = 2(M + S − 1): the last microbatch's backward leaves stage 0 at tick T − 1."""
  return 2 * (microbatches + n_stages - 1)


def table(n_stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
  """(op T×S, microbatch T×S): what each stage does at each tick. The loop reads this, so
  tests of the schedule read the schedule that runs."""
  t = np.arange(ticks(n_stages, microbatches))[:, None]
  s = np.arange(n_stages)[None, :]
  fwd, bwd = t - s, t - (2 * n_stages - 1 - s)  # twice the microbatch, on the op's ticks
  is_fwd = (fwd % 2 == 0) & (fwd >= 0) & (fwd < 2 * microbatches)
  is_bwd = (bwd % 2 == 0) & (bwd >= 0) & (bwd < 2 * microbatches)
  last = s == n_stages - 1
  op = np.where(is_fwd, np.where(last, STORE, FORWARD),
                np.where(is_bwd, np.where(last, LOSS_BACKWARD, BACKWARD), IDLE))
  micro = np.where(is_fwd, fwd // 2, np.where(is_bwd, bwd // 2, 0))
  return op.astype(np.int32), micro.astype(np.int32)


def in_flight(n_stages: int, microbatches: int) -> list[int]:
  """The most microbatch inputs each stage holds at once (stored, backward not yet run)."""
  op, micro = table(n_stages, microbatches)
  held = np.zeros(n_stages, int)
  most = np.zeros(n_stages, int)
  for t in range(op.shape[0]):
    held += np.isin(op[t], (FORWARD, STORE))
    most = np.maximum(most, held)
    held -= np.isin(op[t], (BACKWARD, LOSS_BACKWARD))
  return most.tolist()


def check(n_stages: int, microbatches: int, batch: int):
  if microbatches < 1:
    raise ConfigError(f"train.microbatches must be >= 1 for a 1F1B pipeline, got {microbatches}")
  if batch % microbatches:
    raise ConfigError(f"the batch ({batch} rows) must be divisible by train.microbatches "
                      f"({microbatches}), the 1F1B pipeline's microbatches")


def _split(leaf, m: int):
  """B×… → b×M×…, a free reshape: microbatch j is [:, j], rows j, j+M, … (pipeline.run's
  split, so each device keeps its own rows). Not swapped to M×b×…: that transpose would be
  a copy of the whole batch, growing with M."""
  return leaf.reshape(leaf.shape[0] // m, m, *leaf.shape[1:])


def _merge(leaf):
  return leaf.reshape(-1, *leaf.shape[2:])


def value_and_grads(stage_fn: Callable, stage_params, x_BxLxD, loss_fn: Callable, loss_params,
                    targets, *, mesh: Mesh, axis: str, microbatches: int,
                    input_grad: bool = True, stage_args: tuple = ()):
  """(mean over microbatches of loss_fn, (grads of stage_params, of loss_params, of x or
  None)) by the 1F1B schedule over the mesh axis `axis`.

  stage_fn(params, h_bxLxD, *stage_args) -> h_bxLxD runs one stage; stage_params' leaves
  lead with the S stages (stage-sharded on `axis`). stage_args: the stage's other inputs
  (positions, rope tables, segment ids, a mask), given no gradient; a leaf leading with the
  batch B (not boolean) is split into microbatches as x is, any other is shared.
  loss_fn(loss_params, y_bxLxD, targets_b) -> scalar mean loss of one microbatch. targets'
  leaves lead with the batch B, as x does."""
  n_stages = mesh.shape[axis]
  check(n_stages, microbatches, x_BxLxD.shape[0])
  for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
    if leaf.shape[:1] != (n_stages,):
      raise ConfigError(f"stage_params{jax.tree_util.keystr(path)} has shape {leaf.shape}; "
                        f"its leading dim must be the {n_stages} stages of mesh axis {axis!r}")
  x_bxMxLxD = _split(x_BxLxD, microbatches)
  targets = jax.tree.map(lambda leaf: _split(leaf, microbatches), targets)
  stage_args = jax.tree.map(jnp.asarray, stage_args)  # a Python cache index of 0
  rows = [per_row(leaf, x_BxLxD.shape[0]) for leaf in jax.tree.leaves(stage_args)]
  args = jax.tree.unflatten(jax.tree.structure(stage_args), [
      _split(leaf, microbatches) if r else leaf
      for leaf, r in zip(jax.tree.leaves(stage_args), rows)])
  local = functools.partial(_local, stage_fn=stage_fn, loss_fn=loss_fn, axis=axis,
                            n_stages=n_stages, input_grad=input_grad, rows=rows)
  stage_spec = jax.tree.map(lambda _: PartitionSpec(axis), stage_params)
  out_specs = (PartitionSpec(), (stage_spec, PartitionSpec(),
                                 PartitionSpec() if input_grad else None))
  loss, (g_stage, g_loss, g_x) = jax.shard_map(
      local, mesh=mesh, in_specs=(stage_spec, PartitionSpec(), PartitionSpec(),
                                  PartitionSpec(), PartitionSpec()),
      out_specs=out_specs, axis_names={axis})(stage_params, loss_params, x_bxMxLxD, targets,
                                              args)
  return loss, (g_stage, g_loss, None if g_x is None else _merge(g_x))


def _varying(tree, axis):
  """Each (stage-invariant) leaf marked as varying over `axis`."""
  return jax.tree.map(lambda a: jax.lax.pcast(a, (axis,), to="varying"), tree)


def _zeros(tree, axis):
  """Varying zeros shaped like `tree` (fresh constants are invariant: cast them)."""
  return _varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree), axis)


def _get(buffer, i, axis: int = 0):
  return jax.lax.dynamic_index_in_dim(buffer, i, axis, keepdims=False)


def _put(buffer, i, value, axis: int = 0):
  return jax.lax.dynamic_update_index_in_dim(buffer, value, i, axis)


def _local(stage_params, loss_params, x_bxMxLxD, targets, args, *, stage_fn, loss_fn, axis,
           n_stages, input_grad, rows):
  """One stage's side of the schedule (inside shard_map over `axis`)."""
  n_micro = x_bxMxLxD.shape[1]
  stage = jax.lax.axis_index(axis)
  params = jax.tree.map(lambda p: p[0], stage_params)
  # Varying over stages: the loss head's and the input's gradients are then summed over
  # `axis` once, after the loop.
  loss_params, x_bxMxLxD, targets = _varying((loss_params, x_bxMxLxD, targets), axis)
  branches = _branches(stage_fn, loss_fn, params, loss_params, n_micro, axis)
  op_TxS, micro_TxS = table(n_stages, n_micro)
  ops_T = jax.lax.dynamic_index_in_dim(jnp.asarray(op_TxS), stage, 1, keepdims=False)
  micro_T = jax.lax.dynamic_index_in_dim(jnp.asarray(micro_TxS), stage, 1, keepdims=False)
  fwd_pairs = [(i, i + 1) for i in range(n_stages - 1)]
  bwd_pairs = [(i + 1, i) for i in range(n_stages - 1)]

  def tick(carry, op_m):
    op, m = op_m
    recv_x, recv_g, ring, g_params, g_loss, g_x, loss = carry
    slot = m % n_stages  # at most S microbatches live per stage: slots never collide
    stores = (op == FORWARD) | (op == STORE)
    fresh = jnp.where(stage == 0, _get(x_bxMxLxD, m, 1), recv_x)
    ring = _put(ring, slot, jnp.where(stores, fresh, _get(ring, slot)))
    h = jnp.where(stores, fresh, _get(ring, slot))
    step_targets = jax.tree.map(lambda t: _get(t, m, 1), targets)
    step_args = jax.tree.unflatten(jax.tree.structure(args), [
        _get(leaf, m, 1) if r else leaf for leaf, r in zip(jax.tree.leaves(args), rows)])
    # A switch, not masks: each device runs only its own op (stages differ at every tick).
    y, gh, gp, gl, step_loss = jax.lax.switch(op, branches, h, recv_g, step_targets,
                                              step_args)
    g_params = jax.tree.map(jnp.add, g_params, gp)
    g_loss = jax.tree.map(jnp.add, g_loss, gl)
    if input_grad:  # stage 0's input cotangent is the gradient of x
      first = (stage == 0) & (op == BACKWARD) | (n_stages == 1) & (op == LOSS_BACKWARD)
      g_x = _put(g_x, m, jnp.where(first, gh, _get(g_x, m, 1)), 1)
    sent = (jax.lax.ppermute(y, axis, fwd_pairs), jax.lax.ppermute(gh, axis, bwd_pairs))
    return (*sent, ring, g_params, g_loss, g_x, loss + step_loss), None

  h0 = _zeros(x_bxMxLxD[:, 0], axis)
  ring = _zeros(jax.ShapeDtypeStruct((n_stages, *h0.shape), h0.dtype), axis)
  g_x = _zeros(x_bxMxLxD, axis) if input_grad else None
  carry = (h0, h0, ring, _zeros(params, axis), _zeros(loss_params, axis), g_x,
           _zeros(jax.ShapeDtypeStruct((), jnp.float32), axis))
  carry = jax.lax.scan(tick, carry, (ops_T, micro_T))[0]
  _, _, _, g_params, g_loss, g_x, loss = carry
  g_stage = jax.tree.map(lambda g: g[None], g_params)
  g_x = None if g_x is None else jax.lax.psum(g_x, axis)
  return jax.lax.psum(loss, axis), (g_stage, jax.lax.psum(g_loss, axis), g_x)


def _branches(stage_fn, loss_fn, params, loss_params, n_micro, axis):
  """The ops a tick can run, indexed by the op codes: each (h, cotangent, targets, stage
  args) -> (activation to send on, cotangent to send back, param grads, loss-head grads,
  loss)."""
  def nothing(h, g, t, a):
    return (_zeros(h, axis), _zeros(h, axis), _zeros(params, axis),
            _zeros(loss_params, axis), _zeros(jax.ShapeDtypeStruct((), jnp.float32), axis))

  def forward(h, g, t, a):
    return (stage_fn(params, h, *a), *nothing(h, g, t, a)[1:])

  def backward(h, g, t, a):
    # Recompute the stage from its stored input.
    _, vjp = jax.vjp(lambda p, h: stage_fn(p, h, *a), params, h)
    gp, gh = vjp(g)
    return _zeros(h, axis), gh, gp, _zeros(loss_params, axis), nothing(h, g, t, a)[4]

  def loss_backward(h, g, t, a):
    def mean_loss(p, h, lp):  # each microbatch's share of the mean over microbatches
      return loss_fn(lp, stage_fn(p, h, *a), t).astype(jnp.float32) / n_micro
    loss, (gp, gh, gl) = jax.value_and_grad(mean_loss, argnums=(0, 1, 2))(
        params, h, loss_params)
    return _zeros(h, axis), gh, gp, gl, loss

  return [nothing, forward, backward, loss_backward, nothing]  # STORE computes nothing


def loss(stage_fn: Callable, stage_params, x_BxLxD, loss_fn: Callable, loss_params, targets,
         *, mesh: Mesh, axis: str, microbatches: int, stage_args: tuple = ()):
  """The 1F1B pipeline's mean loss, differentiable (w.r.t. stage_params, x and loss_params;
  targets and stage_args get none) by an outer jax.grad: jax.custom_vjp whose forward runs
  the whole schedule. Without a gradient it still runs the backwards (use a forward-only
  pipeline for eval)."""
  run = functools.partial(value_and_grads, stage_fn, loss_fn=loss_fn, mesh=mesh, axis=axis,
                          microbatches=microbatches)

  @jax.custom_vjp
  def pipelined(stage_params, x, loss_params, targets, args):
    return run(stage_params, x, loss_params=loss_params, targets=targets,
               input_grad=False, stage_args=args)[0]

  def fwd(stage_params, x, loss_params, targets, args):  # leaves are CustomVJPPrimal
    values = functools.partial(jax.tree.map, lambda leaf: leaf.value,
                               is_leaf=lambda leaf: isinstance(leaf, CustomVJPPrimal))
    # The input's gradient (M microbatches of b×L×D) only when someone asks for it.
    return run(values(stage_params), x.value, loss_params=values(loss_params),
               targets=values(targets), input_grad=x.perturbed, stage_args=values(args))

  def bwd(grads, g):
    g_stage, g_loss, g_x = grads
    if isinstance(g, SymbolicZero):
      return None, None, None, None, None
    scale = functools.partial(jax.tree.map, lambda a: (a * g).astype(a.dtype))
    return scale(g_stage), None if g_x is None else scale(g_x), scale(g_loss), None, None

  pipelined.defvjp(fwd, bwd, symbolic_zeros=True)
  return pipelined(stage_params, x_BxLxD, loss_params, targets, tuple(stage_args))
