"""The llama family's shape, and what the core asks of a bundled model (models/protocol.py).

Shape fields are the published ones; `n_params` is exact (it equals the sum over the
abstract state, which the tests check). A variant subclasses LlamaConfig and registers under
its own name (tests/data/llama_qkv_bias.py is one).
"""

import dataclasses

from flax import nnx

from shardlab.errors import ConfigError, unknown
from shardlab import parallel
from shardlab.models import decoder, llama, rope
from shardlab.models.protocol import arch_of, register


@register("llama")
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  name: str
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  # RoPE scaling for a longer context (models/rope.py): "none" | "linear" | "llama3".
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0  # llama3 only
  rope_high_freq_factor: float = 4.0  # llama3 only
  rope_original_max_seq_len: int = 8192  # llama3 only: the pretraining context
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  attention: str = "xla"  # "xla" | "flash" | "auto": shardlab.parallel.attention
  # The xla path's scores and softmax: "fp32", or "compute" (the compute dtype, MaxText's
  # default; less memory and traffic, a bf16 softmax): docs/attention.md.
  attention_scores: str = "fp32"
  # "all-gather" | "ring": context parallelism (shardlab.parallel.attention)
  kv_exchange: str = "all-gather"
  arch: str = "llama"
  # The tokenizer's special ids a Hugging Face export writes (config.json and
  # generation_config.json); eos may list several ids, comma-separated ("128001,128009").
  bos_token_id: int = 1
  eos_token_ids: str = "2"
  pad_token_id: int = -1  # -1: none

  # What the core asks of a bundled model.
  activations = decoder.ACTIVATIONS
  no_weight_decay = llama.NO_WEIGHT_DECAY
  remat_policies = tuple(parallel.REMAT_POLICIES)
  # What autodiff saves per layer, for the planner (plan/training/memory.py), by shape — d
  # B×L×D, q B×L×H×E, kv B×L×K×E, scores B×H×L×L, mlp B×L×F — as (fp32, compute-dtype)
  # counts; read off jax.ad_checkpoint.print_saved_residuals of this model. Each RMSNorm's
  # input and output (its backward keeps one fp32 scalar a position besides); q, k, v, the
  # attention output and the probabilities (the softmax's gradient is written out); SwiGLU's
  # gate and up, and the down-projection's input. With remat save-matmul-outputs: the weight
  # matmuls' outputs that backward reads (o-proj's, not down's), beside the layer input.
  saved_activations = {"d": (0, 4), "q": (0, 2), "kv": (0, 2), "scores": (0, 1),
                       "mlp": (0, 3)}
  saved_matmul_outputs = {"d": 1, "q": 1, "kv": 2, "mlp": 2}
  # At a named remat policy (shardlab/remat.py): the projections whose kept output the
  # backward reads, by shape. It never reads the down-projection's (mlpwo): a policy that
  # names it keeps nothing more (the traced backward's residuals: test_remat_policies.py).
  saved_projections = {"query_proj": "q", "key_proj": "kv", "value_proj": "kv",
                       "out_proj": "d", "mlpwi_0": "mlp", "mlpwi_1": "mlp"}
  # Nor does its recomputed forward: the down projection's output only joins the residual
  # sum, which is the next layer's saved input, so remat does not run it again (the compiled
  # step's FLOPs: tests/test_remat_policies.py).
  unread_projections = ("mlpwo",)
  # The projections LoRA can adapt (lora.targets), and the weight each one adapts.
  lora_targets = tuple(llama.LORA_WEIGHTS)
  lora_weights = llama.LORA_WEIGHTS
  position_limit = "RoPE was not trained past it"  # the planner's note past max_seq_len

  def __post_init__(self):
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
              "mlp_dim", "max_seq_len"):
      if getattr(self, f) < 1:
        raise ConfigError(f"model.{f} must be >= 1, got {getattr(self, f)}")
    if not self.rope_theta > 0 or not self.norm_eps > 0:
      raise ConfigError(f"model.rope_theta and model.norm_eps must be > 0, got "
                        f"{self.rope_theta} and {self.norm_eps}")
    if self.attention not in parallel.ATTENTION_IMPLEMENTATIONS:
      raise unknown("model.attention", self.attention, parallel.ATTENTION_IMPLEMENTATIONS)
    if self.attention_scores not in parallel.ATTENTION_SCORES:
      raise unknown("model.attention_scores", self.attention_scores, parallel.ATTENTION_SCORES)
    if self.kv_exchange not in parallel.KV_EXCHANGES:
      raise unknown("model.kv_exchange", self.kv_exchange, parallel.KV_EXCHANGES)
    rope.check(self)
    self.eos_ids  # parses
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(
          f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
          f"({self.n_kv_heads}) for grouped-query attention")
    # A registered subclass checks against its own name (an unregistered one, its base's).
    if self.arch != arch_of(type(self)):
      raise ConfigError(f"model.arch must be {arch_of(type(self))!r} for a "
                        f"{type(self).__name__}, got {self.arch!r}")

  @property
  def eos_ids(self) -> tuple[int, ...]:
    try:
      return tuple(int(t) for t in self.eos_token_ids.split(",") if t.strip())
    except ValueError:
      raise ConfigError(f"model.eos_token_ids must be comma-separated integers, got "
                        f"{self.eos_token_ids!r}") from None

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> llama.Llama:
    """The module; `lora` (a LoraConfig with rank > 0) adds adapters to its targets;
    `remat` and `unroll` are its layer scan's settings."""
    return llama.Llama(self, rngs, param_dtype, remat, lora if lora and lora.rank else None,
                       unroll)

  def init_cache(self, batch: int, length: int, dtype) -> decoder.KVCache:
    return decoder.KVCache.zeros(self.n_layers, batch, length, self.n_kv_heads, self.head_dim,
                                 dtype)

  def axis_sizes(self) -> dict:
    """The size of every logical parameter axis the model names."""
    return {"embed": self.d_model, "heads": self.n_heads, "kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "mlp": self.mlp_dim, "vocab": self.vocab_size,
            "layers": self.n_layers}

  @property
  def n_params(self) -> int:
    """Exact parameter count (embedding, blocks, final norm, untied head)."""
    d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.mlp_dim
    attn = d * hd * (2 * h + 2 * kv)
    block = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.n_layers * block + d + head

  def n_lora_params(self, lora) -> int:
    """Adapter parameters for a LoraConfig: rank × (fan-in + fan-out) per target, per layer."""
    d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.mlp_dim
    sides = {"q": d + h * hd, "k": d + kv * hd, "v": d + kv * hd, "o": h * hd + d,
             "gate": d + f, "up": d + f, "down": f + d}
    if not lora.rank:
      return 0
    return self.n_layers * lora.rank * sum(sides[t] for t in lora.target_names)

  @property
  def n_layer_params(self) -> int:
    """Parameters inside the scanned blocks (what full remat runs forward twice)."""
    return self.n_params - self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

  def flops_per_token(self, seq_len: int) -> float:
    """6·N + 12·layers·heads·head_dim·seq (PaLM, Chowdhery et al. 2022, appendix B); N
    excludes the untied embedding lookup, a gather."""
    lookup = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
    return 6 * (self.n_params - lookup) + attention
