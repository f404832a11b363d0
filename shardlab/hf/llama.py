"""The Llama family's Hugging Face adapter: `LlamaForCausalLM` config.json ↔ LlamaConfig, and
the tensor table of models/llama.py.

Only what models/llama.py computes is accepted: SiLU gated MLP, no biases, no dropout, RoPE
plain or scaled (rope_type linear or llama3, models/rope.py). Anything else is an error naming
the field, never a silently different model. No layout change beyond transposes is needed:
models/llama.py uses HF's rotate-half RoPE and HF's repeat_kv head grouping (query head i
reads kv head i // (H / K)). Variants (a bias, other MLPs) subclass LlamaAdapter.
"""

import math

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, LAYER, Adapter, Mapping, adapter

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def block(param: str, hf: str, hf_dims, dims, kind: str = "weight") -> Mapping:
  """A per-layer param of `blocks` ↔ model.layers.{i}.<hf>.<kind>."""
  return Mapping(("blocks",) + tuple(param.split(".")), f"model.layers.{LAYER}.{hf}.{kind}",
                 hf_dims, dims)


def _rope(hf: dict, where: str, default_theta: float = 10000.0) -> dict:
  """The model.rope_* fields, resolved as transformers 5 resolves them
  (PreTrainedConfig.convert_rope_params_to_dict): a non-empty legacy `rope_scaling` table
  replaces `rope_parameters` whole; the theta is that table's own `rope_theta`, else the
  top-level `rope_theta`, else the family's default (Mixtral's is 1e6)."""
  source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  table = hf.get(source) or {}
  if not isinstance(table, dict):
    raise ConfigError(f"{where}: {source} = {table!r} is not valid; valid: a table (rope_type, "
                      f"rope_theta, factor, ...) or null")
  theta = table.get("rope_theta", hf.get("rope_theta", default_theta))
  out = {"rope_theta": positive(theta, f"{source}.rope_theta", where)}
  kind = table.get("rope_type", table.get("type", "default"))
  if not isinstance(kind, str) or kind not in ROPE_TYPES:
    raise ConfigError(f"{where}: unsupported {source} type {kind!r}; shardlab's Llama "
                      f"supports {', '.join(map(repr, ROPE_TYPES))}")
  if kind == "default":
    return out
  try:
    read = lambda key: positive(table[key], f"{source}.{key}", where)
    out.update(rope_scaling=ROPE_TYPES[kind], rope_factor=read("factor"))
    if kind == "llama3":
      out.update(rope_low_freq_factor=read("low_freq_factor"),
                 rope_high_freq_factor=read("high_freq_factor"),
                 rope_original_max_seq_len=count(table["original_max_position_embeddings"],
                                                 f"{source}.original_max_position_embeddings",
                                                 where))
  except KeyError as e:
    raise ConfigError(f"{where}: {source} of type {kind!r} lacks {e.args[0]!r}") from None
  return out


