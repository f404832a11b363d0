"""How far each kind of parallelism stays compute-bound on a target: the planner's scaling
lines (`shardlab plan`'s "scaling on ...")."""

from shardlab.runtime import hardware


def thresholds(model, acc: hardware.Accelerator, p: int, grad_bytes: int) -> dict:
  """When data/FSDP parallelism stays compute-bound, and how far tensor parallelism goes.

  Per token a device spends 6·N FLOPs. DP all-reduces N gradients (2·N·g bytes of ring
  traffic per step); FSDP gathers the weights twice and reduce-scatters the gradients
  (N·(2p + g) bytes). Compute-bound when the per-device tokens T satisfy
    DP:   6·N·T / peak >= 2·N·g / bw   =>  T >= peak·g / (3·bw)
    FSDP: 6·N·T / peak >= N·(2p + g) / bw  =>  T >= peak·(2p + g) / (6·bw)
  TP all-reduces B×L×D four times per layer (2·(t-1)/t of it on the wire) against
  6·N_layer/t FLOPs per token, so it is compute-bound while
    t <= 6·N_layer·bw / (8·D·p·peak)  (Megatron-style f/g all-reduces, ring).
  """
  layer = model.d_model * model.head_dim * 2 * (model.n_heads + model.n_kv_heads) + \
      3 * model.d_model * model.mlp_dim
  out = {}
  for where, bw in (("ici", acc.ici_bw), ("dcn", acc.dcn_bw)):
    out[f"dp_tokens_per_device_{where}"] = acc.peak_flops * grad_bytes / (3 * bw)
    out[f"fsdp_tokens_per_device_{where}"] = acc.peak_flops * (2 * p + grad_bytes) / (6 * bw)
  out["tp_max_degree_ici"] = 6 * layer * acc.ici_bw / (8 * model.d_model * p * acc.peak_flops)
  return out
