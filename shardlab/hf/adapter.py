"""The Hugging Face adapter contract: what a model family gives the generic engine
(shardlab/hf/weights.py reads and writes safetensors by an adapter's table, and knows no
family), and `@adapter("arch")`, which registers one under the shardlab architecture it
converts (the name its config registers on the model contract, models/protocol.py).

A family is its model file plus one adapter file:

    @adapter("qwen2")
    class Qwen2(LlamaAdapter):
      architectures = ("Qwen2ForCausalLM",)
      model_types = ("qwen2",)
      def tensors(self, m): return super().tensors(m) + [bias mappings]

Import (`convert from-hf`, `--init-from hf:`) picks the adapter that claims the HF
config.json (shardlab/hf/families.py); export picks the one registered for the model's arch.
"""

import dataclasses
import types
from collections.abc import Mapping as MappingType

from shardlab.errors import ConfigError
from shardlab.models import protocol

CONFIG_FILE = "config.json"
LAYER = "{i}"  # in an HF name: one tensor per layer, stacked on the param's leading axis
# In an HF name: one tensor per index of the HF tensor's first dim (Mixtral's experts), read
# and written as one virtual stacked tensor (see Adapter.reader).
STACKED = "*"


@dataclasses.dataclass(frozen=True)
class Mapping:
  """One shardlab param ↔ one HF tensor, or its part of a fused one. `hf_dims` spells each
  HF dim as the param letters it flattens (outermost first): q_proj.weight is (H·E, D) =
  ("HE", "D"), the param q_DxHxE is "DHE". A name with {i} is per layer, stacked on the
  param's leading axis. The letters' sizes come from Adapter.sizes.

  A fused HF tensor holds several params side by side along its dim `axis` (Phi-3's
  qkv_proj: the rows of q, then k, then v): `parts` spells each one's extent on that dim, in
  order, as hf_dims spells a dim, and `part` is this param's; its own hf_dims are its part's.
  () : the tensor is this param's alone. `fuse` sets them; import splits the tensor, export
  concatenates it."""
  param: tuple[str, ...]
  hf: str
  hf_dims: tuple[str, ...]
  dims: str
  parts: tuple[str, ...] = ()
  part: int = 0
  axis: int = 0

  @property
  def stacked(self) -> bool:
    return LAYER in self.hf

  @property
  def fused(self) -> bool:
    return bool(self.parts)

  def hf_names(self, n_layers: int) -> list[str]:
    return [self.hf.format(i=i) for i in range(n_layers)] if self.stacked else [self.hf]


def fuse(*mappings: Mapping, axis: int = 0) -> list[Mapping]:
  """`mappings` (one HF name, written as if each param had the tensor to itself) as the
  parts, in order, of one HF tensor concatenated along its dim `axis`: Phi-3's qkv_proj is
  fuse(q's, k's, v's), its gate_up_proj fuse(gate's, up's). The other dims must agree."""
  first = mappings[0]
  others = lambda m: m.hf_dims[:axis] + m.hf_dims[axis + 1:]
  for m in mappings:
    if m.hf != first.hf or not 0 <= axis < len(m.hf_dims) or others(m) != others(first):
      raise ConfigError(f"cannot fuse {m.param} ({m.hf}, dims {m.hf_dims}) with "
                        f"{first.param} ({first.hf}, dims {first.hf_dims}) along dim {axis}: "
                        f"one HF name, and the same dims but for dim {axis}")
  parts = tuple(m.hf_dims[axis] for m in mappings)
  return [dataclasses.replace(m, parts=parts, part=k, axis=axis)
          for k, m in enumerate(mappings)]


