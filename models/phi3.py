"""Phi-3 (Abdin et al. 2024; transformers' Phi3ForCausalLM): Mistral's llama with a sliding
window, and LongRoPE for the long-context checkpoints (Phi-3-mini-128k, Phi-3.5-mini).

One file on the model contract: the config subclasses MistralConfig and registers as "phi3".
The params are llama's, q, k, v and gate, up kept apart, so sharding rules, LoRA targets
and tensor parallelism are llama's; the checkpoint's fused qkv_proj and gate_up_proj are
split on import and fused again on export by the HF adapter (shardlab/hf/phi3.py).

LongRoPE (Ding et al. 2024): RoPE frequency i is divided by rope_short_factor[i] while the
sequence fits rope_original_max_seq_len and by rope_long_factor[i] past it, and cos and sin
are scaled by rope_attention_factor. "The sequence" is the largest position of the call plus
one, as transformers picks it: a decode step past the original context turns to the long
factors (the keys already cached keep the short ones, as in transformers).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlab.errors import ConfigError
from shardlab.models import llama, mistral
from shardlab.models.decoder import token_layout
from shardlab.models.protocol import register


def longrope_frequencies(cfg, factors: tuple[float, ...]) -> np.ndarray:
  """The E/2 fp32 inverse frequencies, each divided by its LongRoPE factor (transformers'
  `_compute_longrope_parameters`)."""
  exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / \
      np.float32(cfg.head_dim)
  scaled = np.asarray(factors, np.float32) * np.float32(cfg.rope_theta) ** exponents
  return (np.float32(1.0) / scaled).astype(np.float32)


def longrope_tables(cfg, positions_BxL):
  """cos/sin B×L×E of LongRoPE, its factors picked by the longest position."""
  short, long = (longrope_frequencies(cfg, f) for f in cfg.longrope)
  past = jnp.max(positions_BxL) + 1 > cfg.rope_original_max_seq_len
  cos, sin = llama.rope_tables(positions_BxL, cfg.head_dim, cfg.rope_theta,
                               jnp.where(past, long, short))
  return cos * cfg.rope_attention_factor, sin * cfg.rope_attention_factor


class Phi3(mistral.Mistral):

  def _inputs(self, tokens_BxL, positions_BxL, cache, segments_BxL):
    """Mistral's (llama's), with LongRoPE's tables where the config has it; the positions
    are laid out as the layers read them (token_layout, as llama's _inputs does)."""
    x, layer_args, restore, end = super()._inputs(tokens_BxL, positions_BxL, cache,
                                                  segments_BxL)
    if not self.cfg.longrope:  # plain RoPE: llama's tables
      return x, layer_args, restore, end
    positions_BxL = token_layout(tokens_BxL, positions_BxL, cache, segments_BxL,
                                 self.cfg.d_model)[1]
    return x, (*longrope_tables(self.cfg, positions_BxL), *layer_args[2:]), restore, end


def _factors(text: str, field: str) -> tuple[float, ...]:
  try:
    return tuple(float(t) for t in text.split(",") if t.strip())
  except ValueError:
    raise ConfigError(f"model.{field} must be comma-separated numbers, got {text!r}") from None


@register("phi3")
@dataclasses.dataclass(frozen=True)
class Phi3Config(mistral.MistralConfig):
  # LongRoPE: E/2 comma-separated divisors of the RoPE frequencies for a sequence up to
  # rope_original_max_seq_len (short) and past it (long); both "": plain RoPE.
  rope_short_factor: str = ""
  rope_long_factor: str = ""
  rope_attention_factor: float = 1.0  # LongRoPE's: cos and sin are scaled by it
  arch: str = "phi3"

  def __post_init__(self):
    super().__post_init__()
    if self.rope_scaling != "none":
      raise ConfigError(f"model.rope_scaling must be 'none' for a phi3 model (it scales RoPE "
                        f"by LongRoPE: model.rope_short_factor and model.rope_long_factor), "
                        f"got {self.rope_scaling!r}")
    short, long = (_factors(getattr(self, f), f)
                   for f in ("rope_short_factor", "rope_long_factor"))
    if not self.rope_attention_factor > 0:
      raise ConfigError(f"model.rope_attention_factor must be > 0, got "
                        f"{self.rope_attention_factor}")
    if not short and not long:
      if self.rope_attention_factor != 1.0:
        raise ConfigError(f"model.rope_attention_factor={self.rope_attention_factor} needs "
                          f"LongRoPE (model.rope_short_factor and model.rope_long_factor); "
                          f"without it, valid: 1.0")
      return
    for field, factors in (("rope_short_factor", short), ("rope_long_factor", long)):
      if len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors):
        raise ConfigError(f"model.{field} must hold head_dim / 2 = {self.head_dim // 2} "
                          f"numbers > 0 (LongRoPE, with the other factor list), got "
                          f"{len(factors)}: {getattr(self, field)!r}")
    if self.rope_original_max_seq_len < 1:
      raise ConfigError(f"model.rope_original_max_seq_len must be >= 1, got "
                        f"{self.rope_original_max_seq_len}")

  @property
  def longrope(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(short factors, long factors), or None for plain RoPE."""
    if not self.rope_short_factor:
      return None
    return (_factors(self.rope_short_factor, "rope_short_factor"),
            _factors(self.rope_long_factor, "rope_long_factor"))

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> Phi3:
    return Phi3(self, rngs, param_dtype, remat, lora if lora and lora.rank else None, unroll)
