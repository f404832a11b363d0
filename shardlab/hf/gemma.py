"""The Gemma 2 and Gemma 3 (text) Hugging Face adapters: `Gemma2ForCausalLM` ↔ Gemma2Config
and `Gemma3ForCausalLM` (model_type gemma3_text) ↔ Gemma3Config (models/gemma_config.py).

Tensors: llama's projections, four norms a layer (input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm; HF stores w of the (1 + w) scale, as
shardlab does) and Gemma 3's `self_attn.q_norm` / `k_norm` (head_dim each). The config's
`layer_types` must repeat one period that ends in its only global layer (transformers'
default pattern, Gemma 2: local, global; Gemma 3: five local, one global), possibly cut
short at the end; another layout is refused naming `layer_types`. Gemma 3's RoPE: the global
layers' `rope_theta` with rope_scaling linear (or llama3), the local layers'
`rope_local_base_freq` unscaled (transformers 5 spells both in `rope_parameters`, per layer
type). Refused by field and value: another activation than gelu_pytorch_tanh, attention
bias, dropout, bidirectional attention, a scaled local RoPE, any rope type llama's adapter
does not compute. Gemma3ForConditionalGeneration (the multimodal checkpoints, whose text
weights sit under `language_model.`) is not read: convert its text part to a
Gemma3ForCausalLM first.
"""

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, Mapping, adapter
from shardlab.hf.llama import LlamaAdapter, block

GELU = ("gelu_pytorch_tanh", "the MLP is GeGLU with tanh-approximate GELU")
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def _pattern(hf: dict, n_layers: int, default: int, where: str) -> int:
  """The period P of `layer_types` (layer i global iff (i + 1) % P == 0)."""
  types = hf.get("layer_types")
  if not types:
    return int(hf.get("sliding_window_pattern") or default)
  period = types.index(GLOBAL) + 1 if GLOBAL in types else n_layers + 1
  expected = [LOCAL if (i + 1) % period else GLOBAL for i in range(n_layers)]
  if list(types) != expected:
    raise ConfigError(f"{where}: layer_types={types!r} is not supported: shardlab's Gemma "
                      f"needs one repeated period ending in its global layer; valid here: "
                      f"{expected!r}")
  return period


@adapter("gemma2")
class Gemma2Adapter(LlamaAdapter):
  label = "Gemma 2"
  architectures = ("Gemma2ForCausalLM",)
  model_types = ("gemma2",)
  default_pattern = 2
  fields = {**LlamaAdapter.fields, "query_pre_attn_scalar": "query_pre_attn_scalar",
            "sliding_window": "sliding_window", "sliding_window_pattern": "layer_types",
            "attn_softcap": "attn_logit_softcapping",
            "final_softcap": "final_logit_softcapping"}
  requires = {"hidden_activation": GELU, "hidden_act": GELU,
              "attention_bias": LlamaAdapter.requires["attention_bias"],
              "attention_dropout": LlamaAdapter.requires["attention_dropout"],
              "use_bidirectional_attention": (False, "attention is causal")}

  def model_fields(self, hf: dict, name: str, where: str = CONFIG_FILE) -> dict:
    window = hf.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
      raise ConfigError(f"{where}: sliding_window={window!r} is not supported; valid: null "
                        f"or an int >= 1 (keys a local layer's query sees)")
    out = super().model_fields(hf, name, where)
    caps = {f: hf.get(k) for f, k in (("attn_softcap", "attn_logit_softcapping"),
                                      ("final_softcap", "final_logit_softcapping"))}
    return {**out, "sliding_window": window or 0,
            "sliding_window_pattern": _pattern(hf, out["n_layers"], self.default_pattern,
                                               where),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            **{f: float(v or 0.0) for f, v in caps.items()},
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True))}

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' Gemma2ForCausalLM (or Gemma3ForCausalLM) loads."""
    out = super().to_hf(m, dtype)
    out.pop("hidden_act")  # llama's "silu"; Gemma's config spells it hidden_activation
    scalar = m.query_pre_attn_scalar  # transformers 5's strict config takes an int
    return {**out, "hidden_activation": GELU[0],
            "query_pre_attn_scalar": int(scalar) if scalar.is_integer() else scalar,
            "sliding_window": m.sliding_window or None,
            "layer_types": [LOCAL if w else GLOBAL for w in m.windows],
            "attn_logit_softcapping": m.attn_softcap or None,
            "final_logit_softcapping": m.final_softcap or None}

  def tensors(self, m) -> list[Mapping]:
    """Every param of models/gemma.py, in HF's usual tensor order."""
    norm = lambda param, hf: block(f"{param}.scale", hf, ("D",), "D")
    out = [Mapping(("embed_VxD",), "model.embed_tokens.weight", ("V", "D"), "VD")]
    out += self.attention_tensors(m)
    out += [norm("post_attn_norm", "post_attention_layernorm"),
            norm("mlp_norm", "pre_feedforward_layernorm")]
    out += self.mlp_tensors(m)
    out.append(norm("post_mlp_norm", "post_feedforward_layernorm"))
    out.append(Mapping(("final_norm", "scale"), "model.norm.weight", ("D",), "D"))
    if not m.tie_embeddings:
      out.append(Mapping(("head_DxV",), "lm_head.weight", ("V", "D"), "DV"))
    return out


@adapter("gemma3")
class Gemma3Adapter(Gemma2Adapter):
  label = "Gemma 3"
  architectures = ("Gemma3ForCausalLM",)
  model_types = ("gemma3_text",)
  default_pattern = 6
  fields = {**Gemma2Adapter.fields, "rope_local_theta": "rope_local_base_freq"}

  def model_fields(self, hf: dict, name: str, where: str = CONFIG_FILE) -> dict:
    if hf.get("attn_logit_softcapping") is not None:  # transformers' Gemma3 never applies it
      raise ConfigError(f"{where}: attn_logit_softcapping={hf['attn_logit_softcapping']!r} "
                        f"is not supported (transformers' Gemma 3 attention ignores it); "
                        f"valid: null")
    params = hf.get("rope_parameters") or {}
    local = float(hf.get("rope_local_base_freq", 10000.0))
    if GLOBAL in params or LOCAL in params:  # transformers 5: one table per layer type
      own = params.get(LOCAL) or {}
      kind = own.get("rope_type", "default")
      if kind != "default":
        raise ConfigError(f"{where}: rope_parameters.{LOCAL}.rope_type={kind!r} is not "
                          f"supported (local layers' RoPE is unscaled); valid: 'default'")
      local = float(own.get("rope_theta", local))
      hf = {**hf, "rope_parameters": params.get(GLOBAL) or {}}
    return {**super().model_fields(hf, name, where), "rope_local_theta": local}

  def to_hf(self, m, dtype: str) -> dict:
    out = super().to_hf(m, dtype)
    return {**out, "rope_local_base_freq": m.rope_local_theta,
            "rope_parameters": {GLOBAL: out["rope_parameters"],
                                LOCAL: {"rope_type": "default",
                                        "rope_theta": m.rope_local_theta}}}

  def attention_tensors(self, m) -> list[Mapping]:
    """Gemma 2's, plus the q and k head norms (head_dim each)."""
    return super().attention_tensors(m) + [
        block(f"attn.{t}_norm.scale", f"self_attn.{t}_norm", ("E",), "E") for t in "qk"]
