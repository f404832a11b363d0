"""Serving one model on one layout: per-device memory (weights, KV cache, the temporaries of
a decode step and of a prefill) and roofline prefill and decode speeds — nothing allocated.

A layout is tensor × stage × data: tensor parallelism by the `tp` rules (heads, kv_heads,
mlp and vocab over `tensor`), pipeline stages holding consecutive layers, data-parallel
replicas that split the batch. Weights are counted leaf by leaf from the model's abstract
state, divided as the rules divide them, at the requested bytes per weight.

The KV cache is what generation allocates (the model's init_cache): each layer's buffer
holds the context, a sliding-window layer's a ring of min(window, context) entries.
Decode reads every weight and the whole KV cache once per step (one token for each sequence
of a replica), so it is bound by HBM bandwidth until the batch is large; prefill is bound by
FLOPs. Both are rooflines (every term at 100% of the datasheet), each with the term that
binds named. Temporaries are what shardlab's own steps hold (models/decoder.py, read off
XLA's buffer assignment): the scan over layers writes the updated cache into a new stacked
buffer (a second copy of the cache, on CPU and in the TPU compiler alike), beside two of
one layer's K/V buffers and one layer's weights.
"""

import dataclasses
import functools
import math

import jax

from shardlab import config as config_lib
from shardlab.bounds import Int
from shardlab.errors import ConfigError, unknown
from shardlab.models import protocol
from shardlab.plan.training import estimate as plan_estimate
from shardlab.plan.training import memory as plan_memory
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.training import run as run_lib

# Bytes per weight of a matrix, and per block of 128 weights for the scales of a quantised
# one (int8: a bf16 scale per output channel, counted as per 128 weights at most; int4: a
# bf16 scale per group of 128, as GPTQ/AWQ store them). Vectors (norm scales) stay 16-bit.
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
SCALE_BYTES = {"fp32": 0.0, "bf16": 0.0, "int8": 2 / 128, "int4": 2 / 128}
# A KV entry; int8 keeps a bf16 scale per token and head besides (per head_dim entries).
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}
# What `shardlab generate` and `plan serve --compile` execute; the others are formula.
EXECUTABLE = ("fp32", "bf16")
ACTIVATION_BYTES = 2  # the residual stream the tensor-parallel all-reduces carry (bf16)
PREFILL_CHUNK = 512  # prompt tokens per prefill call: shardlab.generate's default


# Each count's range: Request's check and `plan serve`'s options (--batch, ...) read it.
BOUNDS = {f: Int(min=1) for f in ("batch", "context", "prefill_batch", "prefill_chunk",
                                   "devices")}


@dataclasses.dataclass(frozen=True)
class Request:
  model: str = "llama3-70b"
  target: str = "h100-80g"
  batch: int = 1  # sequences decoded together
  context: int = 8192  # cache length: prompt + generated tokens
  weights: str = "bf16"
  kv_dtype: str = "bf16"
  prefill_batch: int = 1  # sequences prefilled at once (per replica)
  prefill_chunk: int = PREFILL_CHUNK  # their tokens per prefill call
  devices: int | None = None
  mesh: str | None = None  # e.g. "tensor:8,stage:2"; data, tensor and stage only

  def __post_init__(self):
    for f, bound in BOUNDS.items():
      value = getattr(self, f)
      if value is None and f == "devices":
        continue
      if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"inference {f} must be an integer {bound}, got {value!r}")
      bound.check(value, f"inference {f}")
    if self.weights not in WEIGHT_BYTES:
      raise unknown("weights dtype (--weights)", self.weights, WEIGHT_BYTES)
    if self.kv_dtype not in KV_BYTES:
      raise unknown("KV cache dtype (--kv-dtype)", self.kv_dtype, KV_BYTES)
    if self.prefill_batch > self.batch:
      raise ConfigError(f"prefill_batch ({self.prefill_batch}) cannot exceed batch "
                        f"({self.batch})")


@dataclasses.dataclass(frozen=True)
class Layout:
  tensor: int = 1
  stage: int = 1
  data: int = 1

  @property
  def n_devices(self) -> int:
    return self.tensor * self.stage * self.data

  def describe(self) -> str:
    return f"tensor={self.tensor} stage={self.stage} data={self.data}"

  def mesh(self) -> str:
    """The inline mesh `shardlab generate --mesh` takes (no stage axis: formula only)."""
    return f"data:{self.data},tensor:{self.tensor}"


