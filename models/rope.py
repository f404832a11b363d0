"""Rotary position embedding frequencies, plain or scaled for a longer context.

  none    θ^(-2i/E), the RoPE paper's (Su et al. 2021)
  linear  every frequency divided by `factor` (position interpolation, Chen et al. 2023)
  llama3  Llama 3.1's: wavelengths longer than original_max_seq_len / low_freq_factor are
          divided by `factor`, those shorter than original_max_seq_len / high_freq_factor
          kept, and those between interpolated smoothly (as transformers'
          `_compute_llama3_parameters` computes them)
"""

import math

import numpy as np

from shardlab.errors import ConfigError, unknown

SCALINGS = ("none", "linear", "llama3")


def check(cfg) -> None:
  """Raises a ConfigError naming the model.rope_* field that is out of range."""
  if cfg.rope_scaling not in SCALINGS:
    raise unknown("model.rope_scaling", cfg.rope_scaling, SCALINGS)
  if cfg.rope_scaling == "none":
    return
  if not cfg.rope_factor >= 1:
    raise ConfigError(f"model.rope_factor must be >= 1 with rope_scaling "
                      f"{cfg.rope_scaling!r}, got {cfg.rope_factor}")
  if cfg.rope_scaling == "llama3":
    if not 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor:
      raise ConfigError(f"model.rope_low_freq_factor ({cfg.rope_low_freq_factor}) must be > 0 "
                        f"and < model.rope_high_freq_factor ({cfg.rope_high_freq_factor})")
    if cfg.rope_original_max_seq_len < 1:
      raise ConfigError(f"model.rope_original_max_seq_len must be >= 1, got "
                        f"{cfg.rope_original_max_seq_len}")


def inverse_frequencies(cfg) -> np.ndarray:
  """The E/2 fp32 inverse frequencies of `cfg` (a model config with head_dim, rope_theta
  and the rope_* scaling fields)."""
  e = cfg.head_dim
  exponents = np.arange(0, e, 2, dtype=np.int64).astype(np.float32) / np.float32(e)
  inv = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
  kind = getattr(cfg, "rope_scaling", "none")
  if kind == "linear":
    return (inv / np.float32(cfg.rope_factor)).astype(np.float32)
  if kind != "llama3":
    return inv
  factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old = cfg.rope_original_max_seq_len
  wavelen = np.float32(2 * math.pi) / inv
  scaled = np.where(wavelen > old / low, inv / np.float32(factor), inv).astype(np.float32)
  smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
  smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)
