"""Qwen2 and Qwen2.5 (Qwen team 2024; transformers' Qwen2ForCausalLM): llama with a bias on
the q, k and v projections (none on o), tied or untied embeddings and a large RoPE base.

One file on the model contract: the config subclasses LlamaConfig and registers as "qwen2";
the module is llama's, its attention given the three biases. Sliding-window layers
(`use_sliding_window`) are not modelled: every released Qwen2/2.5 checkpoint has them off, and
the HF adapter refuses a config that turns them on (shardlab/hf/qwen2.py).
"""

import dataclasses

from flax import nnx

from shardlab import parallel
from shardlab.models import llama
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.protocol import register

BIASES = {"q": "q_bias_HxE", "k": "k_bias_KxE", "v": "v_bias_KxE"}
# Biases are vectors per head: decayed by rank alone (3-D once stacked) they would shrink.
NO_WEIGHT_DECAY = llama.NO_WEIGHT_DECAY + tuple(BIASES.values())


class Qwen2Attention(llama.Attention):
  """llama's attention, with q, k and v biases (zero at init, so the init is llama's)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    super().__init__(cfg, dtype, rngs, stack, lora_cfg, lora_rngs)
    h, k, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bias = lambda shape, names: parallel.stacked_param(rngs, shape, names, "zeros", dtype, stack)
    self.q_bias_HxE = bias((h, e), ("heads", "head_dim"))
    self.k_bias_KxE = bias((k, e), ("kv_heads", "head_dim"))
    self.v_bias_KxE = bias((k, e), ("kv_heads", "head_dim"))

  def project(self, target: str, x):
    """llama's projection (with its LoRA update), plus the target's bias (o has none)."""
    y = super().project(target, x)
    bias = getattr(self, BIASES[target]) if target in BIASES else None
    return y if bias is None else y + bias[...].astype(y.dtype)


class Qwen2(llama.Llama):
  ATTENTION = Qwen2Attention


@register("qwen2")
@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
  arch: str = "qwen2"

  no_weight_decay = NO_WEIGHT_DECAY

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> Qwen2:
    return Qwen2(self, rngs, param_dtype, remat, lora if lora and lora.rank else None, unroll)

  @property
  def n_params(self) -> int:
    """llama's, plus the q, k and v biases of every layer."""
    return super().n_params + self.n_layers * self.head_dim * (self.n_heads +
                                                               2 * self.n_kv_heads)
