"""The Qwen3 family's Hugging Face adapters: `Qwen3ForCausalLM` ↔ models/qwen3.py (arch
"qwen3") and `Qwen3MoeForCausalLM` ↔ models/qwen3_moe.py (arch "qwen3_moe").

Qwen3 is llama plus `self_attn.q_norm` and `k_norm` (one head_dim-wide RMSNorm scale each)
and an explicit `head_dim`. Refused by field and value: `attention_bias: true` (Qwen3 has a
switch for it; no released model turns it on), sliding windows (as Qwen2's,
shardlab/hf/qwen2.py), and what llama's adapter refuses.

Qwen3-MoE replaces every MLP by `mlp.gate` (the router, E×D) and experts
`mlp.experts.{j}.{gate,up,down}_proj` of width `moe_intermediate_size`: the released
checkpoints' layout, which transformers 5 fuses into `gate_up_proj` on load and splits again
on save (read as one stacked tensor by shardlab/hf/mixtral.py's ExpertReader). Refused:
`mlp_only_layers` or `decoder_sparse_step` > 1 (dense layers between the sparse ones).
"""

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, STACKED, Mapping, adapter
from shardlab.hf.llama import LlamaAdapter, block
from shardlab.hf.mixtral import ExpertReader
from shardlab.hf.qwen2 import NO_WINDOWS, FullAttentionAdapter


@adapter("qwen3")
class Qwen3Adapter(FullAttentionAdapter):
  label = "Qwen3"
  architectures = ("Qwen3ForCausalLM",)
  model_types = ("qwen3",)
  requires = {k: LlamaAdapter.requires[k]
              for k in ("hidden_act", "attention_bias", "attention_dropout")} | NO_WINDOWS

  def attention_tensors(self, m) -> list[Mapping]:
    """llama's, plus the q and k head norms (E each)."""
    return super().attention_tensors(m) + [
        block(f"attn.{t}_norm.scale", f"self_attn.{t}_norm", ("E",), "E") for t in "qk"]


@adapter("qwen3_moe")
class Qwen3MoeAdapter(Qwen3Adapter):
  label = "Qwen3-MoE"
  architectures = ("Qwen3MoeForCausalLM",)
  model_types = ("qwen3_moe",)
  fields = {**Qwen3Adapter.fields, "mlp_dim": "moe_intermediate_size",
            "n_experts": "num_experts", "experts_per_token": "num_experts_per_tok",
            "norm_topk_prob": "norm_topk_prob"}

  def model_fields(self, hf: dict, name: str, where: str = CONFIG_FILE) -> dict:
    if hf.get("mlp_only_layers"):
      raise ConfigError(f"{where}: mlp_only_layers={hf['mlp_only_layers']!r} is not supported "
                        f"(every layer is a mixture of experts); valid: []")
    if hf.get("decoder_sparse_step", 1) != 1:
      raise ConfigError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']!r} is not "
                        f"supported (every layer is a mixture of experts); valid: 1")
    # The released configs spell it num_experts; transformers 5 saves num_local_experts.
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if n_experts is None or "moe_intermediate_size" not in hf:
      raise ConfigError(f"{where} lacks num_experts or moe_intermediate_size; a {self.label} "
                        f"config needs both")
    return {**super().model_fields(hf, name, where), "mlp_dim": hf["moe_intermediate_size"],
            "n_experts": n_experts,
            "experts_per_token": hf.get("num_experts_per_tok", 8),
            # HF's defaults: no renormalisation, aux loss weight 0.001.
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001))}

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' Qwen3MoeForCausalLM loads. `intermediate_size` (the
    width of dense layers, which this model has none of) is written as the released
    checkpoints have it: experts_per_token × the expert width."""
    return {**super().to_hf(m, dtype), "intermediate_size": m.experts_per_token * m.mlp_dim,
            "moe_intermediate_size": m.mlp_dim, "num_experts": m.n_experts,
            "num_experts_per_tok": m.experts_per_token, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": m.router_aux_loss, "output_router_logits": False}

  def mlp_tensors(self, m) -> list[Mapping]:
    """The router and the experts (X: the expert index)."""
    experts = "mlp.experts." + STACKED
    return [block("moe.router_DxE", "mlp.gate", ("X", "D"), "DX"),
            block("moe.gate_ExDxF", f"{experts}.gate_proj", ("X", "F", "D"), "XDF"),
            block("moe.up_ExDxF", f"{experts}.up_proj", ("X", "F", "D"), "XDF"),
            block("moe.down_ExFxD", f"{experts}.down_proj", ("X", "D", "F"), "XFD")]

  def sizes(self, m) -> dict[str, int]:
    return {**super().sizes(m), "X": m.n_experts}

  def reader(self, found, m):
    return ExpertReader(found, m.n_experts)
