"""The model contract: what a bundled architecture's config gives the CLI, the run, the
planner, the inspector and the generator, and `@register("name")`, which puts the config class
on the registry a preset's `arch` chooses from (shardlab.models.registry).

REQUIRED members every registered config has (`check` refuses a class that lacks one, when it
registers); OPTIONAL members may be missing, and what their absence means is written down
here, once: a stated default, or a clear refusal from the analytic planner (which then asks
for the compiled step, `shardlab plan --compile`), never a guess.

    @register("qwen2")
    @dataclasses.dataclass(frozen=True)
    class Qwen2Config(LlamaConfig):
      arch: str = "qwen2"
      ...
"""

import dataclasses
import inspect
import types
from collections.abc import Mapping
from typing import Any, Callable, Protocol, runtime_checkable

from shardlab.errors import ConfigError

# name -> what the core reads it for. The fields and the decoder's shape are values (dataclass
# fields, class constants or properties); the members in SIGNATURES are methods.
REQUIRED = {
    "name": "the model's label (presets: the file's stem)",
    "arch": "the name it registers under (a preset's `arch`)",
    "vocab_size": "the token table's rows; the data must fit it",
    "max_seq_len": "the longest sequence it trains and generates at",
    "n_layers": "the layer stack's depth (pipeline stages, the planner)",
    "d_model": "the residual stream's width (the planner, the HF engine)",
    "n_heads": "query heads (the planner's attention model)",
    "n_kv_heads": "key/value heads (the KV cache, the planner)",
    "head_dim": "one head's width (the KV cache, the planner)",
    "mlp_dim": "the feed-forward's width (the planner)",
    "tie_embeddings": "whether the output head is the token table",
    "make": "(rngs, param_dtype, remat, lora=None, unroll=1) -> the nnx.Module, with "
            "hidden(), output_head() and extend(tokens, cache); remat and unroll are its layer "
            "scan's settings (train.remat, train.scan_unroll)",
    "init_cache": "(batch, length, dtype) -> its KV cache",
    "activations": "logical names of the activations it constrains (kv_cache among them)",
    "no_weight_decay": "param names exempt from weight decay",
    "remat_policies": "the train.remat values it accepts",
    "axis_sizes": "() -> the size of every logical param axis it names",
    "n_params": "the exact parameter count (equals the abstract model's)",
    "n_layer_params": "parameters inside the scanned blocks",
    "flops_per_token": "(seq_len) -> model FLOPs per token, for MFU",
    "n_lora_params": "(lora) -> adapter parameters a LoraConfig adds (0 if none)",
    "lora_targets": "the projections LoRA may adapt; () if none",
    "lora_weights": "{target: the weight it adapts}, for --merge-lora; {} if none",
}
# The methods among REQUIRED and the arguments the core calls them with.
SIGNATURES = {
    "make": ((None, None, "none"), {"lora": None, "unroll": 1}),
    "init_cache": ((1, 1, None), {}),
    "axis_sizes": ((), {}),
    "flops_per_token": ((1,), {}),
    "n_lora_params": ((None,), {}),
}


@dataclasses.dataclass(frozen=True)
class OptionalMember:
  what: str  # what the member is
  missing: str  # what its absence means
  default: Callable[[Any], Any] | None = None  # its value when missing; None: refused


PLANNER_REFUSES = "the analytic planner refuses the model (compile the step instead)"


def _planner(what: str) -> OptionalMember:
  return OptionalMember(what, PLANNER_REFUSES)


