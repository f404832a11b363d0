"""A Llama variant with a bias on the q, k and v projections (as Qwen2's attention has), in one
file: the exit test of the model contract (tests/test_protocol.py).

The config subclasses LlamaConfig and registers under its own name; the module is llama's,
its attention given three biases. Importing this file registers "llama-qkv-bias", after which
a model file with `arch = "llama-qkv-bias"` loads (shardlab.models.registry.load) and trains
like any bundled model. Its Hugging Face adapter (transformers' Qwen2ForCausalLM) is the one
file beside it, llama_qkv_bias_hf.py (tests/test_hf_adapters.py).
"""

import dataclasses

from flax import nnx

from shardlab import parallel
from shardlab.models import llama
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.protocol import register


class QKVBiasAttention(llama.Attention):
  """llama's attention, with q, k and v biases (zero at init, so the init is llama's)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    super().__init__(cfg, dtype, rngs, stack, lora_cfg, lora_rngs)
    h, k, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bias = lambda shape, names: parallel.stacked_param(rngs, shape, names, "zeros", dtype, stack)
    self.q_bias_HxE = bias((h, e), ("heads", "head_dim"))
    self.k_bias_KxE = bias((k, e), ("kv_heads", "head_dim"))
    self.v_bias_KxE = bias((k, e), ("kv_heads", "head_dim"))

  def project(self, target: str, x):
    """llama's projection, plus the target's bias (q, k and v have one, o none)."""
    y = super().project(target, x)
    bias = getattr(self, f"{target}_bias_{'HxE' if target == 'q' else 'KxE'}", None)
    return y if bias is None else y + bias[...].astype(y.dtype)


class QKVBiasLlama(llama.Llama):
  ATTENTION = QKVBiasAttention


@register("llama-qkv-bias")
@dataclasses.dataclass(frozen=True)
class QKVBiasConfig(LlamaConfig):
  arch: str = "llama-qkv-bias"

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> QKVBiasLlama:
    return QKVBiasLlama(self, rngs, param_dtype, remat, lora if lora and lora.rank else None,
                        unroll)

  @property
  def n_params(self) -> int:
    """llama's, plus the q, k and v biases of every layer."""
    biases = self.n_layers * self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    return super().n_params + biases
