"""LoRA for any NNX module: `add_lora(model, rank, alpha, targets)` puts a low-rank adapter on
every nnx.Param whose path matches a target, with no change to the module's code.

Each matched Param is replaced by a `LoraWeight` holding the frozen `base` and the trainable
`lora_a`, `lora_b`; reading it (`w[...]`, `w.value`, `jnp.asarray(w)`, `x @ w`) gives
base + (alpha/rank)·A·B. A spans the weight's first `in_dims` dims (after its stack dims)
and the rank, B the rank and the rest; A starts normal(0, fan_in^-1/2) and B at zero, so the
adapted model computes exactly what the base does until B moves. Leading `layers` dims (a
stacked weight, scanned or pipelined) stay leading on A and B, so a scan slices them with
the weight. A and B keep the weight's logical names plus `lora_rank` (replicated by every
strategy): they shard like the weight they adapt.

The cost of leaving the module's code alone: forming the weight (W + scale·A·B) per step,
so the backward computes the targeted weight's full gradient, reduces it over the batch
axes, and projects it onto A and B (a full fine-tune's compute and gradient traffic for
those weights; the state is still LoRA-sized). A projection written as
`lora_einsum(spec, x, self.w)` computes x·W + scale·(x·A)·B instead and skips that gradient,
as the bundled decoders' `lora.rank` does (parallel/lora.py); on a plain Param it is a
plain einsum, so a module can use it whether or not it is adapted.
"""

import math
import numbers
import re
import string
from collections.abc import MutableMapping, MutableSequence, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from shardlab.errors import ConfigError
import shardlab.parallel.dot as dot
from shardlab.parallel.lora import RANK_AXIS, adapter_rngs
from shardlab.sharding.params import param

STACK_AXIS = "layers"  # leading dims with this logical name are a stack of layers
ADAPTERS = ("lora_a", "lora_b")  # the attribute names of the trainable leaves


def _delta(a, b, in_dims: int):
  """A·B contracted over the rank, accumulated in fp32; works on the whole stack and on one
  layer's slice alike (the stack count is what A has beyond in_dims + rank)."""
  stack = a.ndim - in_dims - 1
  out_dims = b.ndim - stack - 1
  letters = iter(string.ascii_lowercase.replace("r", ""))
  s, i, o = ("".join(next(letters) for _ in range(n)) for n in (stack, in_dims, out_dims))
  return jnp.einsum(f"{s}{i}r,{s}r{o}->{s}{i}{o}", a, b, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST)


class LoraWeight(nnx.Module):
  """A weight with a low-rank update, read like the nnx.Param it replaced."""

  def __init__(self, base: nnx.Param, rank: int, scale: float, in_dims: int,
               rngs: nnx.Rngs):
    names = base.get_metadata().get("out_sharding") or (None,) * base.ndim
    stack = _stack_dims(names)
    shape, dtype = base.shape, base.get_value().dtype
    cut = stack + in_dims
    fan_in = math.prod(shape[stack:cut])
    a = jax.random.normal(rngs.params(), (*shape[:cut], rank), dtype) * fan_in**-0.5
    self.base = base
    self.lora_a = param(a, (*names[:cut], RANK_AXIS))
    self.lora_b = param(jnp.zeros((*shape[:stack], rank, *shape[cut:]), dtype),
                        (*names[:stack], RANK_AXIS, *names[cut:]))
    self.scale = float(scale)
    self.in_dims = in_dims

  def merged(self):
    """base + scale·A·B in fp32, cast to the base's dtype. In a step every operand is in
    the compute dtype already; merged for export, A and B keep their fp32 masters."""
    w = self.base.get_value()
    delta = _delta(self.lora_a.get_value(), self.lora_b.get_value(), self.in_dims)
    return (w.astype(jnp.float32) + self.scale * delta).astype(w.dtype)

  # What module code reads from a Param: all of it sees the adapted weight.
  __array_ufunc__ = None  # `numpy_array @ w` defers to __rmatmul__ (as with a Param)

  def __getitem__(self, index):
    return self.merged()[index]

  def get_value(self):
    return self.merged()

  @property
  def value(self):
    return self.merged()

  def __jax_array__(self):
    return self.merged()

  def __matmul__(self, other):
    return self.merged() @ other

  def __rmatmul__(self, other):
    return other @ self.merged()

  @property
  def shape(self):
    return self.base.shape

  @property
  def dtype(self):
    return self.base.get_value().dtype

  @property
  def ndim(self):
    return len(self.base.shape)


def _stack_dims(names) -> int:
  n = 0
  while n < len(names) and names[n] == STACK_AXIS:
    n += 1
  return n


def _params(model: nnx.Module) -> dict[str, tuple]:
  """{'/'-joined path: (parent node, key, Param)} for the Params outside any adapter."""
  found, inside = {}, set()
  for path, node in nnx.iter_graph(model):
    if isinstance(node, LoraWeight):
      inside.add(path)
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param) and not any(path[:len(p)] == p for p in inside):
      found["/".join(map(str, path))] = path
  return {text: (_node_at(model, path[:-1]), path[-1], _node_at(model, path))
          for text, path in found.items()}


def _node_at(model, path):
  node = model
  for key in path:
    node = node[key] if isinstance(node, (MutableSequence, MutableMapping)) else getattr(node, key)
  return node


def _replace(parent, key, new) -> None:
  if isinstance(parent, (MutableSequence, MutableMapping)):
    parent[key] = new
  else:
    setattr(parent, key, new)


