"""The Gemma 2 and Gemma 3 (text) shapes (models/gemma.py is the module), on the model
contract (models/protocol.py): each subclasses LlamaConfig (same projections, RoPE fields and
LoRA targets) and registers under its own name. Their Hugging Face adapters are
shardlab/hf/gemma.py.

Layer i is local (a sliding window of `sliding_window` keys, its own included) unless
(i + 1) is a multiple of `sliding_window_pattern` — transformers' default `layer_types`
(Gemma 2: every other layer, from the first; Gemma 3: five local, then one global).
`n_params` is exact: llama's plus the two post-norms of every layer (and Gemma 3's q and k
norms, head_dim each).
"""

import dataclasses

from flax import nnx

from shardlab.errors import ConfigError
from shardlab.models import decoder, gemma
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.protocol import register


@register("gemma2")
@dataclasses.dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  # Scores are scaled by query_pre_attn_scalar^-½ (not head_dim^-½).
  query_pre_attn_scalar: float = 256.0
  sliding_window: int = 4096  # keys a local layer's query sees; 0: every layer is global
  sliding_window_pattern: int = 2  # layer i is global iff (i + 1) % pattern == 0
  attn_softcap: float = 50.0  # scores become cap·tanh(scores / cap); 0: none
  final_softcap: float = 30.0  # the same on the output logits; 0: none
  qk_norm: bool = False  # Gemma 3: RMSNorm (1 + w) on q and k per head, before RoPE
  rope_local_theta: float = 0.0  # the local layers' RoPE base (unscaled); 0: rope_theta's
  arch: str = "gemma2"
  bos_token_id: int = 2
  eos_token_ids: str = "1"
  pad_token_id: int = 0

  # llama's (models/llama_config.py), read off print_saved_residuals of this model: six
  # compute-dtype d-sized norm inputs and outputs a layer (four norms), not four.
  saved_activations = {"d": (0, 6), "q": (0, 2), "kv": (0, 2), "scores": (0, 1),
                       "mlp": (0, 3)}
  # The post-attention and post-MLP norms read both output projections, down's (mlpwo) too.
  saved_matmul_outputs = {"d": 2, "q": 1, "kv": 2, "mlp": 2}
  saved_projections = LlamaConfig.saved_projections | {"mlpwo": "d"}
  unread_projections = ()

  # The planner's (models/protocol.py): the scan runs one period of the pattern a step
  # (gemma.scan_pattern); the soft-cap's backward recomputes the fp32 scores
  # (parallel/softmax.py); the capped loss (models/lm.py) holds the capped fp32 logits too
  # where XLA does not fuse the cap (CPU).
  @property
  def layers_per_scan_step(self) -> int:
    return self.sliding_window_pattern

  @property
  def backward_transients(self) -> dict:
    return {"scores": (1, 0)} if self.attn_softcap else {}

  @property
  def loss_fp32_logits(self) -> int:
    return 2 if self.final_softcap else 1

  def __post_init__(self):
    super().__post_init__()
    ints = {"sliding_window": 0, "sliding_window_pattern": 1}
    for f, low in ints.items():
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"model.{f} must be an int >= {low}, got {v!r}")
    for f in ("attn_softcap", "final_softcap", "rope_local_theta"):
      if not getattr(self, f) >= 0:
        raise ConfigError(f"model.{f} must be >= 0 (0: none), got {getattr(self, f)}")
    if not self.query_pre_attn_scalar > 0:
      raise ConfigError(f"model.query_pre_attn_scalar must be > 0, got "
                        f"{self.query_pre_attn_scalar}")

  @property
  def layer_windows(self) -> tuple:
    """One period of the layer pattern: each layer's window (None: a global layer)."""
    p, w = self.sliding_window_pattern, self.sliding_window or None
    return tuple(w if (i + 1) % p else None for i in range(p))

  @property
  def windows(self) -> tuple:
    """Every layer's window, in order (None: global)."""
    return tuple(self.layer_windows[i % self.sliding_window_pattern]
                 for i in range(self.n_layers))

  def init_cache(self, batch: int, length: int, dtype) -> decoder.KVCache:
    """The global layers' buffers of `length`, the local layers' rings of
    min(sliding_window, length) in a stack of their own (gemma.scan_pattern routes them)."""
    local = sum(w is not None for w in self.windows)
    return decoder.KVCache.zeros(self.n_layers - local, batch, length, self.n_kv_heads,
                                 self.head_dim, dtype, local, self.sliding_window)

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> gemma.Gemma:
    return gemma.Gemma(self, rngs, param_dtype, remat, lora if lora and lora.rank else None,
                       unroll)

  @property
  def n_params(self) -> int:
    """llama's, plus two post-norms a layer (and Gemma 3's q and k norms)."""
    extra = 2 * self.d_model + (2 * self.head_dim if self.qk_norm else 0)
    return super().n_params + self.n_layers * extra

  def flops_per_token(self, seq_len: int) -> float:
    """llama's, each local layer's attention over at most its window of keys."""
    keys = sum(min(seq_len, w or seq_len) for w in self.windows)
    return super().flops_per_token(seq_len) - 12 * self.n_heads * self.head_dim * (
        self.n_layers * seq_len - keys)


@register("gemma3")
@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
  """Gemma 3's text decoder: q/k norms instead of attention soft-capping, five local layers
  to a global one, and a local RoPE base besides the global one (which may be scaled,
  rope_scaling "linear" for the 4B, 12B and 27B)."""
  rope_theta: float = 1_000_000.0
  sliding_window: int = 1024
  sliding_window_pattern: int = 6
  attn_softcap: float = 0.0
  final_softcap: float = 0.0
  qk_norm: bool = True
  rope_local_theta: float = 10_000.0
  arch: str = "gemma3"
  # Gemma 2's, plus the q and k norms' outputs (print_saved_residuals of this model).
  saved_activations = {"d": (0, 6), "q": (0, 3), "kv": (0, 3), "scores": (0, 1),
                       "mlp": (0, 3)}
