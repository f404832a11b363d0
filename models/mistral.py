"""Mistral: llama with sliding-window attention (`sliding_window`), in one file.

The config subclasses LlamaConfig and registers as "mistral"; the module is llama's, its
attention given the window. The window goes to the attention building block
(shardlab.parallel.attend), so every path keeps it: dense, flash (CPU blockwise, cuDNN,
splash), the KV cache and context parallelism (all-gather and ring). A query sees at most
`sliding_window` keys, its own included (transformers' convention: key j is seen by query i
iff i - window < j <= i). `sliding_window = 0` is full causal attention (Mistral-7B-v0.3's
`sliding_window: null`). With a window every layer's KV cache is a ring of
min(window, length) entries (models/decoder.py's KVCache). Its Hugging Face adapter is
shardlab/hf/mistral.py.
"""

import dataclasses

from flax import nnx

from shardlab.errors import ConfigError
from shardlab.models import decoder, llama
from shardlab.models.decoder import attend
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.protocol import register


class WindowedAttention(llama.Attention):
  """llama's attention; a query sees the last `cfg.sliding_window` keys (0: all)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    super().__init__(cfg, dtype, rngs, stack, lora_cfg, lora_rngs)
    # A Python int (static): flash and splash build their block masks from it.
    self.window = cfg.sliding_window or None

  def __call__(self, x_BxLxD, cos, sin, mask_LxM, index, doc=None, cache_kv=None):
    q, k, v = (self.project(t, x_BxLxD) for t in ("q", "k", "v"))
    out, cache_kv = attend(llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin), v,
                           mask_LxM, cache_kv, index, self.impl, doc, self.exchange,
                           window=self.window, scores=self.scores)
    return self.project("o", out), cache_kv


class Mistral(llama.Llama):
  ATTENTION = WindowedAttention


@register("mistral")
@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
  # Keys a query sees, its own included; 0: no window (full causal attention).
  sliding_window: int = 0
  arch: str = "mistral"

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
        or self.sliding_window < 0:
      raise ConfigError(f"model.sliding_window must be an int >= 0 (0: no window), got "
                        f"{self.sliding_window!r}")

  @property
  def windows(self) -> tuple:
    """Every layer's window, in order (None: none)."""
    return (self.sliding_window or None,) * self.n_layers

  def init_cache(self, batch: int, length: int, dtype) -> decoder.KVCache:
    """Rings of the window's length once `length` is longer (every layer has it)."""
    return decoder.KVCache.zeros(self.n_layers, batch,
                                 decoder.ring_length(self.sliding_window, length),
                                 self.n_kv_heads, self.head_dim, dtype)

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> Mistral:
    return Mistral(self, rngs, param_dtype, remat, lora if lora and lora.rank else None,
                   unroll)
