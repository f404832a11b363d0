"""Hugging Face Llama `config.json` ↔ shardlab LlamaConfig.

Only what models/llama.py computes is accepted: SiLU gated MLP, no biases, no dropout, RoPE
plain or scaled (rope_type linear or llama3, models/rope.py). Anything else is an error naming the field, never a silently different
model.
"""

import dataclasses
import json
from pathlib import Path

from shardlab.models.llama_config import LlamaConfig
from shardlab.errors import ConfigError

CONFIG_FILE = "config.json"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
# Fields that decide what the model computes; `name` and `max_seq_len` do not.
COMPUTE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "mlp_dim", "tie_embeddings", "rope_theta", "norm_eps", "rope_scaling",
                  "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_original_max_seq_len")
HF_NAMES = {"vocab_size": "vocab_size", "d_model": "hidden_size",
            "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
            "mlp_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
            "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
            "max_seq_len": "max_position_embeddings", "rope_scaling": "rope_scaling.rope_type",
            "rope_factor": "rope_scaling.factor",
            "rope_low_freq_factor": "rope_scaling.low_freq_factor",
            "rope_high_freq_factor": "rope_scaling.high_freq_factor",
            "rope_original_max_seq_len": "rope_scaling.original_max_position_embeddings"}


def read(hf_dir: str | Path) -> dict:
  path = Path(hf_dir) / CONFIG_FILE
  if not Path(hf_dir).is_dir():
    raise ConfigError(f"Hugging Face directory {str(hf_dir)!r} does not exist")
  if not path.exists():
    raise ConfigError(f"{hf_dir} has no {CONFIG_FILE}; expected a Hugging Face model "
                      f"directory (config.json + model.safetensors)")
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"{path} must hold a JSON object")
  return data


ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _rope(hf: dict, where: str) -> dict:
  """The model.rope_* fields from either layout: top-level `rope_theta` + `rope_scaling`
  (transformers 4), or `rope_parameters` (transformers 5)."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
  for source, table in (("rope_parameters", params), ("rope_scaling", scaling)):
    kind = table.get("rope_type", table.get("type", "default"))
    if kind not in ROPE_TYPES:
      raise ConfigError(f"{where}: unsupported {source} type {kind!r}; shardlab's Llama "
                        f"supports {', '.join(map(repr, ROPE_TYPES))}")
    if kind == "default":
      continue
    try:
      out.update(rope_scaling=ROPE_TYPES[kind], rope_factor=float(table["factor"]))
      if kind == "llama3":
        out.update(rope_low_freq_factor=float(table["low_freq_factor"]),
                   rope_high_freq_factor=float(table["high_freq_factor"]),
                   rope_original_max_seq_len=int(table["original_max_position_embeddings"]))
    except KeyError as e:
      raise ConfigError(f"{where}: {source} of type {kind!r} lacks {e.args[0]!r}") from None
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


def _require(hf: dict, key: str, expected, where: str, why: str) -> None:
  if key in hf and hf[key] not in (expected, None):
    raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({why}); "
                      f"valid: {expected!r}")


def to_model(hf: dict, name: str = "hf", where: str = CONFIG_FILE) -> LlamaConfig:
  """The LlamaConfig of a Llama config.json, or a ConfigError naming what it cannot hold."""
  archs = hf.get("architectures") or []
  unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
  if unsupported or (not archs and hf.get("model_type") != "llama"):
    found = unsupported[0] if unsupported else f"model_type {hf.get('model_type')!r}"
    raise ConfigError(f"{where}: unsupported architecture {found!r}; supported: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type 'llama')")
  missing = [k for k in REQUIRED if k not in hf]
  if missing:
    raise ConfigError(f"{where} lacks {', '.join(missing)}; a Llama config needs "
                      f"{', '.join(REQUIRED)}")
  _require(hf, "hidden_act", "silu", where, "the MLP is SwiGLU")
  _require(hf, "attention_bias", False, where, "projections have no bias")
  _require(hf, "mlp_bias", False, where, "projections have no bias")
  _require(hf, "attention_dropout", 0.0, where, "shardlab has no dropout")
  heads = hf["num_attention_heads"]
  return LlamaConfig(
      name=name, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"], n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], **_rope(hf, where), **_token_ids(hf, where),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=hf.get("max_position_embeddings", 2048))


def from_model(m: LlamaConfig, dtype: str) -> dict:
  """A config.json that transformers' LlamaForCausalLM.from_pretrained loads (both the
  transformers 4 and 5 spellings of RoPE are written)."""
  return {
      "architectures": list(SUPPORTED_ARCHITECTURES), "model_type": "llama",
      "vocab_size": m.vocab_size, "hidden_size": m.d_model,
      "intermediate_size": m.mlp_dim, "num_hidden_layers": m.n_layers,
      "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
      "head_dim": m.head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
      "max_position_embeddings": m.max_seq_len, "rope_theta": m.rope_theta,
      "rope_scaling": _rope_scaling(m),
      "rope_parameters": {"rope_theta": m.rope_theta,
                          **(_rope_scaling(m) or {"rope_type": "default"})},
      "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "attention_dropout": 0.0, "torch_dtype": dtype, "dtype": dtype,
      **token_ids(m),
  }


def token_ids(m: LlamaConfig) -> dict:
  """bos/eos/pad as config.json and generation_config.json spell them."""
  eos = list(m.eos_ids)
  return {"bos_token_id": m.bos_token_id,
          "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
          "pad_token_id": None if m.pad_token_id < 0 else m.pad_token_id}


def generation_config(m: LlamaConfig) -> dict:
  return {"_from_model_config": True, **token_ids(m)}


def _rope_scaling(m: LlamaConfig) -> dict | None:
  if m.rope_scaling == "none":
    return None
  kind = {v: k for k, v in ROPE_TYPES.items()}[m.rope_scaling]
  out = {"rope_type": kind, "factor": m.rope_factor}
  if kind == "llama3":
    out.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
               original_max_position_embeddings=m.rope_original_max_seq_len)
  return out


def check_matches(hf_model: LlamaConfig, model: LlamaConfig, hf_dir) -> None:
  """Raises unless `model` (the run's --model) computes what the HF config describes."""
  diffs = [f"  model.{f} = {getattr(model, f)!r}, but {HF_NAMES[f]} = "
           f"{getattr(hf_model, f)!r}" for f in COMPUTE_FIELDS
           if getattr(model, f) != getattr(hf_model, f)]
  if diffs:
    raise ConfigError(
        f"--model {model.name!r} does not match the Hugging Face config in {hf_dir}:\n" +
        "\n".join(diffs) + "\nuse a model TOML with the HF shapes (`shardlab convert "
        f"hf-config {hf_dir} > model.toml`, then --model model.toml)")


def to_toml(m: LlamaConfig) -> str:
  lines = ["# From a Hugging Face Llama config.json (shardlab convert hf-config)."]
  for f in dataclasses.fields(m):
    value = getattr(m, f.name)
    if f.name == "name":
      continue
    text = (str(value).lower() if isinstance(value, bool) else json.dumps(value)
            if isinstance(value, str) else repr(value) if isinstance(value, float)
            else str(value))
    lines.append(f"{f.name} = {text}")
  return "\n".join(lines) + "\n"
