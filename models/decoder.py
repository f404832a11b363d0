"""Pieces every bundled decoder shares: stacked params, causal attention over an optional KV
cache, the scan over layers with remat, and the activation names they constrain.

Shape suffixes: B batch, L length, M attended length, D d_model, H heads, K kv heads, G heads
per kv head, E head_dim, N layers, S cache length.
"""

import jax
import jax.numpy as jnp
from flax import nnx, struct

from shardlab import parallel
from shardlab.parallel import REMAT_POLICIES, attend, constrain  # noqa: F401 (re-exported)

ACTIVATIONS = parallel.ACTIVATIONS
stacked_param = parallel.stacked_param


@struct.dataclass
class KVCache:
  """Keys and values of every layer for `index` tokens so far, in buffers of length S. A
  sliding-window layer's buffer is a ring (shardlab.parallel.attention.ring_attend):
  position p in slot p mod S, S = min(window, length), so it holds the last S entries.
  A model whose layers differ in window (Gemma's local and global layers) keeps its
  windowed layers' rings in a stack of their own, `local_*` (None otherwise), and the
  others, in order, in `k`/`v`."""
  k_NxBxSxKxE: jax.Array
  v_NxBxSxKxE: jax.Array
  index: jax.Array  # int32 scalar: the position the next token takes
  local_k_NxBxWxKxE: jax.Array | None = None
  local_v_NxBxWxKxE: jax.Array | None = None

  @classmethod
  def zeros(cls, n_layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
            dtype, local_layers: int = 0, window: int = 0) -> "KVCache":
    """`n_layers` buffers of `length`, and `local_layers` rings of ring_length(window,
    length) in the local stack (none: no local stack)."""
    stack = lambda n, s: jnp.zeros((n, batch, s, kv_heads, head_dim), dtype)
    w = ring_length(window, length)
    local = (stack(local_layers, w), stack(local_layers, w)) if local_layers else ()
    return cls(stack(n_layers, length), stack(n_layers, length), jnp.zeros((), jnp.int32),
               *local)


def ring_length(window: int | None, length: int) -> int:
  """The cache entries a layer with this window (0 or None: none) needs for `length`
  tokens: a ring of the window once the sequence is longer."""
  return min(window, length) if window else length


def causal_mask(length: int, cache: KVCache | None, start):
  """L×M: query i (at start + i) sees positions up to its own (all cached ones when M = S)."""
  return parallel.causal_mask(length, None if cache is None else cache.k_NxBxSxKxE.shape[2],
                              start)


class Block(nnx.Module):
  """One pre-norm layer: x + attn(attn_norm(x)), then + ffn(mlp_norm(x)). The attention takes
  the layer's extra inputs (position tables, mask, cache index, this layer's cache) and
  returns (output, updated cache)."""

  def __init__(self, attn_norm, attn, mlp_norm, mlp):
    self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

  FFN = "mlp"  # the feed-forward's attribute (a mixture of experts names its own)

  def __call__(self, x_BxLxD, *attn_inputs):
    """(x, updated cache), or (x, updated cache, stats) when the feed-forward returns
    (output, stats): a mixture of experts' router statistics."""
    y, cache_kv = self.attn(self.attn_norm(x_BxLxD), *attn_inputs)
    x = x_BxLxD + y
    y = getattr(self, self.FFN)(self.mlp_norm(x))
    if isinstance(y, tuple):
      y, stats = y
      return constrain(x + y, ACTIVATIONS["residual"]), cache_kv, stats
    return constrain(x + y, ACTIVATIONS["residual"]), cache_kv


def scan_blocks(blocks: nnx.Module, x_BxLxD, cache: KVCache | None, remat: str, *args,
                stats: dict | None = None, unroll: int = 1):
  """Applies the stacked `blocks` layer by layer (shardlab.parallel.scan: a lax.scan under
  the remat policy, `unroll` layers an iteration, or the pipeline schedule when the rules
  split `layers` over `stage`);
  each layer is called as block(x, *args, layer_kv) -> (x, layer_kv[, stats]). Returns (x,
  the cache's new key/value stacks or None), and the `stats` summed over layers when given."""
  cache_kv = None if cache is None else (cache.k_NxBxSxKxE, cache.v_NxBxSxKxE)

  def call(block, x, layer_args, layer_kv):
    out = block(x, *layer_args, layer_kv)
    return out if stats is not None else (*out, None)

  x, cache_kv, totals = parallel.scan(blocks, x_BxLxD, args, call, remat, cache_kv, stats,
                                      unroll)
  return (x, cache_kv) if stats is None else ((x, totals), cache_kv)


def token_layout(tokens_BxL, positions_BxL, cache: KVCache | None, segments_BxL, d_model: int):
  """(tokens, positions, doc, restore, start) as a decoder's layers read them: positions
  default to the ones after the cache's `start`; packed documents or a sequence split over
  `context` take the zig-zag layout — `doc` is then (positions, segment ids) for the masks
  and `restore` undoes the reordering on the output (otherwise None and the identity)."""
  b, l = tokens_BxL.shape
  start = 0 if cache is None else cache.index
  if positions_BxL is None:
    positions_BxL = jnp.broadcast_to(start + jnp.arange(l), (b, l))
  doc, restore = None, lambda x: x
  shape = (b, l, d_model)
  if cache is None and (segments_BxL is not None or parallel.is_context_parallel(shape)):
    if segments_BxL is None:
      segments_BxL = jnp.ones((b, l), jnp.int32)
    (tokens_BxL, positions_BxL, segments_BxL), restore = parallel.zigzag(
        shape, tokens_BxL, positions_BxL, segments_BxL)
    doc = (positions_BxL, segments_BxL)
  return tokens_BxL, positions_BxL, doc, restore, start


def call_block(block, x_BxLxD, *args):
  """One block without a cache, its output only: a pipeline_parts' layer call."""
  return block(x_BxLxD, *args, None)[0]


def logits(x_BxLxD, head_DxV):
  """fp32 logits B×L×V (fp32 accumulation of compute-dtype operands)."""
  out = parallel.einsum("bld,dv->blv", x_BxLxD, head_DxV, jnp.float32)
  return constrain(out, ACTIVATIONS["logits"])


def embed(table_VxD, tokens_BxL):
  # Look rows up where the table is stored (embed-sharded under FSDP): XLA gathers the token
  # ids and trades rows with one all-to-all, and the gradient is scattered into the local
  # shard, rather than gathering the V×D table and all-reducing a V×D gradient.
  x = jnp.take(table_VxD, tokens_BxL, axis=0)
  return constrain(x, ACTIVATIONS["residual"])
