"""Gradient accumulation into the accumulator itself, inside the layer scan's backward pass.

With train.microbatches > 1 the step sums the microbatches' gradients in an fp32
accumulator (sharded as the gradients are). Differentiating a microbatch and adding its
gradient afterwards holds the accumulator beside the microbatch's whole gradient: a second
full-size gradient buffer, 4 bytes a parameter (tests/test_accumulation_bytes.py). Here the
layer stack's backward pass adds each layer's weight gradient into that layer's slice of the
accumulator as soon as it is made, so beside the accumulator only one layer's gradient is
ever held.

How: the step differentiates each microbatch with respect to the accumulator as well as the
weights (`differentiate`). A layer scan that finds its stack's trainable weights registered
(`active`) runs as a custom_vjp (`run`) whose backward pass returns, as the accumulator's
cotangent, the accumulator plus this microbatch's layer gradients (each rounded to the
gradient dtype first, as the step would round it), and no cotangent for the weights; the
step then takes the accumulator's "gradient" as the new accumulator for those leaves and adds
the others' gradients as before. The backward recomputes each layer's forward from its saved
input: remat "full"'s work, so only a full-remat scan takes this path. A scan is recognised
by its stack's weights being the very arrays the step differentiates: a model that reshapes
them on the way (Gemma's groups of layers) accumulates as before, after each microbatch.

The same scan reads the stored (fp32) weights rather than the step's bf16 working copy, and
casts each layer as it runs it, forward and in the backward's recompute: no working copy of
the stack is held through the step, 2 bytes a parameter (with the fp32 accumulator 4, master
weights 4 and Adam's moments 8: ZeRO's 16). The cast of the whole stack the step makes is
then left unused, and XLA drops it.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("shardlab_accumulate", default=None)
_WORKING_COPY: contextvars.ContextVar = contextvars.ContextVar("shardlab_accumulate_working",
                                                               default=False)


class _Registry:
  """The accumulator and stored weights of each working weight (keyed by its tracer) of one
  microbatch's differentiation; each is handed out once, so a stack run twice adds its
  second run's gradient the usual way (through the weights' own cotangent)."""

  def __init__(self, working: list, stored: list, accumulators: list, grad_dtype):
    self.by_id = {id(w): (s, a) for w, s, a in zip(working, stored, accumulators)}
    self.grad_dtype = grad_dtype
    self.taken: set[int] = set()

  def take(self, leaves: list) -> tuple[list, list] | None:
    """(the stored weights of each of `leaves` — the leaf itself where it is not trained —,
    the accumulator of each, None where not trained); None when no leaf is trained or one
    was handed out already."""
    ids = [id(leaf) for leaf in leaves]
    if not any(i in self.by_id for i in ids) or self.taken.intersection(ids):
      return None
    self.taken.update(i for i in ids if i in self.by_id)
    found = [self.by_id.get(i, (leaf, None)) for i, leaf in zip(ids, leaves)]
    stored = list(leaves) if _WORKING_COPY.get() else [s for s, _ in found]
    return stored, [a for _, a in found]


def active() -> _Registry | None:
  return _ACTIVE.get()


@contextlib.contextmanager
def reading_the_working_copy():
  """Within it, a step traced has its accumulating layer scans read the step's bf16
  working copy of the whole stack rather than cast each layer from the stored weights:
  the per-layer cast switched off, for A/B measurements (bench/accumulation.py) and the
  tests that prove what it saves."""
  token = _WORKING_COPY.set(True)
  try:
    yield
  finally:
    _WORKING_COPY.reset(token)


@contextlib.contextmanager
def _registered(working: list, stored: list, accumulators: list, grad_dtype):
  registry = _Registry(working, stored, accumulators, grad_dtype)
  token = _ACTIVE.set(registry)
  try:
    yield registry
  finally:
    _ACTIVE.reset(token)


def differentiate(loss_fn, stored, cast, acc, grad_dtype):
  """((value, aux), gradients w.r.t. `stored`, [accumulator or None per leaf]) of
  `loss_fn(cast(stored))` -> (value, aux), differentiated with the accumulator registered.
  Where a layer scan took a leaf's accumulator the entry is its cotangent, the accumulator
  plus this microbatch's gradient from that scan, and the leaf's gradient holds only what
  reached it elsewhere (zero, unless the stack ran twice); elsewhere the entry is None. Such
  a scan casts its stored weights to the working dtype one layer at a time, so the cast of
  the whole stack is left unused and never held."""
  taken: list[bool] = []

  def loss(s, a):
    w = cast(s)
    wl = jax.tree.leaves(w)
    with _registered(wl, jax.tree.leaves(s), jax.tree.leaves(a), grad_dtype) as registry:
      out = loss_fn(w)
    taken[:] = [id(leaf) in registry.taken for leaf in wl]
    return out

  (value, aux), (grads, acc_grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      stored, acc)
  return (value, aux), grads, [g if t else None for g, t in zip(jax.tree.leaves(acc_grads),
                                                                 taken)]


def run(layer, stacked, stored: list, carry, args, accumulators: list, grad_dtype,
        unroll: int = 1):
  """`layer(layer_state, carry, args) -> carry` over the stack (lax.scan), with the backward
  pass adding each trained leaf's layer gradient into `accumulators` (per leaf of `stacked`,
  None for a leaf not trained). The layers read `stored` (per leaf of `stacked`), cast one
  layer at a time to the dtype of `stacked`'s leaf."""
  s_def = jax.tree.structure(stacked)
  dtypes = [leaf.dtype for leaf in jax.tree.leaves(stacked)]
  s_leaves = list(stored)
  trained = [a is not None for a in accumulators]
  acc = [a for a in accumulators if a is not None]
  arrays, full_args = _arrays_of(args)

  def layer_of_arrays(i, leaves, c, arrays):
    state = jax.tree.unflatten(s_def, _cast_in_loop(leaves, dtypes, i))
    return layer(state, c, full_args(arrays))

  def forward(stack_leaves, carry, args):
    def body(c, xs):
      return layer_of_arrays(*xs, c, args), c

    n = stack_leaves[0].shape[0]
    return jax.lax.scan(body, carry, (jnp.arange(n), stack_leaves), unroll=unroll)

  @jax.custom_vjp
  def stack(stack_leaves, acc, carry, args):
    return forward(stack_leaves, carry, args)[0]

  def stack_fwd(stack_leaves, acc, carry, args):
    out, inputs = forward(stack_leaves, carry, args)
    return out, (stack_leaves, acc, inputs, args)

  def stack_bwd(res, ct):
    stack_leaves, acc, inputs, args = res
    layer_vjp = lambda i, leaves, x, ct: jax.vjp(
        lambda *a: layer_of_arrays(i, *a), leaves, x, args)[1](ct)
    acc, ct, ct_args = _backward(layer_vjp, stack_leaves, inputs, args, acc, ct, trained,
                                 grad_dtype)
    return None, acc, ct, ct_args

  stack.defvjp(stack_fwd, stack_bwd)
  return stack(s_leaves, acc, carry, arrays)


