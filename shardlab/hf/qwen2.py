"""The Qwen2 / Qwen2.5 family's Hugging Face adapter: `Qwen2ForCausalLM` config.json ↔
models/qwen2.py (arch "qwen2").

Qwen2 is llama plus `self_attn.{q,k,v}_proj.bias` (o_proj has none; its config has no
*_bias fields, the biases are fixed). Sliding-window attention is refused: `use_sliding_window:
true`, or `layer_types` naming a sliding layer (transformers 5 writes one per layer); every
released Qwen2/2.5 checkpoint has it off. Anything else llama's adapter refuses (another
activation, dropout, an unknown RoPE type such as "yarn") is refused here too, by field and
value.
"""

from shardlab.errors import ConfigError
from shardlab.hf.adapter import Mapping, adapter
from shardlab.hf.llama import LlamaAdapter, block

FULL = "full_attention"
NO_WINDOWS = {"use_sliding_window": (False, "attention is full causal")}


def refuse_windows(hf: dict, where: str) -> None:
  """A ConfigError naming the first sliding layer of `layer_types`, if any."""
  windowed = [t for t in hf.get("layer_types") or [] if t != FULL]
  if windowed:
    raise ConfigError(f"{where}: layer_types holds {windowed[0]!r}, which is not supported "
                      f"(attention is full causal); valid: {FULL!r}")


def full_attention(m) -> dict:
  """The config.json fields that say every layer attends fully."""
  return {"use_sliding_window": False, "sliding_window": None,
          "max_window_layers": m.n_layers, "layer_types": [FULL] * m.n_layers}


class FullAttentionAdapter(LlamaAdapter):
  """Llama's adapter for a family whose config can ask for sliding windows (Qwen2, Qwen3):
  refused on import, written off on export."""

  def model_fields(self, hf: dict, name: str, where: str) -> dict:
    refuse_windows(hf, where)
    return super().model_fields(hf, name, where)

  def to_hf(self, m, dtype: str) -> dict:
    return {**super().to_hf(m, dtype), **full_attention(m)}


@adapter("qwen2")
class Qwen2Adapter(FullAttentionAdapter):
  label = "Qwen2"
  architectures = ("Qwen2ForCausalLM",)
  model_types = ("qwen2",)
  requires = {"hidden_act": LlamaAdapter.requires["hidden_act"],
              "attention_dropout": LlamaAdapter.requires["attention_dropout"], **NO_WINDOWS}

  def attention_tensors(self, m) -> list[Mapping]:
    """llama's, plus the q, k and v biases (H·E or K·E, head-major as the weights' rows)."""
    return super().attention_tensors(m) + [
        block(f"attn.{t}_bias_{h}xE", f"self_attn.{t}_proj", (h + "E",), h + "E", kind="bias")
        for t, h in (("q", "H"), ("k", "K"), ("v", "K"))]
