"""The layer scan's remat policies: what one layer keeps for its backward pass, where, and
what the backward pass computes again.

A policy names tensors by their `checkpoint_name`. A bundled decoder names the outputs of
its weight matmuls as MaxText's decoders do (`PROJECTION_NAMES`), so MaxText's published
recipes carry over by name: its `save_dot_except_mlpwi` is `save-dot-except-mlpwi` here, its
`minimal` is `save-matmul-outputs`. A user's module gets the named policies by naming the
same tensors (`jax.ad_checkpoint.checkpoint_name`, or `project_target`'s projections do it),
and `full`, `offload` and `save-matmul-outputs` with no names at all.

Besides the listed policies, `custom:NAME=WHERE,...` keeps each named tensor where it says
(MaxText's `remat_policy=custom` with its per-tensor settings): WHERE is `device`, `offload`
(host memory) or `remat` (computed again, as any name left out is). `policy(remat)` reads
both forms.
"""

import dataclasses
import functools

from shardlab.errors import ConfigError, unknown

LAYER_INPUT = "layer_input"  # the checkpoint_name of a layer's input (remat "offload")

# A layer's weight-matmul outputs by the role of the projection (the LoRA target names),
# as MaxText names them. A non-gated MLP's one input projection is its "up".
PROJECTION_NAMES = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "out_proj",
                    "gate": "mlpwi_0", "up": "mlpwi_1", "down": "mlpwo"}
QKV = ("query_proj", "key_proj", "value_proj")


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which residuals a rematerialised layer keeps: `saved` names on the device, `offloaded`
  names in host memory, and `dots` ("device" | "host" | ""): every weight matmul's output
  (a dot with no batch dimension), whatever its name. Everything else is computed again."""
  saved: tuple[str, ...] = ()
  offloaded: tuple[str, ...] = ()
  dots: str = ""

  def jax_policy(self):
    import jax  # here, so that the config can list the policies without starting JAX
    cp = jax.checkpoint_policies
    projections = list(PROJECTION_NAMES.values())
    # shardlab's own projections are custom_vjp einsums (parallel/dot.py) that a dots
    # policy does not see into: their outputs are kept by name; a user's plain einsums and
    # matmuls by the dots policy.
    if self.dots == "device":
      return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                        cp.save_only_these_names(*projections))
    offloaded = projections if self.dots == "host" else list(self.offloaded)
    if offloaded:
      return cp.save_and_offload_only_these_names(
          names_which_can_be_saved=list(self.saved), names_which_can_be_offloaded=offloaded,
          offload_src="device", offload_dst="pinned_host")
    return cp.save_only_these_names(*self.saved) if self.saved else cp.nothing_saveable

  @property
  def on_host(self) -> bool:
    return bool(self.offloaded) or self.dots == "host"

  @property
  def names(self) -> set[str]:
    """The projections it keeps by name (on the device or the host), the input aside."""
    return (set(self.saved) | set(self.offloaded)) - {LAYER_INPUT}


# train.remat -> its Policy (None: no remat, autodiff keeps what it needs).
POLICIES = {
    "none": None,
    "full": Policy(),
    # Keep weight-matmul outputs, recompute the rest (norms, activations, attention).
    "save-matmul-outputs": Policy(dots="device"),
    # Recompute like "full", but keep each layer's input in host memory instead of on the
    # device: the layers × B×L×D stack that full remat holds is what dominates at large
    # batches (MaxText's offloaded decoder_layer_input).
    "offload": Policy(offloaded=(LAYER_INPUT,)),
    # MaxText's named policies: the attention's projections kept, the MLP's recomputed.
    "save-qkv-proj": Policy(saved=QKV),
    "save-dot-except-mlp": Policy(saved=QKV + ("out_proj",)),
    "save-dot-except-mlpwi": Policy(saved=QKV + ("out_proj", "mlpwo")),
    "qkv-proj-offloaded": Policy(offloaded=QKV),
    "minimal-offloaded": Policy(dots="host"),  # the projections' outputs, named ones only
}

# The policies that need a model to name its projections (PROJECTION_NAMES).
NAMED = tuple(k for k, p in POLICIES.items() if p and p.names)

# A custom policy's spec: "custom:" then NAME=WHERE pairs, comma-separated.
CUSTOM = "custom:"
CUSTOM_NAMES = (LAYER_INPUT, *PROJECTION_NAMES.values())
CUSTOM_WHERE = ("device", "offload", "remat")
_VALID = [*POLICIES, f"{CUSTOM}NAME=device|offload|remat,..."]


def policy(remat: str) -> Policy | None:
  """The Policy a train.remat value names: a key of POLICIES, or a custom spec (the module
  docstring); anything else is refused naming the valid ones."""
  if not isinstance(remat, str) or not (remat in POLICIES or remat.startswith(CUSTOM)):
    raise unknown("train.remat", remat, _VALID)
  return POLICIES[remat] if remat in POLICIES else _custom(remat)


@functools.cache
def _custom(remat: str) -> Policy:
  where: dict[str, str] = {}
  for item in remat[len(CUSTOM):].split(","):
    name, eq, place = (part.strip() for part in item.partition("="))
    if not eq or name not in CUSTOM_NAMES or place not in CUSTOM_WHERE:
      raise ConfigError(
          f"train.remat {remat!r}: {item.strip()!r} is not NAME=WHERE with NAME one of "
          f"{', '.join(CUSTOM_NAMES)} and WHERE one of {', '.join(CUSTOM_WHERE)}")
    if name in where:
      raise ConfigError(f"train.remat {remat!r} places {name} twice")
    where[name] = place
  if where.get(LAYER_INPUT) == "device":
    raise ConfigError(f"train.remat {remat!r}: {LAYER_INPUT}=device is what every policy "
                      f"does (the layer scan keeps each layer's input); offload it or leave "
                      f"it out")
  return Policy(saved=tuple(n for n in CUSTOM_NAMES if where.get(n) == "device"),
                offloaded=tuple(n for n in CUSTOM_NAMES if where.get(n) == "offload"))


def custom(*, saved=(), offloaded=()) -> str:
  """The custom spec that keeps `saved` names on the device and `offloaded` ones in host
  memory (MaxText's `remat_policy=custom` with those names at `device` and `offload`)."""
  return CUSTOM + ",".join([*(f"{n}=device" for n in saved),
                            *(f"{n}=offload" for n in offloaded)])


def recomputes_all(remat: str) -> bool:
  """Whether a policy runs each layer's whole forward again (it keeps no matmul output:
  full, offload, a custom policy that keeps at most the layer input)."""
  p = policy(remat)
  return p is not None and not p.names and not p.dots


def offered(remat: str, accepted) -> bool:
  """Whether a model whose `remat_policies` are `accepted` runs `remat`: a listed policy if
  it is among them; a custom one if the model runs the listed policies that need what it
  needs (its projections named: the named ones; its input offloaded: `offload`)."""
  if remat in POLICIES:
    return remat in accepted
  p = policy(remat)
  needs = list(NAMED) if p.names else []
  if LAYER_INPUT in p.offloaded:
    needs.append("offload")
  return all(n in accepted for n in needs)