def _cast_in_loop(leaves: list, dtypes: list, index) -> list:
  """`leaves` (layer `index`'s stored weights) cast to `dtypes`, inside the layer loop. XLA
  moves a cast of a loop-invariant array's slice onto the whole array and out of the loop
  (the TPU compiler does, and out of the microbatch loop too): a working copy of the stack
  held through the step, the very bytes this path exists to save. Adding a zero made from
  the layer index makes the cast's input vary per iteration, so it stays per layer (XLA
  does not fold float·0: NaN and infinity), and is known when the iteration starts, so the
  next layer's weights are still fetched while this one computes."""
  zero = jax.lax.stop_gradient(index.astype(jnp.float32) * 0)
  return [x if x.dtype == d else (x + zero.astype(x.dtype)).astype(d)
          for x, d in zip(leaves, dtypes)]


def _backward(layer_vjp, stack_leaves, inputs, args, acc, ct, trained, grad_dtype):
  """(accumulators, the stack input's cotangent, the args' cotangents): the layers in reverse,
  each one's weight gradient added into its slice of the accumulators."""
  a_leaves, a_def = jax.tree.flatten(args)
  inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in a_leaves]

  def body(c, xs):
    ct, acc, ct_args = c
    i, layer_leaves, layer_input = xs
    d_state, ct, d_args = layer_vjp(i, layer_leaves, layer_input, ct)
    grads = [g for g, t in zip(jax.tree.leaves(d_state), trained) if t]
    acc = [jax.lax.dynamic_update_index_in_dim(
        a, a[i] + g.astype(grad_dtype).astype(a.dtype), i, 0) for a, g in zip(acc, grads)]
    d_args = [d for d, f in zip(jax.tree.leaves(d_args), inexact) if f]
    return (ct, acc, [a + d for a, d in zip(ct_args, d_args)]), None

  zeros = [jnp.zeros_like(x) for x, f in zip(a_leaves, inexact) if f]
  n = stack_leaves[0].shape[0]
  (ct, acc, ct_args), _ = jax.lax.scan(body, (ct, acc, zeros),
                                       (jnp.arange(n), stack_leaves, inputs), reverse=True)
  # Integer args (token positions, segment ids) have no cotangent: float0 zeros.
  ct_args = iter(ct_args)
  ct_args = [next(ct_args) if f else np.zeros(x.shape, jax.dtypes.float0)
             for x, f in zip(a_leaves, inexact)]
  return acc, ct, jax.tree.unflatten(a_def, ct_args)


def _arrays_of(args):
  """(the arrays among `args`' leaves, arrays -> args): arrays pass through the custom_vjp;
  Python values (a static length, a flag) stay as they are."""
  leaves, treedef = jax.tree.flatten(args)
  is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in leaves]

  def rebuild(arrays):
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if t else a for a, t in zip(leaves, is_array)])

  return [a for a, t in zip(leaves, is_array) if t], rebuild

