"""The Mixtral family's Hugging Face adapter: `MixtralForCausalLM` ↔ shardlab's mixture of
experts (models/moe.py, arch "moe").

Mixtral is llama with every MLP replaced by `block_sparse_moe`: a router `gate` (E×D) and
experts `experts.{j}.w1` (gate, F×D), `w3` (up) and `w2` (down, D×F), the layout of the
released checkpoints (transformers 5 fuses them on load and splits them again on save).
The config maps through llama's adapter plus the expert fields; the expert weights are read
and written as one virtual tensor per layer and param, E × (HF shape), whose name holds
STACKED for the expert index (ExpertReader reads it; shardlab/hf/weights.py expands it on
export).
"""

import dataclasses

import numpy as np

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, STACKED, Mapping, adapter
from shardlab.hf.llama import LlamaAdapter, block

EXPERT = STACKED


@adapter("moe")
class MixtralAdapter(LlamaAdapter):
  label = "Mixtral"
  architectures = ("MixtralForCausalLM",)
  model_types = ("mixtral",)
  default_theta = 1e6  # transformers' MixtralConfig.default_theta
  fields = {**LlamaAdapter.fields, "n_experts": "num_local_experts",
            "experts_per_token": "num_experts_per_tok"}

  def model_fields(self, hf: dict, name: str, where: str = CONFIG_FILE) -> dict:
    if hf.get("router_jitter_noise") not in (None, 0, 0.0):
      raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']!r} is not "
                        f"supported (shardlab's router has no noise); valid: 0.0")
    if hf.get("sliding_window") is not None:
      raise ConfigError(f"{where}: sliding_window={hf['sliding_window']!r} is not supported "
                        f"(attention is full causal); valid: null")
    return {**super().model_fields(hf, name, where), "n_experts": hf["num_local_experts"],
            "experts_per_token": hf.get("num_experts_per_tok", 2),
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.02))}

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' MixtralForCausalLM loads."""
    out = super().to_hf(m, dtype)
    for key in ("mlp_bias", "attention_bias"):
      out.pop(key)
    return {**out, "num_local_experts": m.n_experts, "num_experts_per_tok": m.experts_per_token,
            "router_aux_loss_coef": m.router_aux_loss, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}

  def mlp_tensors(self, m) -> list[Mapping]:
    """Mixtral's router and experts (X: the expert index)."""
    experts = "block_sparse_moe.experts." + EXPERT
    return [block("moe.router_DxE", "block_sparse_moe.gate", ("X", "D"), "DX"),
            block("moe.gate_ExDxF", f"{experts}.w1", ("X", "F", "D"), "XDF"),
            block("moe.up_ExDxF", f"{experts}.w3", ("X", "F", "D"), "XDF"),
            block("moe.down_ExFxD", f"{experts}.w2", ("X", "D", "F"), "XFD")]

  def sizes(self, m) -> dict[str, int]:
    return {**super().sizes(m), "X": m.n_experts}

  def reader(self, found, m):
    return ExpertReader(found, m.n_experts)


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
