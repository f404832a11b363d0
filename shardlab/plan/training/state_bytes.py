"""Model state per device by ZeRO's accounting, divided exactly as shardlab's rules shard it.

Model state (Rajbhandari et al. 2020, "ZeRO"): with Ψ parameters, mixed-precision Adam keeps
2Ψ bytes of 16-bit params, 2Ψ of grads and 12Ψ of fp32 master weights + two moments. DP
replicates all of it; ZeRO-1 shards the 12Ψ over the N data-parallel devices; ZeRO-2 also the
grads; ZeRO-3 (FSDP) everything. The planner does not use that formula: it asks
`state.shardings` (the same function the train step uses) for every leaf's spec on an
abstract mesh and sums the shard sizes, so it says what the code does (docs/planning.md has
the table per strategy and policy).

How shardlab's precision policies map onto ZeRO's categories:
  fp32         params = the fp32 weights forward reads; master = the stored weights only
               where they are sharded finer than that (zero1/zero2).
  bf16         params = the bf16 working copy (alive through forward and backward);
               master = the stored fp32 weights. Accumulating microbatches under full
               remat, the layer stack reads its stored weights cast one layer at a time
               (shardlab/parallel/accumulate.py): no working copy of the stack is held.
  bf16-params  params = the bf16 weights; optimizer state in bf16.
Gradients are in train.grad_dtype (the stored weights' dtype by default) and the strategy's
gradient sharding.
LoRA's frozen base is stored in the compute dtype (it is its own working copy) and has no
gradients and no optimizer state. Under train.offload=opt_state the stored weights and the
optimizer state are host bytes.
"""

import math

import jax
import jax.numpy as jnp

from shardlab.plan.training.memory import itemsize, tree_shard_bytes


def _is_working_copy(leaf, sh, policy) -> bool:
  """Whether a stored param is itself the copy forward reads (no separate master)."""
  return jnp.dtype(leaf.dtype) == jnp.dtype(policy.compute_dtype) and sh.rules.working is None


def model_state(abstract, sh, policy, microbatches: int, grad_dtype,
                offload: str = "none", in_scan: bool = False) -> dict[str, float]:
  """Exact per-device bytes of params / grads / master / opt_state (and host) from the
  shardings.

  params: the working copy forward and backward read (compute dtype, where the strategy
  keeps it: whole for dp/zero1/zero2). master: the stored weights that are not that copy
  (another dtype, or sharded while the copy is whole; a frozen param is stored in the
  compute dtype). grads: of the trained params, in `grad_dtype`, where the strategy reduces
  them, plus an fp32 accumulator with microbatches; `in_scan`: the layer stack's gradients
  go straight into it and its layers are cast from the stored weights one at a time
  (shardlab/parallel/accumulate.py), so the stacked trained params hold the accumulator
  alone and, unless ZeRO-1/2 gather it whole, no working copy. Under offload "opt_state"
  the stored weights and the optimizer state are host bytes instead (XLA streams each leaf
  in for its update; the stream's buffers are small beside the activations' peak)."""
  params_abs = abstract.state.params
  working = tree_shard_bytes(params_abs, sh.working, policy.compute_dtype)
  opt = tree_shard_bytes(abstract.state.opt_state, sh.state.opt_state)
  trained, grad_sh = abstract.trainable(params_abs), abstract.trainable(sh.grads)
  grads = tree_shard_bytes(trained, grad_sh, grad_dtype)
  if microbatches > 1:
    if in_scan:  # no per-microbatch gradient of the stacked params beside the accumulator
      grads -= _stack_bytes(abstract, sh.grads, lambda a: grad_dtype, per_device=True)
      working -= _stack_working_copy_bytes(abstract, sh, policy, per_device=True)
    grads += tree_shard_bytes(trained, grad_sh, jnp.float32)
  master = sum(0.0 if _is_working_copy(a, sh, policy) else tree_shard_bytes(a, s)
               for a, s in zip(jax.tree.leaves(params_abs), jax.tree.leaves(sh.state.params)))
  stored = tree_shard_bytes(params_abs, sh.state.params)
  if offload == "opt_state":
    return dict(params=working, master=0.0, grads=grads, opt_state=0.0, host=stored + opt,
                stored=0.0)
  return dict(params=working, master=master, grads=grads, opt_state=opt, host=0.0,
              stored=stored)


def _stack_bytes(abstract, shardings, dtype_of, per_device: bool) -> float:
  """Bytes of the layer stack's trained params (leading `layers`) in `dtype_of(param)`
  (None: not counted), sharded as `shardings` per device or whole: one microbatch's
  gradient, or the working copy, which accumulating inside the layer scan does not hold."""
  params = jax.tree.leaves(abstract.state.params)
  names = jax.tree.leaves(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  frozen = (jax.tree.leaves(abstract.frozen) if abstract.frozen is not None
            else [False] * len(params))
  return sum(itemsize(dtype_of(a)) * math.prod(s.shard_shape(a.shape) if per_device else a.shape)
             for a, n, s, f in zip(params, names, jax.tree.leaves(shardings), frozen)
             if not f and n[:1] == ("layers",) and dtype_of(a) is not None)


def _stack_working_copy_bytes(abstract, sh, policy, per_device: bool) -> float:
  """The working copy of the stack's trained params that the accumulating scan does not
  hold: none under ZeRO-1/2 (gathered whole once a step) or where the stored param is the
  copy forward reads."""
  if sh.rules.working is not None:
    return 0.0
  return _stack_bytes(abstract, sh.working, lambda a: None if _is_working_copy(a, sh, policy)
                      else policy.compute_dtype, per_device)


def state_accounting(abstract, sh, state: dict, policy, microbatches: int,
                     grad_dtype, in_scan: bool = False) -> dict[str, dict]:
  """Per category: bytes per parameter unsharded, and into how many pieces the strategy
  divides them on this mesh (1: whole on every device) — ZeRO's table, for this run."""
  leaves = jax.tree.leaves(abstract.state.params)
  size = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))
  n = size(leaves)
  grads = size(abstract.trainable(abstract.state.params)) * (
      itemsize(grad_dtype) + (4 if microbatches > 1 else 0))
  params = n * itemsize(policy.compute_dtype)
  if microbatches > 1 and in_scan:
    grads -= _stack_bytes(abstract, sh.grads, lambda a: grad_dtype, per_device=False)
    params -= _stack_working_copy_bytes(abstract, sh, policy, per_device=False)
  whole = {"params": params, "grads": grads,
           "master": sum(math.prod(a.shape) * itemsize(a.dtype) for a in leaves
                         if not _is_working_copy(a, sh, policy)),
           "opt_state": sum(math.prod(a.shape) * itemsize(a.dtype)
                            for a in jax.tree.leaves(abstract.state.opt_state))}
  return {k: {"bytes_per_param": whole[k] / n, "divided_by": round(whole[k] / state[k], 2)}
          for k in whole if state[k] and whole[k]}
