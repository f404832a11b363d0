"""Abstract train state and THE function that computes every sharding from logical names.

Works for any Flax NNX module whose `nnx.Param`s carry logical axis names (in their
`out_sharding` metadata: `nnx.Param(v, out_sharding=names)` or `nnx.with_partitioning`).
`abstract_state` costs no memory (jax.eval_shape); `shardings` turns it plus a rules table
plus a mesh into NamedShardings. Sharded init, the train step, checkpoint restore, the
planner and the inspector all call these, so there is no second table of PartitionSpecs.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlab.errors import ConfigError, unknown
from shardlab.sharding import rules as rules_lib
from shardlab.training import precision

ModelFactory = Callable[[], nnx.Module]


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any  # nested dict of arrays (plain, so optax never sees Variable metadata)
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class Abstract:
  """Shapes, dtypes and logical names of everything a run holds, with no memory behind it."""
  graphdef: Any
  state: TrainState  # of jax.ShapeDtypeStruct
  names: Any  # params-shaped tree of logical-name tuples
  optimizer: optax.GradientTransformation
  policy: precision.Policy
  model_factory: ModelFactory = dataclasses.field(compare=False)
  # params-shaped bools: True where a param is held fixed (no gradient, no optimizer state,
  # stored in the compute dtype); None when every param trains.
  frozen: Any = None

  def trainable(self, tree):
    """A params-shaped tree with the frozen leaves removed (None): what the optimizer sees."""
    return _select(tree, self.frozen, keep=False)

  def fixed(self, tree):
    """A params-shaped tree with only the frozen leaves (the rest None)."""
    return _select(tree, self.frozen, keep=True)


def _select(tree, frozen, keep: bool):
  if frozen is None:
    return tree if not keep else jax.tree.map(lambda _: None, tree)
  return jax.tree.map(lambda leaf, f: leaf if f == keep else None, tree, frozen)


def merge(trainable, fixed):
  """The params tree from its trainable and frozen parts (each None where the other is)."""
  return jax.tree.map(lambda t, f: f if t is None else t, trainable, fixed,
                      is_leaf=lambda x: x is None)


@dataclasses.dataclass(frozen=True)
class Shardings:
  state: TrainState  # of NamedSharding
  grads: Any  # params-shaped: where gradients are reduced to before the update
  working: Any  # params-shaped: where the compute-dtype copy lives during the step
  batch: NamedSharding  # leading (batch) dim over the batch axes; a prefix for any batch tree
  mesh: Mesh
  rules: rules_lib.Rules
  # Where the step computes on the state: `state` itself, unless the stored weights and the
  # optimizer state live in host memory (train.offload=opt_state), when it is their device
  # placement.
  on_device: TrainState

  @property
  def offloaded(self) -> bool:
    return self.on_device is not self.state


OFFLOAD = ("none", "opt_state")
HOST = "pinned_host"  # page-locked host memory: DMA to and from the device without a copy


def _split_params(model: nnx.Module):
  """(graphdef, Param state); any other state (RNG streams, batch statistics) is refused,
  since the train step would silently freeze it."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
        rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})
    raise ConfigError(
        f"the model holds state other than nnx.Param ({', '.join(kinds)}); shardlab trains "
        f"Params only: create nnx.Rngs outside the module (pass `rngs` to __init__ and do "
        f"not store it) and keep no mutable statistics")
  return graphdef, params


def _logical_names(variable: nnx.Variable) -> tuple:
  names = variable.get_metadata().get("out_sharding")
  return tuple(names) if names is not None else (None,) * np.ndim(variable.get_value())


def _storage_dtype(dtype, policy: precision.Policy, frozen: bool = False):
  if not jnp.issubdtype(dtype, jnp.floating):
    return dtype
  # A frozen param is never updated, so it needs no higher-precision master copy.
  return policy.compute_dtype if frozen else policy.param_dtype


def _store(params, policy: precision.Policy, frozen=None):
  """Floating params in the policy's storage dtype (master weights; frozen ones in the
  compute dtype)."""
  frozen = jax.tree.map(lambda _: False, params) if frozen is None else frozen
  return jax.tree.map(lambda p, f: p.astype(_storage_dtype(p.dtype, policy, f)), params, frozen)


FrozenFn = Callable[[tuple[str, ...]], bool]


def abstract_state(model_factory: ModelFactory, optimizer: optax.GradientTransformation,
                   policy: precision.Policy | str = "fp32",
                   frozen: FrozenFn | None = None) -> Abstract:
  """Everything the run will hold, as shapes: `model_factory()` builds the module.
  `frozen(path)` (the param's dict keys) marks params held fixed, as a LoRA base is: they
  get no gradient and no optimizer state, and are stored in the compute dtype."""
  policy = precision.resolve(policy) if isinstance(policy, str) else policy
  with nnx.use_eager_sharding(False):  # logical names are not mesh axes
    graphdef, variables = _split_params(nnx.eval_shape(model_factory))
  is_var = lambda x: isinstance(x, nnx.Variable)
  names = nnx.to_pure_dict(jax.tree.map(_logical_names, variables, is_leaf=is_var))
  shapes = nnx.to_pure_dict(variables)
  mask = jax.tree_util.tree_map_with_path(
      lambda p, _: frozen is not None and bool(frozen(path_of(p))), shapes)
  if all(jax.tree.leaves(mask)):
    raise ConfigError("every parameter is frozen: nothing would train")
  params = jax.tree.map(
      lambda a, f: jax.ShapeDtypeStruct(a.shape, _storage_dtype(a.dtype, policy, f)),
      shapes, mask)
  abstract = Abstract(graphdef, TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, None),
                      names, optimizer, policy, model_factory,
                      mask if any(jax.tree.leaves(mask)) else None)
  opt_state = jax.eval_shape(optimizer.init, abstract.trainable(params))
  return dataclasses.replace(abstract, state=abstract.state.replace(opt_state=opt_state))


