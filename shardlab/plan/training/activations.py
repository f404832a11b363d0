"""Per-device element counts of one microbatch's activations, as shardlab's rules split
them: what the planner's memory (shardlab.plan.training.memory), collectives and step time
are computed from."""

import dataclasses

from shardlab.models import protocol
from shardlab.parallel import flash as attention
from shardlab.plan.training.shards import dim_shards, shard_elems

FLASH_BLOCK = 512  # the query/key block of parallel/flash.py and parallel/ring.py


@dataclasses.dataclass(frozen=True)
class ActivationShapes:
  """Per-device element counts of one microbatch's activations (one layer where per-layer)."""
  d: int  # B×L×D whole over `tensor` (what the attention and MLP matmuls read)
  # The residual stream (layer input, norm inputs and outputs) as the rules split it: `d`,
  # or 1/tensor of it under sequence parallelism (the `residual_length` rule).
  residual: int
  q: int  # B×L×H×E
  kv: int  # B×L×K×E
  scores: int  # B×H×L×L
  mlp: int  # B×L×F
  logits: int  # B×L×V
  tokens: int  # B×(L+1) int32
  positions: int  # B×L: per-token positions and segment ids, split as the sequence is
  head: int = 0  # D×V: the head's weight gradient where it is computed (before reduction)
  # A mixture of experts' dispatched rows (0 for a dense model): B×L×D and B×L×F times the
  # rows its experts run per token of the device (`expert_rows_per_token`).
  expert_d: float = 0
  expert_mlp: float = 0
  # Flash attention (blockwise, or ring under context parallelism): `scores` is then one
  # block pair's tile, B×H×C×C, never the whole L×L.
  flash: bool = False
  context: int = 1  # devices the sequence is split over (the `length` rule's mesh axes)
  # The dense path's scores, softmax and score gradient in the compute dtype, not fp32
  # (model.attention_scores="compute": parallel/softmax.py).
  compute_scores: bool = False
  ring: bool = False  # the KV exchange, when context > 1: ring, else all-gather


def attention_kind(m, platform: str) -> str:
  """"flash" or "xla": what model.attention runs as on `platform` (shardlab/parallel/flash.py)."""
  return attention.resolve(protocol.get(m, "attention"), platform)


def activation_shapes(m, micro_batch: int, seq_len: int, table: dict, mesh,
                      platform: str = "cpu") -> ActivationShapes:
  b, s = micro_batch, seq_len
  g = m.n_heads // m.n_kv_heads

  def n(shape, names, what):
    return shard_elems(shape, names, table, mesh, f"activation {what} {names}")

  context = dim_shards(("batch", "length"), (b, s), 1, table, mesh)
  flash = attention_kind(m, platform) == "flash"
  if flash:  # one query block's tile against one key block
    tile = min(FLASH_BLOCK, s // context)
    scores = n((b, m.n_kv_heads, g, tile * context, tile),
               ("batch", "kv_heads", None, "length", None), "score tile")
  else:
    scores = n((b, m.n_kv_heads, g, s, s), ("batch", "kv_heads", None, "length", None),
               "scores")
  d = n((b, s, m.d_model), ("batch", "length", "embed"), "x")
  mlp = n((b, s, m.mlp_dim), ("batch", "length", "mlp"), "h")
  rows = 0.0
  if protocol.has(m, "n_experts"):
    ep = dim_shards(("experts",), (m.n_experts,), 0, table, mesh)
    rows = expert_rows_per_token(m, n((b, s), ("batch", "length"), "tokens"), ep)
  return ActivationShapes(
      d=d,
      residual=n((b, s, m.d_model), ("batch", "residual_length", "embed"), "residual"),
      q=n((b, s, m.n_heads, m.head_dim), ("batch", "length", "heads", "head_dim"), "q"),
      kv=n((b, s, m.n_kv_heads, m.head_dim), ("batch", "length", "kv_heads", "head_dim"), "k"),
      scores=scores,
      mlp=mlp, expert_d=d * rows, expert_mlp=mlp * rows,
      logits=n((b, s, m.vocab_size), ("batch", "length", "vocab"), "logits"),
      tokens=n((b, s + 1), ("batch", None), "tokens"),  # the batch splits rows only
      positions=n((b, s), ("batch", "length"), "positions"),
      head=n((m.d_model, m.vocab_size), ("embed", "vocab"), "head gradient"),
      flash=flash, context=context,
      compute_scores=protocol.get(m, "attention_scores") == "compute",
      ring=context > 1 and protocol.get(m, "kv_exchange") == "ring",
  )


def expert_rows_per_token(m, tokens: float, expert_parallel: int) -> float:
  """Rows a mixture of experts' matmuls run per token of a device that holds `tokens`:
  capacity dispatch's E × capacity slots; dropless's k per token padded to a worst-case slot
  at each of the N expert-parallel peers (shardlab/parallel/dispatch.py), so N · k."""
  if m.dispatch == "capacity":
    return m.n_experts * m.capacity(int(tokens)) / tokens
  return expert_parallel * m.experts_per_token
