"""Hugging Face Mixtral ↔ shardlab's mixture of experts (models/moe.py, arch "moe").

Mixtral is llama with every MLP replaced by `block_sparse_moe`: a router `gate` (E×D) and
experts `experts.{j}.w1` (gate, F×D), `w3` (up) and `w2` (down, D×F), the layout of the
released checkpoints (transformers 5 fuses them on load and splits them again on save).
The config maps through llama's (shardlab/hf/config.py) plus the expert fields; the expert
weights are read and written as one virtual tensor per layer and param, E × (HF shape),
whose name holds `*` for the expert index (ExpertReader; shardlab/hf/weights.py expands it
on export).
"""

import dataclasses

import numpy as np

from shardlab.errors import ConfigError
from shardlab.hf import config as hf_config
from shardlab.models import protocol
from shardlab.models.moe_config import MoEConfig

ARCHITECTURE = "MixtralForCausalLM"
EXPERT = "*"
MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
            "output_router_logits", "router_jitter_noise", "sliding_window")


def is_mixtral(hf: dict) -> bool:
  return ARCHITECTURE in (hf.get("architectures") or []) or hf.get("model_type") == "mixtral"


def to_model(hf: dict, name: str = "hf", where: str = hf_config.CONFIG_FILE):
  """The model config of a Llama or Mixtral config.json."""
  if not is_mixtral(hf):
    return hf_config.to_model(hf, name, where)
  if hf.get("router_jitter_noise") not in (None, 0, 0.0):
    raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']!r} is not "
                      f"supported (shardlab's router has no noise); valid: 0.0")
  if hf.get("sliding_window") is not None:
    raise ConfigError(f"{where}: sliding_window={hf['sliding_window']!r} is not supported "
                      f"(attention is full causal); valid: null")
  llama_hf = {k: v for k, v in hf.items() if k not in MOE_KEYS}
  llama_hf.update(architectures=list(hf_config.SUPPORTED_ARCHITECTURES), model_type="llama")
  dense = hf_config.to_model(llama_hf, name, where)
  fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
  return MoEConfig(**{**fields, "arch": "moe"}, n_experts=hf["num_local_experts"],
                   experts_per_token=hf.get("num_experts_per_tok", 2),
                   router_aux_loss=float(hf.get("router_aux_loss_coef", 0.02)))


def from_model(m, dtype: str) -> dict:
  """A config.json that transformers' LlamaForCausalLM or MixtralForCausalLM loads."""
  out = hf_config.from_model(m, dtype)
  if not protocol.has(m, "n_experts"):  # a dense llama
    return out
  for key in ("mlp_bias", "attention_bias"):
    out.pop(key)
  return {**out, "architectures": [ARCHITECTURE], "model_type": "mixtral",
          "num_local_experts": m.n_experts, "num_experts_per_tok": m.experts_per_token,
          "router_aux_loss_coef": m.router_aux_loss, "output_router_logits": False,
          "router_jitter_noise": 0.0, "sliding_window": None}


def check_matches(hf_model, model, hf_dir) -> None:
  hf_config.check_matches(hf_model, model, hf_dir)
  fields = ("arch", "n_experts", "experts_per_token")
  diffs = [f"  model.{f} = {getattr(model, f, None)!r}, but the HF config's is "
           f"{getattr(hf_model, f, None)!r}" for f in fields
           if getattr(model, f, None) != getattr(hf_model, f, None)]
  if diffs:
    raise ConfigError(f"--model {model.name!r} does not match the Hugging Face config in "
                      f"{hf_dir}:\n" + "\n".join(diffs))


@dataclasses.dataclass(frozen=True)
class _Virtual:
  shape: tuple[int, ...]
  file: object


class ExpertReader:
  """A hf_files.Reader whose per-expert tensors (`...experts.{j}.w1.weight`) also read as one
  stacked tensor `...experts.*.w1.weight` of shape E × (HF shape)."""

  def __init__(self, reader, n_experts: int):
    self.reader, self.n = reader, n_experts
    self.tensors = {}
    for name, info in reader.tensors.items():
      parts = name.split(".")
      if "experts" in parts and parts.index("experts") + 1 < len(parts):
        at = parts.index("experts") + 1
        if parts[at].isdigit():
          virtual = ".".join(parts[:at] + [EXPERT] + parts[at + 1:])
          if all(virtual.replace(EXPERT, str(j)) in reader.tensors for j in range(n_experts)):
            self.tensors[virtual] = _Virtual((n_experts, *info.shape), info.file)
            continue
      self.tensors[name] = info

  def read(self, name: str, box=None) -> np.ndarray:
    if EXPERT not in name:
      return self.reader.read(name, box)
    experts = range(self.n) if box is None else range(*box[0].indices(self.n)[:2])
    rest = None if box is None else tuple(box[1:])
    return np.stack([self.reader.read(name.replace(EXPERT, str(j)), rest) for j in experts])