def model(abstract: Abstract, params) -> nnx.Module:
  """The module with these params (sharded as they are): for evaluation and inference."""
  return nnx.merge(abstract.graphdef, params)


def path_of(keypath) -> tuple[str, ...]:
  """The dict keys along a key path (the param's name; optax's containers skipped)."""
  return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def flat_by_path(tree, is_leaf=None) -> dict:
  """{the param's name (path_of): leaf} of a params-shaped tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {path_of(p): leaf for p, leaf in leaves}


def _derived_names(leaf_shape, param_shape, param_names, field: str | None):
  """Logical names for an optimizer leaf from its param: same shape → same names;
  Adafactor's factored `v_row`/`v_col` → the names without the dim optax factored away;
  anything else (step counts, unfactored placeholders) replicated."""
  leaf_shape, param_shape = tuple(leaf_shape), tuple(param_shape)
  if leaf_shape == param_shape:
    return param_names
  if field in ("v_row", "v_col") and len(leaf_shape) == len(param_shape) - 1:
    # optax.adafactor factors the two largest dims (d1, d0 = argsort(shape)[-2:]): v_row
    # drops d0 and v_col drops d1. Shapes alone are ambiguous when the two are equal.
    d1, d0 = (int(d) for d in np.argsort(param_shape)[-2:])
    drop = d0 if field == "v_row" else d1
    if leaf_shape == param_shape[:drop] + param_shape[drop + 1:]:  # else: not factored
      return param_names[:drop] + param_names[drop + 1:]
  return (None,) * len(leaf_shape)


def shardings(abstract: Abstract, rules: rules_lib.Rules, mesh: Mesh,
              offload: str = "none") -> Shardings:
  """Every placement of a run. `offload` "opt_state" keeps the stored weights (the fp32
  master under bf16) and the optimizer state in host memory between steps (ZeRO-Offload's
  split, Ren et al. 2021): the step streams them in for the update, and they are sharded
  over the host memory of the devices that would have held them."""
  if offload not in OFFLOAD:
    raise unknown("train.offload", offload, OFFLOAD)

  def named(names, shape, table, what):
    return NamedSharding(mesh, rules_lib.spec(names, shape, table, mesh, what))

  params = abstract.state.params
  param_names = flat_by_path(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  param_shapes = {p: a.shape for p, a in flat_by_path(params).items()}

  def param_sharding(table):
    return jax.tree_util.tree_map_with_path(
        lambda p, a: named(param_names[path_of(p)], a.shape, table,
                           f"param {'.'.join(path_of(p))}"), params)

  def opt_sharding(keypath, leaf):
    path = path_of(keypath)
    # Optax nests a copy of the param tree (mu, nu, v_row, ...): match the longest suffix.
    for start in range(len(path)):
      if path[start:] in param_names:
        p = path[start:]
        fields = [k.name for k in keypath if isinstance(k, jax.tree_util.GetAttrKey)]
        names = _derived_names(leaf.shape, param_shapes[p], param_names[p],
                               fields[-1] if fields else None)
        return named(names, leaf.shape, rules.opt_state,
                     f"optimizer state {'.'.join(path)}")
    return NamedSharding(mesh, PartitionSpec())

  state = TrainState(
      step=NamedSharding(mesh, PartitionSpec()),
      params=param_sharding(rules.params),
      opt_state=jax.tree_util.tree_map_with_path(opt_sharding, abstract.state.opt_state))
  working = state.params if rules.working is None else param_sharding(rules.working)
  batch = named(("batch",), (0,), rules.activations, "batch")
  stored = state
  if offload == "opt_state":
    stored = state.replace(**{k: jax.tree.map(lambda s: s.with_memory_kind(HOST),
                                              getattr(state, k))
                              for k in ("params", "opt_state")})
  return Shardings(stored, param_sharding(rules.grads), working, batch, mesh, rules, state)


def placed(abstract_tree, sharding_tree):
  """ShapeDtypeStructs that carry their shardings: AOT lowering inputs, restore targets."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, sharding_tree)


# XLA:CPU spends longer optimising the initialiser's machine code than the initialiser runs
# (once): at LLVM optimisation level 1 the default run's init compiles in 0.7 s instead of
# 1.2 to the same values bit for bit (tests/test_init_state.py). Level 0 is faster still but
# contracts the samplers' arithmetic differently (values 1 ulp off).
INIT_COMPILER_OPTIONS = {"cpu": {"xla_backend_optimization_level": 1}}


def init_state(abstract: Abstract, shardings_: Shardings) -> TrainState:
  """Initialises every leaf directly on its shard (jit with out_shardings): no device ever
  holds an unsharded copy."""

  def init():
    with nnx.use_eager_sharding(False):
      params = _store(nnx.to_pure_dict(_split_params(abstract.model_factory())[1]),
                      abstract.policy, abstract.frozen)
    return TrainState(jnp.zeros((), jnp.int32), params,
                      abstract.optimizer.init(abstract.trainable(params)))

  lowered = jax.jit(init, out_shardings=shardings_.state).lower()
  platform = shardings_.mesh.devices.flat[0].platform
  return lowered.compile(compiler_options=INIT_COMPILER_OPTIONS.get(platform))()
