"""The Hugging Face adapter of the Llama variant with a q/k/v bias (llama_qkv_bias.py): its
one file beside the model's, the exit test of the adapter contract (tests/test_hf_adapters.py).

On the HF side the variant is transformers' `Qwen2ForCausalLM` without sliding windows: Llama
plus `self_attn.{q,k,v}_proj.bias` and no bias on o_proj. (Llama with `attention_bias: true`
is not it: that biases o_proj too, which the variant does not have.) Importing this file
registers the adapter; the model file must be imported too (its arch's config class is what
`to_model` builds). shardlab bundles that family too (models/qwen2.py, shardlab/hf/qwen2.py):
where both claim a config, the lookup picks the family named as its model_type, qwen2
(shardlab/hf/families.py for_hf), so this adapter reads a Qwen2 directory only for a run of
the variant (`for_dir`: the run's own adapter first) or when called by name.
"""

from shardlab.errors import ConfigError
from shardlab.hf.adapter import adapter
from shardlab.hf.llama import LlamaAdapter, block

FULL = "full_attention"


@adapter("llama-qkv-bias")
class QKVBiasAdapter(LlamaAdapter):
  label = "Llama (q/k/v bias)"
  architectures = ("Qwen2ForCausalLM",)
  model_types = ("qwen2",)
  # Qwen2's config has no *_bias fields (its biases are fixed), and windows llama has not.
  requires = {"hidden_act": LlamaAdapter.requires["hidden_act"],
              "attention_dropout": LlamaAdapter.requires["attention_dropout"],
              "use_sliding_window": (False, "attention is full causal")}

  def model_fields(self, hf: dict, name: str, where: str) -> dict:
    windowed = [t for t in hf.get("layer_types") or [] if t != FULL]
    if windowed:
      raise ConfigError(f"{where}: layer_types holds {windowed[0]!r}, which is not supported "
                        f"(attention is full causal); valid: {FULL!r}")
    return super().model_fields(hf, name, where)

  def to_hf(self, m, dtype: str) -> dict:
    return {**super().to_hf(m, dtype), "sliding_window": None,
            "max_window_layers": m.n_layers, "layer_types": [FULL] * m.n_layers}

  def attention_tensors(self, m):
    """llama's, plus the q, k and v biases (H·E or K·E, head-major as the weights' rows)."""
    return super().attention_tensors(m) + [
        block(f"attn.{t}_bias_{h}xE", f"self_attn.{t}_proj", (h + "E",), h + "E", kind="bias")
        for t, h in (("q", "H"), ("k", "K"), ("v", "K"))]