class Adapter:
  """A family's Hugging Face side. Subclasses set the class attributes and implement
  to_model, to_hf and tensors; the rest has defaults."""
  arch: str = ""  # the shardlab architecture it converts (set by @adapter)
  label: str = ""  # the family's name in messages ("Llama")
  architectures: tuple[str, ...] = ()  # config.json `architectures` it reads; [0] is written
  model_types: tuple[str, ...] = ()  # config.json `model_type`s it reads; [0] is written
  # model field -> the HF config field it comes from: the fields that decide what the model
  # computes, compared by check_matches (name and max_seq_len do not).
  fields: MappingType[str, str] = {}

  def claims(self, hf: dict) -> bool:
    """Whether this adapter reads `hf` (a config.json): its `architectures` if listed, else
    its `model_type`. A variant narrows its base's claim (e.g. by `attention_bias`)."""
    archs = hf.get("architectures") or []
    if archs:
      return all(a in self.architectures for a in archs)
    return hf.get("model_type") in self.model_types

  def to_model(self, hf: dict, name: str = "hf", where: str = CONFIG_FILE):
    """The model config of `hf`, or a ConfigError naming the field and value it cannot
    hold (never a silently different model)."""
    raise NotImplementedError

  def to_hf(self, m, dtype: str) -> dict:
    """The config.json transformers loads `m` from, weights stored as `dtype`."""
    raise NotImplementedError

  def generation_config(self, m) -> dict:
    """generation_config.json (the special token ids, where the model has them)."""
    return {"_from_model_config": True}

  def tensors(self, m) -> list[Mapping]:
    """Every param of `m` ↔ its HF tensor, in HF's usual order."""
    raise NotImplementedError

  def sizes(self, m) -> dict[str, int]:
    """The size of every letter the tensor table's dims use."""
    return {"V": m.vocab_size, "D": m.d_model, "H": m.n_heads, "K": m.n_kv_heads,
            "E": m.head_dim, "F": m.mlp_dim}

  def unread(self, m) -> set[str]:
    """Tensors a checkpoint may carry that `m` does not read (a tied head's copy)."""
    return set()

  def reader(self, found, m):
    """The tensors the engine reads, given the directory's (a shardlab.hf.files.Reader);
    a family whose table names STACKED tensors wraps it (shardlab/hf/mixtral.py)."""
    return found

  def check_matches(self, hf_model, model, hf_dir) -> None:
    """Raises unless `model` (the run's --model) computes what the HF config describes."""
    diffs = [f"  model.arch = {model.arch!r}, but the HF config's is {hf_model.arch!r}"] \
        if hf_model.arch != model.arch else []
    diffs += [f"  model.{f} = {getattr(model, f, None)!r}, but {hf_name} = "
              f"{getattr(hf_model, f, None)!r}" for f, hf_name in self.fields.items()
              if getattr(model, f, None) != getattr(hf_model, f, None)]
    if diffs:
      raise ConfigError(
          f"--model {model.name!r} does not match the Hugging Face config in {hf_dir}:\n" +
          "\n".join(diffs) + "\nuse a model TOML with the HF shapes (`shardlab convert "
          f"hf-config {hf_dir} > model.toml`, then --model model.toml)")

  @property
  def config_class(self) -> type:
    """The model config class registered as `arch` (its model file must be imported)."""
    try:
      return protocol.ARCHITECTURES[self.arch]
    except KeyError:
      raise ConfigError(f"the Hugging Face adapter {type(self).__name__} converts "
                        f"architecture {self.arch!r}, which no imported model file "
                        f"registers; registered: {', '.join(protocol.ARCHITECTURES)}") from None


_ADAPTERS: dict[str, Adapter] = {}
ADAPTERS: MappingType[str, Adapter] = types.MappingProxyType(_ADAPTERS)  # read-only, live


def adapter(arch: str):
  """Class decorator: registers an Adapter subclass (one instance of it) as the Hugging Face
  side of architecture `arch`. A second adapter for one arch is refused (the same class
  again, or a reload of its module, is not)."""
  if not isinstance(arch, str) or not arch.strip():
    raise ConfigError(f"an architecture name must be a non-empty string, got {arch!r}")

  def put(cls: type) -> type:
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
      raise ConfigError(f"@adapter({arch!r}) decorates {cls!r}, which is not a subclass of "
                        f"shardlab.hf.adapter.Adapter")
    if not cls.architectures and not cls.model_types:
      raise ConfigError(f"{cls.__name__} names no HF architectures or model_types to read")
    held = _ADAPTERS.get(arch)
    key = lambda c: (c.__module__, c.__qualname__)
    if held is not None and key(type(held)) != key(cls):
      raise ConfigError(f"architecture {arch!r} already has a Hugging Face adapter, "
                        f"{key(type(held))[0]}.{key(type(held))[1]}; {cls.__module__}."
                        f"{cls.__qualname__} cannot register for it too")
    cls.arch = arch
    _ADAPTERS[arch] = cls()
    return cls

  return put


register_adapter = adapter  # the longer name, for a call outside a class statement
