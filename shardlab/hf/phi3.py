"""The Phi-3 family's Hugging Face adapter: `Phi3ForCausalLM` config.json ↔ Phi3Config
(models/phi3.py, arch "phi3").

Phi-3's checkpoint is llama's but for two fused tensors per layer: `self_attn.qkv_proj`
((H + 2K)·E, D: the rows of q, then k, then v) and `mlp.gate_up_proj` (2F × D: gate, then
up), split into llama's params on import and concatenated again on export
(shardlab.hf.adapter.fuse). Its config is Mistral's (`sliding_window`, null: none) plus
LongRoPE (`rope_scaling` or `rope_parameters` of type "longrope", spelled "su" or "yarn" in
older configs, as transformers reads them) with `original_max_position_embeddings` beside it.
What models/phi3.py does not compute is refused by field and value: a partial rotary factor,
biases, dropout, another activation or RoPE type.
"""

import math

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, Mapping, adapter, fuse
from shardlab.hf.llama import LlamaAdapter, block, positive
from shardlab.hf.mistral import MistralAdapter

ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope",
              "yarn": "longrope"}  # transformers' Phi3Config reads "su" and "yarn" as longrope
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096}  # Phi3Config's, where a key is absent
NO_DROPOUT = (0.0, "shardlab has no dropout")


def _factor_list(table: dict, key: str, source: str, where: str) -> str:
  values = table.get(key)
  if not isinstance(values, list) or not all(
      isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
    raise ConfigError(f"{where}: {source}.{key}={values!r} is not supported; valid: a list "
                      f"of head_dim / 2 numbers (LongRoPE)")
  return ",".join(repr(float(v)) for v in values)


def _longrope(hf: dict, table: dict, source: str, where: str) -> dict:
  """The model's LongRoPE fields from a rope table of type longrope: the attention factor
  as transformers derives it when the table has none."""
  original = hf["original_max_position_embeddings"]  # transformers' precedence: top level
  factor = table.get("factor") or hf["max_position_embeddings"] / original
  attention = table.get("attention_factor")
  if attention is None:
    attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
  return {"rope_short_factor": _factor_list(table, "short_factor", source, where),
          "rope_long_factor": _factor_list(table, "long_factor", source, where),
          "rope_attention_factor": float(attention), "rope_original_max_seq_len": original}


def _rope(hf: dict, where: str) -> dict:
  """The model.rope_* fields, resolved as transformers 5's Phi3Config resolves them: a
  non-empty legacy `rope_scaling` replaces `rope_parameters` whole; the theta is that
  table's, else the top-level `rope_theta`, else 10000."""
  source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  table = hf.get(source) or {}
  if not isinstance(table, dict):
    raise ConfigError(f"{where}: {source} = {table!r} is not valid; valid: a table or null")
  theta = table.get("rope_theta", hf.get("rope_theta", 10000.0))
  out = {"rope_theta": positive(theta, f"{source}.rope_theta", where),
         "rope_original_max_seq_len": hf["original_max_position_embeddings"]}
  for prefix, t in (("", hf), (f"{source}.", table)):
    partial = t.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
      raise ConfigError(f"{where}: {prefix}partial_rotary_factor={partial!r} is not supported "
                        f"(RoPE turns every dim of a head); valid: 1.0")
  kind = table.get("rope_type", table.get("type", "default"))
  if not isinstance(kind, str) or kind not in ROPE_TYPES:
    raise ConfigError(f"{where}: unsupported {source} type {kind!r}; shardlab's Phi-3 "
                      f"supports {', '.join(map(repr, ROPE_TYPES))}")
  if ROPE_TYPES[kind] == "longrope":
    out.update(_longrope(hf, table, source, where))
  return out


@adapter("phi3")
class Phi3Adapter(MistralAdapter):
  label = "Phi-3"
  architectures = ("Phi3ForCausalLM",)
  model_types = ("phi3",)
  fields = {**MistralAdapter.fields, "rope_scaling": "rope_scaling",
            "rope_short_factor": "rope_scaling.short_factor",
            "rope_long_factor": "rope_scaling.long_factor",
            "rope_attention_factor": "rope_scaling.attention_factor",
            "rope_original_max_seq_len": "original_max_position_embeddings"}
  requires = {**LlamaAdapter.requires, "resid_pdrop": NO_DROPOUT, "embd_pdrop": NO_DROPOUT}

  def model_fields(self, hf: dict, name: str, where: str = CONFIG_FILE) -> dict:
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if not (k in DEFAULTS and v is None)}}
    rope = _rope(hf, where)
    # llama's reads the rope tables too: it would refuse longrope, which is read above.
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    return {**super().model_fields(plain, name, where), **rope}

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' Phi3ForCausalLM loads."""
    rope = {"rope_type": "longrope" if m.longrope else "default", "rope_theta": m.rope_theta,
            "partial_rotary_factor": 1.0}
    if m.longrope:
      rope.update(short_factor=list(m.longrope[0]), long_factor=list(m.longrope[1]),
                  attention_factor=m.rope_attention_factor,
                  original_max_position_embeddings=m.rope_original_max_seq_len)
    return {**super().to_hf(m, dtype), "rope_parameters": rope,
            "rope_scaling": rope if m.longrope else None,
            "original_max_position_embeddings": m.rope_original_max_seq_len}

  def attention_tensors(self, m) -> list[Mapping]:
    """llama's, q, k and v read from (written to) the one fused qkv_proj."""
    qkv = "self_attn.qkv_proj"
    return [block("attn_norm.scale", "input_layernorm", ("D",), "D"),
            *fuse(block("attn.q_DxHxE", qkv, ("HE", "D"), "DHE"),
                  block("attn.k_DxKxE", qkv, ("KE", "D"), "DKE"),
                  block("attn.v_DxKxE", qkv, ("KE", "D"), "DKE")),
            block("attn.o_HxExD", "self_attn.o_proj", ("D", "HE"), "HED")]

  def mlp_tensors(self, m) -> list[Mapping]:
    """llama's, gate and up in the one fused gate_up_proj (gate's rows first)."""
    return [*fuse(block("mlp.gate_DxF", "mlp.gate_up_proj", ("F", "D"), "DF"),
                  block("mlp.up_DxF", "mlp.gate_up_proj", ("F", "D"), "DF")),
            block("mlp.down_FxD", "mlp.down_proj", ("D", "F"), "FD")]