OPTIONAL = {
    "eos_ids": OptionalMember("token ids that end a generated sample (an HF import's)",
                              "only the tokenizer's EOS ends a sample", lambda m: ()),
    "position_limit": OptionalMember("why a sequence past max_seq_len goes wrong (a planner "
                                     "note)", "the note says it was not trained past it",
                                     lambda m: "it was not trained past it"),
    "attention": _planner("the attention implementation ('xla' | 'flash' | 'auto')"),
    "attention_scores": OptionalMember("the dense attention path's score dtype ('fp32' | "
                                       "'compute')", "fp32 scores", lambda m: "fp32"),
    "kv_exchange": _planner("how context parallelism exchanges K/V ('all-gather' | 'ring'); "
                            "read only on a mesh with a context axis"),
    "saved_activations": _planner("what autodiff saves per layer, by shape: the planner's "
                                  "activation memory at every remat"),
    "saved_matmul_outputs": _planner("the matmul outputs kept at remat save-matmul-outputs"),
    "saved_projections": _planner("{checkpoint name: shape} of the named projection outputs "
                                  "a layer's backward reads when a named remat policy keeps "
                                  "them (shardlab/remat.py)"),
    "unread_projections": OptionalMember("checkpoint names (shardlab/remat.py) of the "
                                         "projections whose output no backward reads: under "
                                         "remat their forward is not run again (the planner)",
                                         "every projection's forward runs again",
                                         lambda m: ()),
    "n_experts": OptionalMember("experts per layer: the model is a mixture of experts, and "
                                "gives every member of EXPERTS",
                                "a dense model: no expert weights, no dispatch all-to-all"),
    "n_active_params": OptionalMember("the parameters one token runs through",
                                      "every parameter (a dense model)", lambda m: m.n_params),
    "windows": OptionalMember("every layer's sliding window, in order (None: none); such a "
                              "layer's KV cache is a ring of min(window, length) entries",
                              "no window: every layer caches the whole context",
                              lambda m: (None,) * m.n_layers),
    "layers_per_scan_step": OptionalMember("layers one step of the layer scan runs: their "
                                           "backward buffers are live together (the planner)",
                                           "one layer a step", lambda m: 1),
    "backward_transients": OptionalMember("what a layer's backward holds beyond llama's, by "
                                          "shape as saved_activations (the planner)",
                                          "nothing beyond llama's", lambda m: {}),
    "loss_fp32_logits": OptionalMember("fp32 B×L×V arrays the loss's forward holds beside "
                                       "its softmax (the planner)", "1: the logits",
                                       lambda m: 1),
}
# Optional members of the module `make` returns, read only where a setting asks for them.
MODULE_OPTIONAL = {
    "pipeline_parts": OptionalMember(
        "(the inputs `hidden` takes) -> shardlab.parallel.PipelineParts: the embedded tokens, "
        "the stacked layers and the head, for the 1F1B schedule, which owns the loss",
        "train.pipeline_schedule=1f1b is refused for it (gpipe runs it)"),
}
# A mixture of experts (a config with n_experts) gives all of these.
EXPERTS = ("n_experts", "experts_per_token", "n_active_params", "n_expert_params", "dispatch",
           "capacity")


@runtime_checkable
class ModelConfig(Protocol):
  """REQUIRED, typed (isinstance works on an instance; `check` also takes a class)."""
  name: str
  arch: str
  vocab_size: int
  max_seq_len: int
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  tie_embeddings: bool
  activations: Mapping[str, tuple]
  no_weight_decay: tuple[str, ...]
  remat_policies: tuple[str, ...]
  n_params: int
  n_layer_params: int
  lora_targets: tuple[str, ...]
  lora_weights: Mapping[str, str]

  def make(self, rngs, param_dtype, remat: str = "none", lora=None, unroll: int = 1) -> Any: ...

  def init_cache(self, batch: int, length: int, dtype) -> Any: ...

  def axis_sizes(self) -> dict[str, int]: ...

  def flops_per_token(self, seq_len: int) -> float: ...

  def n_lora_params(self, lora) -> int: ...


def _declares(cls: type, member: str) -> bool:
  """A class attribute, property or method, or an annotated (dataclass) field."""
  return hasattr(cls, member) or any(member in vars(k).get("__annotations__", {})
                                     for k in cls.__mro__)


def problems(config) -> list[str]:
  """What keeps `config` (a config class or instance) off the contract; [] if nothing."""
  cls = config if isinstance(config, type) else type(config)
  has = (lambda m: _declares(cls, m)) if config is cls else (lambda m: hasattr(config, m))
  out = [f"missing {m}: {REQUIRED[m]}" for m in REQUIRED if not has(m)]
  for member, (args, kwargs) in SIGNATURES.items():
    method = getattr(cls, member, None)
    if has(member) and not callable(method):
      out.append(f"{member} must be a method: {REQUIRED[member]}")
    elif has(member):
      try:
        inspect.signature(method).bind(None, *args, **kwargs)
      except TypeError:
        call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        out.append(f"{member}{inspect.signature(method)} cannot be called as "
                   f"{member}({call}): {REQUIRED[member]}")
  for member in REQUIRED.keys() - SIGNATURES.keys():
    if isinstance(vars(cls).get(member), types.FunctionType):
      out.append(f"{member} must be a value or a property, not a method: {REQUIRED[member]}")
  if has("n_experts"):
    out += [f"missing {m}: a mixture of experts (a config with n_experts) gives all of "
            f"{', '.join(EXPERTS)}" for m in EXPERTS if not has(m)]
  return out


