"""The GPT-2 family's shape, and what the core asks of a bundled model (models/protocol.py).

`n_params` is exact: 124,439,808 for gpt2-124m, as in the released checkpoint (the output
head is the token embedding).
"""

import dataclasses

from flax import nnx

from shardlab.errors import ConfigError, unknown
from shardlab import parallel
from shardlab.models import decoder, gpt2
from shardlab.models.protocol import arch_of, register


@register("gpt2")
@dataclasses.dataclass(frozen=True)
class GPT2Config:
  name: str
  vocab_size: int = 50257
  d_model: int = 768
  n_layers: int = 12
  n_heads: int = 12
  max_seq_len: int = 1024  # n_positions: the learned position table's rows
  norm_eps: float = 1e-5
  attention: str = "xla"  # "xla" | "flash" | "auto": shardlab.parallel.attention
  attention_scores: str = "fp32"  # "fp32" | "compute": as LlamaConfig's
  arch: str = "gpt2"

  activations = decoder.ACTIVATIONS
  no_weight_decay = gpt2.NO_WEIGHT_DECAY
  remat_policies = tuple(parallel.REMAT_POLICIES)
  tie_embeddings = True
  # Context parallelism gathers K/V whole (GPT-2 passes no kv_exchange to the attention).
  kv_exchange = "all-gather"
  position_limit = "GPT-2's learned position table has no rows past it"
  # For the planner, as in LlamaConfig (print_saved_residuals of this model): per LayerNorm
  # three fp32 tensors (x − mean, its square's cotangent factor, the normalised x) and its
  # output; q, k, v, the attention output; the probabilities (the softmax's gradient is
  # written out, shardlab.parallel.softmax); the GELU
  # (tanh) MLP's six F-wide intermediates. Matmul outputs kept: o-proj, q, k, v and fc.
  saved_activations = {"d": (6, 2), "q": (0, 2), "kv": (0, 2), "scores": (0, 1),
                       "mlp": (0, 6)}
  saved_matmul_outputs = {"d": 1, "q": 1, "kv": 2, "mlp": 1}
  # As LlamaConfig's; the MLP's one input projection is its "up" (mlpwi_1).
  saved_projections = {"query_proj": "q", "key_proj": "kv", "value_proj": "kv",
                       "out_proj": "d", "mlpwi_1": "mlp"}
  unread_projections = ("mlpwo",)  # as LlamaConfig's
  # The projections LoRA can adapt (lora.targets; llama's names, no gate), and their weights.
  lora_targets = tuple(gpt2.LORA_WEIGHTS)
  lora_weights = gpt2.LORA_WEIGHTS

  def __post_init__(self):
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
      if getattr(self, f) < 1:
        raise ConfigError(f"model.{f} must be >= 1, got {getattr(self, f)}")
    if not self.norm_eps > 0:
      raise ConfigError(f"model.norm_eps must be > 0, got {self.norm_eps}")
    if self.attention not in parallel.ATTENTION_IMPLEMENTATIONS:
      raise unknown("model.attention", self.attention, parallel.ATTENTION_IMPLEMENTATIONS)
    if self.attention_scores not in parallel.ATTENTION_SCORES:
      raise unknown("model.attention_scores", self.attention_scores, parallel.ATTENTION_SCORES)
    if self.d_model % self.n_heads:
      raise ConfigError(f"model.d_model ({self.d_model}) must be a multiple of model.n_heads "
                        f"({self.n_heads})")
    if self.arch != arch_of(type(self)):
      raise ConfigError(f"model.arch must be {arch_of(type(self))!r} for a "
                        f"{type(self).__name__}, got {self.arch!r}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def n_kv_heads(self) -> int:
    return self.n_heads

  @property
  def mlp_dim(self) -> int:
    return 4 * self.d_model

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> gpt2.GPT2:
    """The module; `lora` (a LoraConfig with rank > 0) adds adapters to its targets."""
    return gpt2.GPT2(self, rngs, param_dtype, remat, lora if lora and lora.rank else None,
                     unroll)

  def init_cache(self, batch: int, length: int, dtype) -> decoder.KVCache:
    return decoder.KVCache.zeros(self.n_layers, batch, length, self.n_heads, self.head_dim,
                                 dtype)

  def axis_sizes(self) -> dict:
    return {"embed": self.d_model, "heads": self.n_heads, "kv_heads": self.n_heads,
            "head_dim": self.head_dim, "mlp": self.mlp_dim, "vocab": self.vocab_size,
            "layers": self.n_layers}

  @property
  def n_layer_params(self) -> int:
    d, f = self.d_model, self.mlp_dim
    attention = 4 * d * d + 4 * d
    mlp = 2 * d * f + f + d
    return self.n_layers * (attention + mlp + 4 * d)

  @property
  def n_params(self) -> int:
    """Token and position tables, the blocks, the final LayerNorm (the head is tied)."""
    d = self.d_model
    return (self.vocab_size + self.max_seq_len) * d + self.n_layer_params + 2 * d

  def n_lora_params(self, lora) -> int:
    """Adapter parameters for a LoraConfig: rank × (fan-in + fan-out) per target, per layer
    (the biases are not adapted)."""
    d, f = self.d_model, self.mlp_dim
    sides = {"q": 2 * d, "k": 2 * d, "v": 2 * d, "o": 2 * d, "up": d + f, "down": f + d}
    if not lora.rank:
      return 0
    return self.n_layers * lora.rank * sum(sides[t] for t in lora.target_names)

  def flops_per_token(self, seq_len: int) -> float:
    """6·N + 12·layers·d_model·seq (PaLM appendix B); N excludes the position table (a
    lookup) but keeps the tied token table (it is the output head's matmul)."""
    attention = 12 * self.n_layers * self.d_model * seq_len
    return 6 * (self.n_params - self.max_seq_len * self.d_model) + attention
