"""Low-rank adapters (LoRA, Hu et al. 2021) for a decoder's projection einsums.

A projection `dot.einsum(spec, x, W)` with an adapter computes
einsum(x, W) + scale·einsum(einsum(x, A), B): A spans W's input dims (those x contracts)
and the rank, B the rank and W's output dims; A starts normal(0, fan_in^-1/2), B at zero,
so at step 0 the adapted model computes exactly what the base does. A and B keep W's
logical names and add `lora_rank` (replicated by every strategy), so they shard like W.

The core freezes every param outside a `lora_` attribute (shardlab.training.run.lora_frozen):
a model stores each adapter as `lora_<target>` beside the weight it adapts, and names the
weight for each target (its `lora_weights`), which is all `merge_params` needs for export.
Shape suffixes: R rank, N layers; A is "in dims × R", B "R × out dims".
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import shardlab.parallel.dot as dot
from shardlab.remat import PROJECTION_NAMES
from shardlab.sharding.params import stacked_param

RANK_AXIS = "lora_rank"
PREFIX = "lora_"  # the attribute prefix the core's frozen mask looks for
# Adapters draw from their own key (folded from the base seed), so adding them leaves the
# base params' random init exactly as it is without LoRA.
_STREAM = 0x10A


def adapter_rngs(rngs: nnx.Rngs) -> nnx.Rngs:
  """A separate stream for the adapters, read from `rngs` without advancing it."""
  return nnx.Rngs(params=jax.random.fold_in(rngs.params.key[...], _STREAM))


def _split(spec: str) -> tuple[str, str, str, str]:
  """(x letters, output letters, W's input letters, W's output letters) of `spec`; W's
  input dims must come first, as a projection's do."""
  inputs, out = spec.replace(" ", "").split("->")
  x, w = inputs.split(",")
  w_in = "".join(c for c in w if c in x)
  w_out = "".join(c for c in w if c not in x)
  if w != w_in + w_out:
    raise ValueError(f"LoRA on einsum {spec!r}: the weight's contracted dims must come first")
  return x, out, w_in, w_out


class Adapter(nnx.Module):
  """The rank-`rank` update of a weight of `shape` (logical `names`) used as
  `dot.einsum(spec, x, W)`; stacked over `stack` like the weight."""

  def __init__(self, spec: str, shape, names, rank: int, scale: float, dtype,
               rngs: nnx.Rngs, stack=()):
    x, out, w_in, w_out = _split(spec)
    r = next(c for c in "rstuvwxyz" if c not in spec)
    n_in = len(w_in)
    kept = "".join(c for c in out if c not in w_out)  # the output's dims that x brings
    self.a = stacked_param(rngs, (*shape[:n_in], rank), (*names[:n_in], RANK_AXIS),
                           math.prod(shape[:n_in]), dtype, stack)
    self.b = stacked_param(None, (rank, *shape[n_in:]), (RANK_AXIS, *names[n_in:]), "zeros",
                           dtype, stack)
    self.down_spec = f"{x},{w_in}{r}->{kept}{r}"
    self.up_spec = f"{kept}{r},{r}{w_out}->{out}"
    self.scale = scale

  def __call__(self, x):
    low = dot.einsum(self.down_spec, x, self.a[...])
    return (dot.einsum(self.up_spec, low, self.b[...]) * self.scale).astype(x.dtype)


def maybe(lora, target: str, spec: str, shape, names, dtype, rngs, stack=()):
  """An Adapter if `lora` (a LoraConfig, or None) targets `target`, else None."""
  if lora is None or not lora.rank or target not in lora.target_names:
    return None
  return Adapter(spec, shape, names, lora.rank, lora.scale, dtype, rngs, stack)


def project(spec: str, x, weight, adapter: Adapter | None):
  """`dot.einsum(spec, x, weight)`, plus the adapter's update if there is one."""
  y = dot.einsum(spec, x, weight)
  return y if adapter is None else y + adapter(x)


def for_weight(specs: dict[str, str], lora, target: str, weight, dtype, rngs, stack=()):
  """`maybe` for `target` of a model whose projections are `specs` (target -> einsum), sized
  and named as the param `weight` it adapts (an nnx.Param with `stack` leading dims)."""
  names = weight.get_metadata()["out_sharding"][len(stack):]
  return maybe(lora, target, specs[target], weight.shape[len(stack):], names, dtype, rngs,
               stack)


def project_target(specs: dict[str, str], module, target: str, x, weight):
  """`project` by `target`'s einsum in `specs`, with the adapter `module` holds for it (its
  `lora_<target>`), if any. The output is named for remat policies by the target's role
  (shardlab/remat.py: "q" is MaxText's query_proj, "gate" its mlpwi_0)."""
  y = project(specs[target], x, weight, getattr(module, PREFIX + target, None))
  name = PROJECTION_NAMES.get(target)
  return y if name is None else checkpoint_name(y, name)


def merged(w, a, b, scale: float):
  """W + scale·A·B in fp32, for a weight with leading stack dims that A and B share."""
  stack = a.ndim + b.ndim - 2 - w.ndim
  lead = w.shape[:stack]
  n_in = a.ndim - 1 - stack
  fan_in, fan_out = math.prod(w.shape[stack:stack + n_in]), math.prod(w.shape[stack + n_in:])
  a2 = a.astype(jnp.float32).reshape(*lead, fan_in, a.shape[-1])
  b2 = b.astype(jnp.float32).reshape(*lead, b.shape[stack], fan_out)
  delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
  return w.astype(jnp.float32) + scale * delta


def merge_params(params: dict, weights: dict[str, str], scale: float) -> dict:
  """The params tree with each `lora_<target>` adapter merged into the weight `weights`
  names for that target, and the adapters dropped: the base model's tree."""
  out = {}
  for key, value in params.items():
    if key.startswith(PREFIX):
      continue
    out[key] = merge_params(value, weights, scale) if isinstance(value, dict) else value
  for key, value in params.items():
    if key.startswith(PREFIX):
      target = key[len(PREFIX):]
      if weights.get(target) not in params:
        raise ValueError(f"adapter {key} has no weight to merge into (known: {weights})")
      out[weights[target]] = merged(params[weights[target]], value["a"], value["b"], scale)
  return out


def has_adapters(params: dict) -> bool:
  return any(k.startswith(PREFIX) or (isinstance(v, dict) and has_adapters(v))
             for k, v in params.items())