def _matched(params: dict, targets: Sequence[str]) -> list[str]:
  """The paths some target fully matches; a target that matches none is refused."""
  for target in targets:
    if not any(re.fullmatch(target, path) for path in params):
      shown = ", ".join(list(params)[:12]) + (", ..." if len(params) > 12 else "")
      raise ConfigError(f"lora target {target!r} matches no param path (a target must match "
                        f"the whole '/'-joined path; use '.*' for a prefix); params: "
                        f"{shown or 'none outside adapters'}")
  return [path for path in params if any(re.fullmatch(t, path) for t in targets)]


def _check_shape(path: str, weight: nnx.Param, in_dims: int) -> None:
  names = weight.get_metadata().get("out_sharding") or (None,) * weight.ndim
  stack = _stack_dims(names)
  if weight.ndim < stack + in_dims + 1:
    raise ConfigError(f"lora target param {path} of shape {tuple(weight.shape)} (names "
                      f"{tuple(names)}) has {weight.ndim} dims; an adapter needs {stack} "
                      f"stack + in_dims {in_dims} + at least 1 output dim")
  if not jnp.issubdtype(weight.get_value().dtype, jnp.floating):
    raise ConfigError(f"lora target param {path} has dtype {weight.get_value().dtype}; "
                      f"only floating weights take adapters")


def add_lora(model: nnx.Module, rank: int, alpha: float, targets: str | Sequence[str], *,
             rngs: nnx.Rngs | int = 0, in_dims: int = 1) -> nnx.Module:
  """A copy of `model` whose Params at paths matching `targets` (regexes, each matched
  against the whole '/'-joined path, e.g. 'blocks/0/w1', 'layers/w.*') read as
  W + (alpha/rank)·A·B. `rngs` (or a seed) is the model's: the adapters draw from a stream
  folded from it, leaving it unadvanced. Train with `frozen=lora_frozen`."""
  for field, value in (("rank", rank), ("in_dims", in_dims)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ConfigError(f"lora {field} must be an integer >= 1, got {value!r}")
  rank, in_dims = int(rank), int(in_dims)
  targets = (targets,) if isinstance(targets, str) else tuple(targets)
  if not targets:
    raise ConfigError("lora targets is empty; give at least one param path pattern")
  model = nnx.clone(model)
  params = _params(model)
  matched = _matched(params, targets)
  for path in matched:
    _check_shape(path, params[path][2], in_dims)
  rngs = adapter_rngs(nnx.Rngs(rngs) if isinstance(rngs, int) else rngs)
  for path in matched:  # graph order: the same adapters for the same model and seed
    parent, key, weight = params[path]
    _replace(parent, key, LoraWeight(weight, rank, alpha / rank, in_dims, rngs))
  return model


def lora_einsum(spec: str, x, weight):
  """`einsum(spec, x, weight[...])` for a Param, an array or a LoraWeight; for a LoraWeight
  it is x·W + scale·(x·A)·B, never forming W + scale·A·B, so the backward computes (and
  reduces) no weight-sized gradient. For the hot projections of a large model: `spec`'s
  weight letters are the weight's dims (stack dims too where it is read unscanned)."""
  if not isinstance(weight, LoraWeight):
    return dot.einsum(spec, x, weight[...])
  inputs, out = spec.replace(" ", "").split("->")
  x_letters, w_letters = inputs.split(",")
  a, b = weight.lora_a.get_value(), weight.lora_b.get_value()
  cut = a.ndim - 1  # the weight's stack + input dims, as A has them here (a scan slices)
  stack = cut - weight.in_dims
  if len(w_letters) != weight.base.ndim:
    raise ConfigError(f"lora_einsum {spec!r}: the weight has {weight.base.ndim} dims "
                      f"(shape {tuple(weight.shape)}), the spec names {len(w_letters)}")
  r = next(c for c in string.ascii_letters if c not in spec)
  a_letters, b_letters = w_letters[:cut] + r, w_letters[:stack] + r + w_letters[cut:]
  # The down projection keeps what B or the output still needs (the rank, x's batch dims).
  low = "".join(c for c in dict.fromkeys(x_letters + a_letters) if c in b_letters + out)
  y = dot.einsum(spec, x, weight.base.get_value())
  update = dot.einsum(f"{low},{b_letters}->{out}",
                      dot.einsum(f"{x_letters},{a_letters}->{low}", x, a), b)
  return (y.astype(jnp.float32) + weight.scale * update.astype(jnp.float32)).astype(y.dtype)


def lora_frozen(path: tuple[str, ...]) -> bool:
  """`frozen` for sl.abstract_state: every param but the adapters' A and B is held fixed."""
  return not path or path[-1] not in ADAPTERS


def merge_lora(model: nnx.Module) -> nnx.Module:
  """A copy of `model` with each LoraWeight replaced by a Param holding W + scale·A·B
  (fp32 math, cast to W's dtype; W's metadata): the base module's param tree exactly."""
  model = nnx.clone(model)
  adapted = [path for path, node in nnx.iter_graph(model) if isinstance(node, LoraWeight)]
  if not adapted:
    raise ConfigError("merge_lora: the model has no LoRA adapters (add them with add_lora)")
  for path in adapted:
    weight = _node_at(model, path)
    _replace(_node_at(model, path[:-1]), path[-1], weight.base.replace(weight.merged()))
  return model
