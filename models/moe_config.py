"""A Mixtral-style mixture-of-experts decoder's shape, and what the core asks of it (the
contract's expert members, models/protocol.py EXPERTS, among them).

The attention half is llama's (models/llama_config.py holds the shared fields); every MLP is
replaced by `n_experts` SwiGLU experts of width `mlp_dim`, of which a router picks
`experts_per_token` per token (models/experts.py). `n_params` counts every expert,
`n_active_params` the ones a token runs through; FLOPs per token follow the active ones.
"""

import dataclasses
import math

from flax import nnx

from shardlab import parallel
from shardlab.errors import ConfigError, unknown
from shardlab.models import decoder, experts, llama, moe
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.protocol import arch_of, register


@register("moe")
@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
  n_experts: int = 8
  experts_per_token: int = 2
  # "dropless": tokens sorted by expert, grouped matmuls (jax.lax.ragged_dot), none dropped;
  # "capacity": each expert takes at most capacity_factor × its even share of the tokens.
  dispatch: str = "dropless"
  capacity_factor: float = 1.25
  # Weights of the Switch/Mixtral load-balancing loss and of the router z-loss (ST-MoE).
  router_aux_loss: float = 0.01
  router_z_loss: float = 0.0
  arch: str = "moe"

  activations = decoder.ACTIVATIONS
  no_weight_decay = llama.NO_WEIGHT_DECAY
  remat_policies = tuple(parallel.REMAT_POLICIES)
  lora_targets = ()
  lora_weights = {}

  def __post_init__(self):
    shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(LlamaConfig)}
    LlamaConfig(**{**shared, "arch": "llama"})  # the attention half's checks
    if self.arch != arch_of(type(self)):
      raise ConfigError(f"model.arch must be {arch_of(type(self))!r} for a "
                        f"{type(self).__name__}, got {self.arch!r}")
    if self.n_experts < 1 or not 1 <= self.experts_per_token <= self.n_experts:
      raise ConfigError(f"model.experts_per_token ({self.experts_per_token}) must be in "
                        f"1..model.n_experts ({self.n_experts})")
    if self.dispatch not in experts.DISPATCH:
      raise unknown("model.dispatch", self.dispatch, experts.DISPATCH)
    if not self.capacity_factor > 0:
      raise ConfigError(f"model.capacity_factor must be > 0, got {self.capacity_factor}")
    if self.router_aux_loss < 0 or self.router_z_loss < 0:
      raise ConfigError("model.router_aux_loss and model.router_z_loss must be >= 0")

  @property
  def saved_activations(self) -> dict:
    """As llama's (models/llama_config.py), with the experts' rows in place of the MLP's:
    each dispatched row (`expert_*`: the planner multiplies by the rows per token, which
    under dropless dispatch grow with the expert-parallel degree, shardlab/parallel/
    dispatch.py) keeps SwiGLU's three F-wide residuals and four D-wide copies (dispatched,
    exchanged, the experts' output and its return); each token the k rows gathered for the
    combine."""
    k = self.experts_per_token
    return {"d": (0, 4 + k), "q": (0, 2), "kv": (0, 2), "scores": (0, 1),
            "expert_d": (0, 4), "expert_mlp": (0, 3)}

  # The experts' matmuls are batched over the experts and carry no names: no remat policy
  # keeps them, only attention's projections (and the router's fp32 B×L×E logits, which
  # the planner leaves out).
  saved_matmul_outputs = {"d": 1, "q": 1, "kv": 2}
  saved_projections = {"query_proj": "q", "key_proj": "kv", "value_proj": "kv",
                       "out_proj": "d"}
  unread_projections = ()  # the combine reads every expert's output

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> moe.MoE:
    if lora is not None and lora.rank:
      raise ConfigError(f"model {self.name} ({self.arch}) offers no LoRA targets")
    return moe.MoE(self, rngs, param_dtype, remat, unroll)

  def axis_sizes(self) -> dict:
    return {**super().axis_sizes(), "experts": self.n_experts}

  def _dense_block(self) -> int:
    d, h, kv, hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
    return d * hd * (2 * h + 2 * kv) + 2 * d + d * self.n_experts  # attention, norms, router

  def _embeddings(self) -> int:
    return self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

  @property
  def n_params(self) -> int:
    """Exact: embeddings, blocks (attention, norms, router, every expert), final norm."""
    block = self._dense_block() + self.n_experts * 3 * self.d_model * self.mlp_dim
    return self._embeddings() + self.n_layers * block + self.d_model

  @property
  def n_active_params(self) -> int:
    """The parameters one token runs through: experts_per_token experts a layer."""
    block = self._dense_block() + self.experts_per_token * 3 * self.d_model * self.mlp_dim
    return self._embeddings() + self.n_layers * block + self.d_model

  @property
  def n_expert_params(self) -> int:
    return self.n_layers * self.n_experts * 3 * self.d_model * self.mlp_dim

  @property
  def n_layer_params(self) -> int:
    return self.n_params - self._embeddings()

  def n_lora_params(self, lora) -> int:
    return 0

  def capacity(self, tokens: int) -> int:
    """Slots per expert for `tokens` tokens of one device in capacity dispatch."""
    return capacity(tokens, self.experts_per_token, self.n_experts, self.capacity_factor)

  def flops_per_token(self, seq_len: int) -> float:
    """6 · active params (less the embedding lookup) + attention's 12·layers·heads·E·seq."""
    lookup = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
    return 6 * (self.n_active_params - lookup) + attention


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
  return max(1, math.ceil(factor * tokens * k / n_experts))
