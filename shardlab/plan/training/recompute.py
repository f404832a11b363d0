"""What a remat policy (shardlab/remat.py) keeps of a layer by name, and what the backward
pass computes again: the bytes of the kept matmul outputs and named projections (the memory
model adds the layer input and places each on the device or the host), and the step's
hardware FLOPs with the recomputed forward work."""

from shardlab import remat as remat_lib
from shardlab.models import protocol


def matmul_output_bytes(a, p: int, m) -> float:
  """Every weight matmul output the backward reads (`saved_matmul_outputs`), one layer;
  `a`: plan.training.activations.ActivationShapes."""
  outs = protocol.get(m, "saved_matmul_outputs")
  return sum(getattr(a, k) * n * p for k, n in outs.items())


def projection_bytes(a, p: int, m, names) -> float:
  """The named projection outputs among `names` that the backward reads, one layer."""
  read = read_projections(m, names)
  table = protocol.get(m, "saved_projections") if read else {}
  return sum(getattr(a, table[n]) * p for n in read)


def read_projections(m, names) -> list[str]:
  """The named projection outputs among `names` (checkpoint names) that a layer's backward
  reads (the model's `saved_projections`; none asked of it for no names but the input)."""
  names = [n for n in names if n != remat_lib.LAYER_INPUT]
  return [n for n in names if n in protocol.get(m, "saved_projections")] if names else []


def hardware_flops_per_token(m, seq_len: int, remat: str) -> float:
  """Model FLOPs plus what remat recomputes: every policy repeats attention's forward
  einsums (4·H·E·seq a layer); full and offload repeat each layer's weight matmuls too
  (2 FLOPs a parameter the token runs through: a mixture of experts' token reruns its own
  experts, not every one), save-matmul-outputs none of them, a named policy those whose
  outputs it does not keep. None reruns a projection whose output no backward reads
  (`unread_projections`: llama's down projection)."""
  flops = m.flops_per_token(seq_len)
  policy = remat_lib.policy(remat)
  if policy is None:
    return flops
  flops += 4 * m.n_layers * m.n_heads * m.head_dim * seq_len
  if policy.dots:
    return flops
  skipped = [*read_projections(m, policy.saved + policy.offloaded),
             *protocol.get(m, "unread_projections")]
  return flops + 2 * (_active_layer_params(m) - m.n_layers * sum(projection_params(m, n)
                                                                 for n in skipped))


def _active_layer_params(m) -> int:
  """The scanned blocks' parameters one token runs through (all of them, for a dense model)."""
  return m.n_layer_params - (m.n_params - protocol.get(m, "n_active_params"))


def projection_params(m, name: str) -> int:
  """One layer's weights behind a named projection (shardlab/remat.py's names)."""
  q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
  width = {"query_proj": q, "key_proj": kv, "value_proj": kv, "out_proj": q,
           "mlpwi_0": m.mlp_dim, "mlpwi_1": m.mlp_dim, "mlpwo": m.mlp_dim}[name]
  return m.d_model * width
