"""What each collective of a compiled step is: one the strategy implies (planned), or one XLA
inserted because the annotations did not line up (unplanned), with a hint for the latter.

A collective is recognised by what it moves (an array shaped like a parameter on some of
its mesh axes, or an activation), over which mesh axes, and in which pass; the axes a
strategy plans for each purpose come from its rules tables (shardlab.sharding.rules).
"""

import dataclasses
import math

import jax

from shardlab.sharding import rules as rules_lib

WEIGHT_GATHER = "weight gather (FSDP/ZeRO)"
GRAD_REDUCTION = "gradient reduction"
TENSOR_REDUCTION = "tensor-parallel reduction"
SEQUENCE_GATHER = "sequence-parallel gather"
EXPERT_ALL_TO_ALL = "expert all-to-all"
PIPELINE_PERMUTE = "pipeline permute"
CONTEXT_EXCHANGE = "context-parallel KV exchange"
LOOKUP = "sharded table lookup"
STATISTICS = "sum or norm reduction"
RESHARDING = "resharding"
REPLICATED = "replicated intermediate"
REMAT = "involuntary rematerialization"
PLANNED = (WEIGHT_GATHER, GRAD_REDUCTION, TENSOR_REDUCTION, SEQUENCE_GATHER, EXPERT_ALL_TO_ALL,
           PIPELINE_PERMUTE, CONTEXT_EXCHANGE, LOOKUP, STATISTICS)
UNPLANNED = (RESHARDING, REPLICATED, REMAT)
SMALL = 4096  # elements: a loss, a norm, per-token statistics, not a tensor worth moving
TOKEN_AXES = ("data", "fsdp", "expert", "context")  # without rules: the usual batch axes


@dataclasses.dataclass(frozen=True)
class Leaf:
  """An input array of the step: a parameter or optimizer state leaf, or the batch."""
  path: str
  shape: tuple[int, ...]
  axes: tuple[tuple[str, ...], ...]  # mesh axes per dim
  names: tuple | None = None  # logical names, where known

  def matches(self, shape: tuple[int, ...], gathered: set[str], sizes: dict) -> int | None:
    """The dim the collective gathers or reduces if `shape` is this leaf (or one layer of a
    stacked leaf) with the `gathered` axes undone, else None (-1: no dim gathered)."""
    if not self.shape or not shape:
      return None  # a scalar could be anything
    for exact in (True, False):
      for drop in (0, 1):
        dims = list(zip(self.shape, self.axes))[drop:]
        local = tuple(n // math.prod(sizes.get(a, 1) for a in ax if a not in gathered)
                      for n, ax in dims)
        if local == shape if exact else sorted(local) == sorted(shape):
          hit = [i + drop for i, (_, ax) in enumerate(dims) if gathered & set(ax)]
          return hit[0] if hit else -1
    return None


def leaves(arguments: list, names=None) -> list[Leaf]:
  """Leaves of the step's arguments ((path, shape, sharding) triples) with a
  PartitionSpec; `names`: a params-shaped tree of logical-name tuples (Abstract.names),
  matched to the leaves whose path ends like theirs."""
  by_path = {}
  if names is not None:
    flat = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, tuple))
    by_path = {jax.tree_util.keystr(p): n for p, n in flat[0]}
  out = []
  for key, shape, sharding in arguments:
    spec = getattr(sharding, "spec", None)
    if spec is None:
      continue
    axes = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in tuple(spec) + (None,) * (len(shape) - len(spec)))
    own = next((n for p, n in by_path.items() if key.endswith(p) and ".params" in key), None)
    out.append(Leaf(key.removeprefix("[0]."), tuple(shape), axes, own))
  return out


def _axes(value) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def _table_axes(table: dict, names) -> set[str]:
  return {a for n in names for a in _axes(table.get(n))}


@dataclasses.dataclass(frozen=True)
class Plan:
  """The mesh axes a strategy plans each kind of communication over."""
  weight: set  # params/opt_state/working tables shard weights over these (gathered for use)
  tokens: set  # batch and sequence axes (gradients are partial sums over them)
  tensor: set  # heads/mlp/vocab: tensor-parallel
  sequence: set  # residual_length beyond the token axes: Megatron-SP
  context: set
  expert: set
  stage: set


def plan(rules: rules_lib.Rules | None) -> Plan:
  if rules is None:
    return Plan({"fsdp", "data", "context", "expert"}, set(TOKEN_AXES), {"tensor"}, {"tensor"},
                {"context"}, {"expert"}, {"stage"})
  weight = set()
  for table in (rules.params, rules.opt_state, rules.working or {}):
    weight |= _table_axes(table, [n for n in table if n not in ("layers",)])
  acts = rules.activations
  tokens = set(rules.token_axes)
  tensor = _table_axes(acts, ("heads", "kv_heads", "mlp", "vocab")) - tokens
  return Plan(weight - _table_axes(acts, ("heads", "kv_heads", "mlp", "vocab")), tokens,
              tensor, _table_axes(acts, ("residual_length",)) - tokens,
              _table_axes(acts, ("length",)), _table_axes(acts, ("experts",)),
              _table_axes(acts, ("layers",)))


def verdict(kind: str, axes: tuple[str, ...], elements: int, leaf: Leaf | None, op_name: str,
            backward: bool, p: Plan) -> str:
  """The verdict for one collective (see the module docstring)."""
  over = set(axes)
  if not over:
    return STATISTICS  # within a device: nothing crosses a link
  if leaf is not None and kind == "all-gather" and over <= p.weight | p.tensor:
    return WEIGHT_GATHER
  if leaf is not None and kind in ("all-reduce", "reduce-scatter") and backward \
      and over <= p.tokens | p.weight | p.tensor:
    return GRAD_REDUCTION
  if op_name.endswith(("/gather", "/scatter-add", "/scatter_add")) or "_take" in op_name:
    return LOOKUP  # XLA's partitioned gather from a sharded table (an embedding)
  if kind == "all-to-all":
    return EXPERT_ALL_TO_ALL if over <= p.expert | p.tokens and over & p.expert else RESHARDING
  if kind == "collective-permute":
    if over & p.stage:
      return PIPELINE_PERMUTE
    if over <= p.context:
      return CONTEXT_EXCHANGE
  if kind in ("all-reduce", "reduce-scatter"):
    if over <= p.tensor | p.sequence:
      return TENSOR_REDUCTION
    if elements <= SMALL or over <= p.tokens:
      return STATISTICS
  if kind == "all-gather":
    if over <= p.sequence:
      return SEQUENCE_GATHER
    if over <= p.context:
      return CONTEXT_EXCHANGE
    if elements <= SMALL:
      return STATISTICS
    return REPLICATED if over & p.tokens else RESHARDING
  return RESHARDING


def hint(verdict_: str, source: str, others: list[str]) -> str:
  """One line for an unplanned collective: what disagrees, and what would remove it."""
  if len(others) >= 2:
    return (f"annotations disagree: {' vs '.join(others)}; make them ask for the same "
            f"sharding (change one constrain, or the rule behind it)")
  if verdict_ == REMAT:
    return (f"XLA could not reshard at {source} without gathering the whole tensor; add a "
            f"constrain there with the sharding the consumer wants")
  if verdict_ == REPLICATED:
    return (f"an activation is gathered whole over the batch axes at {source}; constrain "
            f"its batch dim (names ('batch', ...)) so it stays split")
  return (f"the sharding changes at {source}; constrain the array before it to the layout "
          f"its consumer needs, or change the rule that puts it elsewhere")