def layout_from_mesh(text: str) -> Layout:
  spec = mesh_lib.load(text)
  if any(s == -1 for part in (spec.ici, spec.dcn) for s in part.values()):
    raise ConfigError(f"mesh {text!r} has a -1 axis: an inference plan needs every size")
  extra = {a: s for a, s in spec.shape.items() if a not in ("data", "tensor", "stage") and s > 1}
  if extra:
    raise ConfigError(f"mesh {text!r}: an inference layout has axes data, tensor and stage "
                      f"only, got {extra}")
  return Layout(spec.size("tensor"), spec.size("stage"), spec.size("data"))


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device (the fullest pipeline stage)."""
  weights: float
  kv_cache: float
  decode_temp: float  # one decode step's temporaries (incl. the scan's new cache buffer)
  prefill_temp: float  # one prefill's (prefill_batch sequences of the whole context)

  @property
  def total(self) -> float:
    return self.weights + self.kv_cache + max(self.decode_temp, self.prefill_temp)

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), total=self.total)


@dataclasses.dataclass(frozen=True)
class Phase:
  """One step of prefill or decode on a replica: its time, the roofline terms, the bound."""
  step_s: float
  bound: str  # "memory" | "compute" | "communication"
  terms: dict  # term -> seconds (summed over the stages a token passes in turn)
  tokens_per_s_per_seq: float
  tokens_per_s: float  # every sequence of every replica


@dataclasses.dataclass(frozen=True)
class Estimate:
  layout: Layout
  memory: Memory
  usable_bytes: float
  decode: Phase
  prefill: Phase
  bytes_per_decode_step: float  # per device: weights + KV read

  @property
  def fits(self) -> bool:
    return self.memory.total <= self.usable_bytes


def active_params(model) -> int:
  """Parameters one token's forward pass reads: all of them for a dense model; a mixture of
  experts says how many with `n_active_params`."""
  return protocol.get(model, "n_active_params")


@functools.lru_cache(maxsize=4)
def _abstract(model):
  train = config_lib.TrainConfig(precision="fp32", optimizer="sgd")
  return run_lib.abstract_state(config_lib.Config(model=model, train=train))


@functools.lru_cache(maxsize=64)
def weight_split(model, tensor: int) -> tuple[float, tuple[float, ...], float]:
  """(elements per device in the stacked layers, each outer leaf's elements, vector
  elements) under `tp` on tensor=t; ConfigError when a dimension does not divide."""
  abstract = _abstract(model)
  names = jax.tree.leaves(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  table = rules_lib.strategy("tp").params
  mesh = _mesh(tensor)
  layers, outer, vectors = 0.0, [], 0.0
  for n, leaf in zip(names, jax.tree.leaves(abstract.state.params)):
    elems = plan_memory.shard_elems(leaf.shape, n, table, mesh, "param")
    if len([x for x in n if x != "layers"]) < 2:
      vectors += elems
    elif n[0] == "layers":
      layers += elems
    else:
      outer.append(float(elems))
  return layers, tuple(outer), vectors


def _mesh(tensor: int, data: int = 1):
  return plan_estimate.abstract_mesh(mesh_lib.MeshSpec(
      ici={"data": data, "fsdp": 1, "tensor": tensor}, dcn={}))


def weight_bytes(model, layout: Layout, dtype: str) -> tuple[float, float]:
  """(bytes per device on the fullest stage, of which one layer's). A stage holds
  ceil(layers / stages) layers and, beyond one stage, the larger of the embedding table and
  the output head (the first stage looks tokens up, the last computes logits)."""
  layers, outer, vectors = weight_split(model, layout.tensor)
  per_weight = WEIGHT_BYTES[dtype] + SCALE_BYTES[dtype]
  vector_bytes = max(WEIGHT_BYTES[dtype], 2.0)
  held = math.ceil(model.n_layers / layout.stage)
  if layout.stage > model.n_layers:
    raise ConfigError(f"stage ({layout.stage}) cannot exceed the model's layers "
                      f"({model.n_layers})")
  outer_elems = sum(outer) if layout.stage == 1 else max(outer, default=0.0)
  one_layer = layers / model.n_layers * per_weight
  return (one_layer * held + outer_elems * per_weight + vectors * vector_bytes, one_layer)


def cache_lengths(model, context: int) -> tuple[int, ...]:
  """Each layer's KV cache entries at `context` tokens: a sliding-window layer keeps a ring
  of min(window, context) (models/decoder.py's KVCache), the others the whole context."""
  return tuple(min(w, context) if w else context for w in protocol.get(model, "windows"))


def kv_layer_bytes(model, layout: Layout, batch: int, context: int,
                   dtype: str) -> tuple[float, ...]:
  """Each layer's K and V buffers per device: 2 × batch rows × its cache length × kv heads
  × head_dim, divided as generation shards them (batch over data, kv_heads over tensor)."""
  if batch % layout.data:
    raise ConfigError(f"batch {batch} does not split over data={layout.data}")
  names = ("batch", "length", "kv_heads", "head_dim")
  table, mesh = rules_lib.strategy("tp").activations, _mesh(layout.tensor, layout.data)
  per_entry = KV_BYTES[dtype] + (2 / model.head_dim if dtype == "int8" else 0.0)
  elems = {s: plan_memory.shard_elems((batch, s, model.n_kv_heads, model.head_dim), names,
                                      table, mesh, "kv cache")
           for s in set(cache_lengths(model, context))}
  return tuple(2 * elems[s] * per_entry for s in cache_lengths(model, context))


def kv_bytes(model, layout: Layout, batch: int, context: int, dtype: str) -> float:
  """The KV cache per device on the fullest stage (a stage holds ceil(layers / stages)
  consecutive layers): the sum of its layers' buffers (`kv_layer_bytes`; local layers'
  rings are shorter than the context)."""
  layers = kv_layer_bytes(model, layout, batch, context, dtype)
  held = math.ceil(model.n_layers / layout.stage)
  return max(sum(layers[i:i + held]) for i in range(0, model.n_layers, held))