def positive(value, field: str, where: str) -> float:
  """A config.json number that must be finite and > 0, or a ConfigError naming it."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) if isinstance(value, float) else value < 1e300) or value <= 0:
    raise ConfigError(f"{where}: {field} = {value!r} is not valid; valid: a finite number > 0")
  return float(value)


def count(value, field: str, where: str, low: int = 1) -> int:
  """A config.json integer that must be >= `low`, or a ConfigError naming it."""
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ConfigError(f"{where}: {field} = {value!r} is not valid; valid: an integer >= {low}")
  return value


def _rope_scaling(m) -> dict | None:
  if m.rope_scaling == "none":
    return None
  kind = {v: k for k, v in ROPE_TYPES.items()}[m.rope_scaling]
  out = {"rope_type": kind, "factor": m.rope_factor}
  if kind == "llama3":
    out.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
               original_max_position_embeddings=m.rope_original_max_seq_len)
  return out


def _token_ids(hf: dict, where: str) -> dict:
  """bos/eos/pad ids as LlamaConfig holds them (eos may be a list; -1: no pad)."""
  eos = hf.get("eos_token_id", 2)
  eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
  out = {"bos_token_id": hf.get("bos_token_id"), "pad_token_id": hf.get("pad_token_id")}
  if not all(isinstance(i, int) for i in eos) or not all(
      v is None or isinstance(v, int) for v in out.values()):
    raise ConfigError(f"{where}: bos_token_id, eos_token_id and pad_token_id must be "
                      f"integers (eos may be a list), got {out['bos_token_id']!r}, {eos!r} "
                      f"and {out['pad_token_id']!r}")
  return {"bos_token_id": 1 if out["bos_token_id"] is None else out["bos_token_id"],
          "pad_token_id": -1 if out["pad_token_id"] is None else out["pad_token_id"],
          "eos_token_ids": ",".join(map(str, eos))}


def token_ids(m) -> dict:
  """bos/eos/pad as config.json and generation_config.json spell them."""
  eos = list(m.eos_ids)
  return {"bos_token_id": m.bos_token_id,
          "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
          "pad_token_id": None if m.pad_token_id < 0 else m.pad_token_id}


@adapter("llama")
class LlamaAdapter(Adapter):
  label = "Llama"
  architectures = ("LlamaForCausalLM",)
  model_types = ("llama",)
  default_theta = 10000.0  # transformers' LlamaConfig.default_theta: no rope_theta anywhere
  fields = {"vocab_size": "vocab_size", "d_model": "hidden_size",
            "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
            "mlp_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
            "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
            "rope_scaling": "rope_scaling.rope_type", "rope_factor": "rope_scaling.factor",
            "rope_low_freq_factor": "rope_scaling.low_freq_factor",
            "rope_high_freq_factor": "rope_scaling.high_freq_factor",
            "rope_original_max_seq_len": "rope_scaling.original_max_position_embeddings"}
  # config.json field -> (the one value the model computes, why): anything else is refused.
  requires = {"hidden_act": ("silu", "the MLP is SwiGLU"),
              "attention_bias": (False, "projections have no bias"),
              "mlp_bias": (False, "projections have no bias"),
              "attention_dropout": (0.0, "shardlab has no dropout")}

  def to_model(self, hf: dict, name: str = "hf", where: str = CONFIG_FILE):
    """The model config of a Llama config.json, or a ConfigError naming what it cannot hold."""
    if not self.claims(hf):
      archs = hf.get("architectures") or []
      found = next((a for a in archs if a not in self.architectures),
                   f"model_type {hf.get('model_type')!r}")
      raise ConfigError(f"{where}: unsupported architecture {found!r}; supported: "
                        f"{', '.join(self.architectures)} (model_type "
                        f"{', '.join(map(repr, self.model_types))})")
    return self.config_class(**self.model_fields(hf, name, where))

  def model_fields(self, hf: dict, name: str, where: str) -> dict:
    """The LlamaConfig fields of `hf`, after the refusals."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
      raise ConfigError(f"{where} lacks {', '.join(missing)}; a {self.label} config needs "
                        f"{', '.join(REQUIRED)}")
    for key, (expected, why) in self.requires.items():
      if key in hf and hf[key] not in (expected, None):
        raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({why}); "
                          f"valid: {expected!r}")
    for key in REQUIRED:
      count(hf[key], key, where)
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
      if hf.get(key) is not None:  # null: derived or defaulted, as transformers does
        count(hf[key], key, where)
    if hf.get("rms_norm_eps") is not None:
      positive(hf["rms_norm_eps"], "rms_norm_eps", where)
    heads = hf["num_attention_heads"]
    return dict(
        name=name, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"], **_rope(hf, where, self.default_theta),
        **_token_ids(hf, where),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 2048))

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' LlamaForCausalLM.from_pretrained loads (both the
    transformers 4 and 5 spellings of RoPE are written)."""
    return {
        "architectures": [self.architectures[0]], "model_type": self.model_types[0],
        "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "intermediate_size": m.mlp_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "max_position_embeddings": m.max_seq_len, "rope_theta": m.rope_theta,
        "rope_scaling": _rope_scaling(m),
        "rope_parameters": {"rope_theta": m.rope_theta,
                            **(_rope_scaling(m) or {"rope_type": "default"})},
        "tie_word_embeddings": m.tie_embeddings,
        **{key: expected for key, (expected, _) in self.requires.items()
           if key != "hidden_act"},
        "torch_dtype": dtype, "dtype": dtype, **token_ids(m),
    }

  def generation_config(self, m) -> dict:
    return {"_from_model_config": True, **token_ids(m)}

  def tensors(self, m) -> list[Mapping]:
    """Every param of models/llama.py, in HF's usual tensor order."""
    out = [Mapping(("embed_VxD",), "model.embed_tokens.weight", ("V", "D"), "VD")]
    out += self.attention_tensors(m)
    out.append(block("mlp_norm.scale", "post_attention_layernorm", ("D",), "D"))
    out += self.mlp_tensors(m)
    out.append(Mapping(("final_norm", "scale"), "model.norm.weight", ("D",), "D"))
    if not m.tie_embeddings:
      out.append(Mapping(("head_DxV",), "lm_head.weight", ("V", "D"), "DV"))
    return out

  def attention_tensors(self, m) -> list[Mapping]:
    return [block("attn_norm.scale", "input_layernorm", ("D",), "D"),
            block("attn.q_DxHxE", "self_attn.q_proj", ("HE", "D"), "DHE"),
            block("attn.k_DxKxE", "self_attn.k_proj", ("KE", "D"), "DKE"),
            block("attn.v_DxKxE", "self_attn.v_proj", ("KE", "D"), "DKE"),
            block("attn.o_HxExD", "self_attn.o_proj", ("D", "HE"), "HED")]

  def mlp_tensors(self, m) -> list[Mapping]:
    return [block("mlp.gate_DxF", "mlp.gate_proj", ("F", "D"), "DF"),
            block("mlp.up_DxF", "mlp.up_proj", ("F", "D"), "DF"),
            block("mlp.down_FxD", "mlp.down_proj", ("D", "F"), "FD")]

  def unread(self, m) -> set[str]:
    return {"lm_head.weight"} if m.tie_embeddings else set()
