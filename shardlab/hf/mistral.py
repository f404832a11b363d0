"""The Mistral family's Hugging Face adapter: `MistralForCausalLM` config.json ↔ MistralConfig
(models/mistral.py, arch "mistral").

Mistral's checkpoint is llama's, tensor for tensor; its config adds `sliding_window` (null:
full causal attention, as Mistral-7B-v0.3 has it) and has no `attention_bias` or `mlp_bias`.
What llama's adapter refuses is refused here too (another `hidden_act`, dropout, a rope type
other than default, linear or llama3), by field and value.
"""

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, adapter
from shardlab.hf.llama import LlamaAdapter


@adapter("mistral")
class MistralAdapter(LlamaAdapter):
  label = "Mistral"
  architectures = ("MistralForCausalLM",)
  model_types = ("mistral",)
  fields = {**LlamaAdapter.fields, "sliding_window": "sliding_window"}

  def model_fields(self, hf: dict, name: str, where: str = CONFIG_FILE) -> dict:
    window = hf.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
      raise ConfigError(f"{where}: sliding_window={window!r} is not supported; valid: null "
                        f"(full causal attention) or an int >= 1 (keys a query sees)")
    return {**super().model_fields(hf, name, where), "sliding_window": window or 0}

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' MistralForCausalLM loads."""
    out = super().to_hf(m, dtype)
    for key in ("mlp_bias", "attention_bias"):  # Mistral's config has neither
      out.pop(key)
    return {**out, "sliding_window": m.sliding_window or None}
