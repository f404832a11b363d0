"""The bundled families' adapters, and the lookups over every registered adapter: importing
this module registers llama's, Mixtral's, Qwen's, Mistral's, Gemma's, Phi-3's and GPT-2's (a
user's family registers by importing its own adapter file, as its model file registers its
config).

Import reads an HF config.json: the adapter that claims it (a variant that narrows a base's
claim, e.g. Llama with `attention_bias`, wins over that base). Export writes a model: the
adapter registered for its arch.
"""

from shardlab.errors import ConfigError
from shardlab.hf import llama, mixtral, qwen2, qwen3
from shardlab.hf import gemma, gpt2, mistral, phi3  # after them: llama's and Mixtral's list first
from shardlab.hf.adapter import ADAPTERS, CONFIG_FILE, Adapter

# Importing their files registered them (in this order: the error lists llama's first).
BUNDLED = (llama.LlamaAdapter, mixtral.MixtralAdapter, qwen2.Qwen2Adapter,
           qwen3.Qwen3Adapter, qwen3.Qwen3MoeAdapter, mistral.MistralAdapter,
           gemma.Gemma2Adapter, gemma.Gemma3Adapter, gpt2.GPT2Adapter, phi3.Phi3Adapter)


def supported() -> str:
  """'LlamaForCausalLM, MixtralForCausalLM (model_type 'llama', 'mixtral')'."""
  archs, types = [], []
  for a in ADAPTERS.values():
    archs += [n for n in a.architectures if n not in archs]
    types += [n for n in a.model_types if n not in types]
  return f"{', '.join(archs)} (model_type {', '.join(map(repr, types))})"


def _check_names(hf: dict, where: str) -> None:
  """`architectures` (a list of names) and `model_type` (a name), the fields every adapter's
  claim reads, or a ConfigError naming the field and value."""
  archs, kind = hf.get("architectures"), hf.get("model_type")
  if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str)
                                                               for a in archs)):
    raise ConfigError(f"{where}: architectures = {archs!r} is not valid; valid: a list of "
                      f"architecture names, e.g. [\"LlamaForCausalLM\"]")
  if kind is not None and not isinstance(kind, str):
    raise ConfigError(f"{where}: model_type = {kind!r} is not valid; valid: a string")


def for_hf(hf: dict, where: str = CONFIG_FILE) -> Adapter:
  """The adapter that reads `hf`, or a ConfigError listing the supported architectures."""
  _check_names(hf, where)
  found = [a for a in ADAPTERS.values() if a.claims(hf)]
  # Where several claim a config: a variant's adapter (a subclass) over its base's, then the
  # family named as the config's model_type (a bundled qwen2 over a test's variant).
  found = [a for a in found if not any(b is not a and isinstance(b, type(a)) for b in found)]
  if len(found) > 1 and any(a.arch == hf.get("model_type") for a in found):
    found = [a for a in found if a.arch == hf.get("model_type")]
  if not found:
    archs = hf.get("architectures") or []
    known = {n for a in ADAPTERS.values() for n in a.architectures}
    name = next((a for a in archs if a not in known), archs[0] if archs else
                f"model_type {hf.get('model_type')!r}")
    raise ConfigError(f"{where}: unsupported architecture {name!r}; supported: {supported()}")
  if len(found) > 1:
    raise ConfigError(f"{where}: adapters of several architectures read it: "
                      f"{', '.join(a.arch for a in found)}; narrow their `claims`")
  return found[0]


def for_dir(hf: dict, model, where: str = CONFIG_FILE) -> Adapter:
  """The adapter that reads `hf` for a run of `model`: the model's own if it claims the
  config (so its refusals name the field: llama's `attention_bias`, even where a variant
  would claim it), else the one that does (check_matches then names the other arch)."""
  _check_names(hf, where)
  own = for_model(model)
  return own if own.claims(hf) else for_hf(hf, where)


def for_model(model) -> Adapter:
  """The adapter registered for `model`'s arch, or a ConfigError listing those that are."""
  found = ADAPTERS.get(model.arch)
  if found is None:
    raise ConfigError(f"model {model.name!r} (arch {model.arch!r}) has no Hugging Face "
                      f"adapter; architectures with one: {', '.join(ADAPTERS)} (a family "
                      f"adds its own with @shardlab.hf.adapter.adapter, docs/huggingface.md)")
  return found
