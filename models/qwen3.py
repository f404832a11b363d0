"""Qwen3, dense (Qwen team 2025; transformers' Qwen3ForCausalLM): llama with an RMSNorm on
every query and key head (over head_dim, before RoPE), no q/k/v bias, and a `head_dim` of
its own (128 in every released size, whatever d_model / n_heads is).

One file on the model contract: the config subclasses LlamaConfig and registers as "qwen3";
the module is llama's, its attention given the two head norms. The norms' scales are named
`scale` like every other norm's, so they are exempt from weight decay by the same rule.
Qwen3-MoE (models/qwen3_moe.py) reuses this attention.
"""

import dataclasses

from flax import nnx

from shardlab import parallel
from shardlab.models import llama
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.protocol import register

HEAD_NORMS = ("q", "k")


class HeadNorm(nnx.Module):
  """RMSNorm over one head's width (the last dim of B×L×H×E), one scale shared by the heads."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=()):
    self.scale = parallel.stacked_param(rngs, (cfg.head_dim,), ("head_dim",), "ones", dtype,
                                        stack)
    self.eps = cfg.norm_eps

  def __call__(self, x_BxLxHxE):
    return llama.rms_norm(x_BxLxHxE, self.scale[...], self.eps)


class Qwen3Attention(llama.Attention):
  """llama's attention with q_norm and k_norm on the projected heads; RoPE (applied by
  llama's __call__ after `project`) rotates the normed heads, as transformers does."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    super().__init__(cfg, dtype, rngs, stack, lora_cfg, lora_rngs)
    self.q_norm = HeadNorm(cfg, dtype, rngs, stack)
    self.k_norm = HeadNorm(cfg, dtype, rngs, stack)

  def project(self, target: str, x):
    """llama's projection (with its LoRA update), then the head norm for q and k."""
    y = super().project(target, x)
    return getattr(self, f"{target}_norm")(y) if target in HEAD_NORMS else y


class Qwen3(llama.Llama):
  ATTENTION = Qwen3Attention


@register("qwen3")
@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
  arch: str = "qwen3"

  # The saved activations (the planner's) are llama's plus two normed copies of q and k,
  # whose backward keeps their inputs as RMSNorm's does (models/llama.py rms_norm).
  saved_activations = {**LlamaConfig.saved_activations, "q": (0, 3), "kv": (0, 3)}

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> Qwen3:
    return Qwen3(self, rngs, param_dtype, remat, lora if lora and lora.rank else None, unroll)

  @property
  def n_params(self) -> int:
    """llama's, plus the q and k head norms of every layer."""
    return super().n_params + self.n_layers * 2 * self.head_dim