def check(config):
  """`config` (a class or an instance) if it keeps the contract, else a ConfigError listing
  every missing or malformed member."""
  found = problems(config)
  if found:
    label = config.__name__ if isinstance(config, type) else type(config).__name__
    raise ConfigError(f"{label} does not keep the model contract (shardlab.models.protocol):"
                      "\n  " + "\n  ".join(found))
  return config


def has(model, member: str) -> bool:
  """Whether `model` gives the OPTIONAL `member` (n_experts: whether it is a mixture of
  experts)."""
  if member not in OPTIONAL:
    raise KeyError(f"{member!r} is not an optional member; valid: {', '.join(OPTIONAL)}")
  return hasattr(model, member)


def get(model, member: str):
  """model.<member>, or what OPTIONAL says its absence means: the stated default, or a
  ConfigError for a member the analytic planner cannot go on without."""
  if has(model, member):
    return getattr(model, member)
  spec = OPTIONAL[member]
  if spec.default is not None:
    return spec.default(model)
  raise ConfigError(
      f"the analytic planner needs model.{member} ({spec.what}), which model "
      f"{getattr(model, 'name', '?')!r} ({type(model).__name__}, arch "
      f"{getattr(model, 'arch', '?')!r}) does not give; compile the step instead (--compile), "
      f"or add {member} to its config")


def module_has(module, member: str) -> bool:
  """Whether `module` (what a config's `make` returns) gives the MODULE_OPTIONAL `member`
  (a class attribute of None says it does not, as a subclass opting out does)."""
  if member not in MODULE_OPTIONAL:
    raise KeyError(f"{member!r} is not an optional module member; valid: "
                   f"{', '.join(MODULE_OPTIONAL)}")
  return getattr(module, member, None) is not None


def require_module_member(module, member: str, setting: str) -> None:
  """A ConfigError naming `member`, `module`'s class and `setting` when it lacks it."""
  if not module_has(module, member):
    spec = MODULE_OPTIONAL[member]
    raise ConfigError(f"{setting} needs the model's module to give {member} ({spec.what}); "
                      f"{type(module).__name__} does not, so {spec.missing}")


# ---- the registry ------------------------------------------------------------------------

_REGISTERED: dict[str, type] = {}
ARCHITECTURES: Mapping[str, type] = types.MappingProxyType(_REGISTERED)  # read-only, live


def register(arch: str):
  """Class decorator: registers a config class as architecture `arch`, after `check`. A
  dataclass's `arch` field must default to `arch`; a name already taken by another class is
  refused (registering the same class again, or a reload of its module, is not)."""
  if not isinstance(arch, str) or not arch.strip():
    raise ConfigError(f"an architecture name must be a non-empty string, got {arch!r}")

  def put(cls: type) -> type:
    check(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) \
        else {}
    default = fields["arch"].default if "arch" in fields else getattr(cls, "arch", None)
    if default != arch:
      raise ConfigError(f"{cls.__name__} registers as {arch!r} but its arch defaults to "
                        f"{default!r}; declare `arch: str = {arch!r}` in it")
    held = _REGISTERED.get(arch)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__,
                                                                     cls.__qualname__):
      raise ConfigError(f"architecture {arch!r} is already registered by "
                        f"{held.__module__}.{held.__qualname__}; {cls.__module__}."
                        f"{cls.__qualname__} needs another name")
    _REGISTERED[arch] = cls
    return cls

  return put


def arch_of(cls: type) -> str | None:
  """The name `cls` registered under, or its nearest registered base's (None if neither):
  what a config's own `arch` must equal."""
  for klass in cls.__mro__:
    for name, held in _REGISTERED.items():
      if held is klass:
        return name
  return None
