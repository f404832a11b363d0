"""Qwen3-MoE (Qwen team 2025; transformers' Qwen3MoeForCausalLM): Qwen3's attention (q/k
head norms, models/qwen3.py) and, in every layer, a mixture of SwiGLU experts of width
`moe_intermediate_size` (mlp_dim here) through the same dispatch as the bundled MoE
(models/experts.py, shardlab.parallel.experts; expert parallelism by the rules).

Its router is Mixtral's but for one switch, `norm_topk_prob`: softmax over the experts, the
top k kept, renormalised to sum to 1 only when it is true (Qwen3-30B-A3B: true); HF's
default is false. Layers with a dense MLP instead (`mlp_only_layers`, `decoder_sparse_step`
> 1) are not modelled; no released Qwen3-MoE has them, and the adapter refuses them.
LoRA adapts the attention's projections (the experts have none).
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from shardlab import parallel
from shardlab.errors import ConfigError
from shardlab.models import experts, llama, qwen3
from shardlab.models.llama import RMSNorm
from shardlab.models.llama_config import LlamaConfig
from shardlab.models.moe import MoE, MoEBlock
from shardlab.models.moe_config import MoEConfig
from shardlab.models.protocol import register
from shardlab.parallel import stacked_param as _param

ATTENTION_TARGETS = ("q", "k", "v", "o")


class Qwen3Experts(experts.Experts):
  """The bundled experts, routed by Qwen3-MoE's rule (renormalised only if norm_topk_prob)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=()):
    super().__init__(cfg, dtype, rngs, stack)
    self.normalize = cfg.norm_topk_prob

  def route(self, logits_BxLxE):
    return parallel.route(logits_BxLxE, self.k, self.normalize)


class Qwen3MoeBlock(MoEBlock):
  """x + qwen3_attn(norm(x)), then + experts(norm(x)); also returns the router stats."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None):
    extra = ({} if lora_cfg is None else
             {"lora_cfg": lora_cfg, "lora_rngs": parallel.adapter_rngs(rngs)})
    self.attn_norm = RMSNorm(cfg, dtype, rngs, stack)
    self.attn = qwen3.Qwen3Attention(cfg, dtype, rngs, stack, **extra)
    self.mlp_norm = RMSNorm(cfg, dtype, rngs, stack)
    self.moe = Qwen3Experts(cfg, dtype, rngs, stack)


class Qwen3Moe(MoE):
  """models/moe.MoE (router statistics, no 1F1B) with Qwen3-MoE's blocks."""

  def __init__(self, cfg, rngs: nnx.Rngs, param_dtype=jnp.float32, remat: str = "none",
               lora_cfg=None, unroll: int = 1):
    self.cfg = cfg
    self.remat, self.unroll = remat, unroll  # the layer scan's settings
    d, v = cfg.d_model, cfg.vocab_size
    self.embed_VxD = _param(rngs, (v, d), ("vocab", "embed"), d, param_dtype)
    self.blocks = Qwen3MoeBlock(cfg, param_dtype, rngs, stack=(cfg.n_layers,),
                                lora_cfg=lora_cfg)
    self.final_norm = RMSNorm(cfg, param_dtype, rngs)
    if not cfg.tie_embeddings:
      self.head_DxV = _param(rngs, (d, v), ("embed", "vocab"), d, param_dtype)


@register("qwen3_moe")
@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(MoEConfig):
  # Renormalise the top k router probabilities to sum to 1 (HF `norm_topk_prob`).
  norm_topk_prob: bool = True
  router_aux_loss: float = 0.001  # HF's router_aux_loss_coef default
  arch: str = "qwen3_moe"

  lora_targets = ATTENTION_TARGETS
  lora_weights = {t: llama.LORA_WEIGHTS[t] for t in ATTENTION_TARGETS}

  @property
  def saved_activations(self) -> dict:
    """The MoE's (models/moe_config.py), with Qwen3's normed q and k (models/qwen3.py)."""
    return {**super().saved_activations, "q": qwen3.Qwen3Config.saved_activations["q"],
            "kv": qwen3.Qwen3Config.saved_activations["kv"]}

  def make(self, rngs: nnx.Rngs, param_dtype, remat: str = "none", lora=None,
           unroll: int = 1) -> Qwen3Moe:
    lora = lora if lora and lora.rank else None
    if lora is not None and set(lora.target_names) - set(ATTENTION_TARGETS):
      raise ConfigError(f"model {self.name} ({self.arch}) adapts only "
                        f"{', '.join(ATTENTION_TARGETS)} with LoRA; got lora.targets "
                        f"{lora.targets!r}")
    return Qwen3Moe(self, rngs, param_dtype, remat, lora, unroll)

  def _dense_block(self) -> int:
    """The MoE's (attention, norms, router), plus the q and k head norms."""
    return super()._dense_block() + 2 * self.head_dim

  def n_lora_params(self, lora) -> int:
    return LlamaConfig.n_lora_params(self, lora)
