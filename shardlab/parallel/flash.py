"""Causal grouped-query attention without the L×L score matrix, one implementation per
platform behind `model.attention`:

  cpu (and the fallback)  blockwise pure JAX (FlashAttention-2: an online softmax over key
                          blocks forward, a custom VJP that recomputes each block's
                          probabilities from the output's log-sum-exp backward), O(L·block)
  gpu                     cuDNN's fused attention (jax.nn.dot_product_attention)
  tpu                     the Pallas splash-attention kernel, under shard_map

Same contract as parallel/attention.py: query head i uses kv head i // G, scores scaled by
E^-0.5 and softmax statistics in fp32, output in q's dtype; `window` (a sliding window of
that many keys, the query's own included) and `softcap` (Gemma 2's tanh logit cap) as
`check_options` describes. cuDNN refuses `softcap`.

Shape suffixes: B batch, L length, H heads, K kv heads, G heads per kv head, E head_dim,
N blocks, C block length.
"""

import functools
import numbers
from math import inf

import jax
import jax.numpy as jnp

from shardlab.parallel.names import KEYS_VALUES, QUERIES
from shardlab.parallel.softmax import cap, cap_grad
from shardlab.sharding import activations

IMPLEMENTATIONS = ("xla", "flash", "auto")
F32 = jnp.float32


def resolve(impl: str, platform: str) -> str:
  """"auto" -> "flash" on tpu and gpu, "xla" on cpu; "xla" and "flash" as given."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention = {impl!r}; valid: {', '.join(IMPLEMENTATIONS)}")
  if impl == "auto":
    return "flash" if platform in ("tpu", "gpu") else "xla"
  return impl


def check_options(window, softcap):
  """`window`: None or an int >= 1, the number of keys a query sees, its own included
  (query i sees key j iff i - window < j <= i). `softcap`: None or a float > 0. Both are
  static (they shape the masks and the block loops), so Python numbers, not arrays."""
  if window is not None and (isinstance(window, bool) or
                             not isinstance(window, numbers.Integral) or window < 1):
    raise ValueError(f"attention window = {window!r}; valid: None (no window) or a Python "
                     f"int >= 1 (the keys a query sees, its own included)")
  if softcap is not None and (isinstance(softcap, bool) or
                              not isinstance(softcap, numbers.Real) or not 0 < softcap < inf):
    raise ValueError(f"attention softcap = {softcap!r}; valid: None (no cap) or a Python "
                     f"float > 0 (scores become softcap·tanh(scores/softcap))")


def causal(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, platform: str | None = None, block: int = 512,
           *, window: int | None = None, softcap: float | None = None):
  """Memory-efficient causal GQA attention for `platform` (default: jax.default_backend()),
  numerics as attention.attend's: output in q's dtype, softmax statistics in fp32. `block` is
  the query/key block length (capped at L); `window`, `softcap`: `check_options`."""
  h, kv = q_BxLxHxE.shape[2], k_BxLxKxE.shape[2]
  if h % kv or k_BxLxKxE.shape != v_BxLxKxE.shape or q_BxLxHxE.shape[:2] != k_BxLxKxE.shape[:2]:
    raise ValueError(f"causal attention: q {q_BxLxHxE.shape}, k {k_BxLxKxE.shape}, "
                     f"v {v_BxLxKxE.shape}: want B×L×H×E and B×L×K×E with K dividing H")
  check_options(window, softcap)
  platform = platform or jax.default_backend()
  if platform == "tpu":
    return _splash(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, block, window, softcap)
  # cuDNN's fused kernel takes fp16/bf16 only; fp32 runs blockwise (still O(L) memory).
  if platform == "gpu" and q_BxLxHxE.dtype in (jnp.bfloat16, jnp.float16):
    return _cudnn(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, window, softcap)
  return blockwise(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, block, window, softcap)


# -- cpu: blockwise pure JAX ---------------------------------------------------------------

def blockwise(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, block: int = 512, window: int | None = None,
              softcap: float | None = None):
  """The pure-JAX path on any platform. L is padded at the end to a multiple of the block:
  causally no real query sees a padded key, and padded query rows are cut off."""
  b, l, h, e = q_BxLxHxE.shape
  kv = k_BxLxKxE.shape[2]
  c = min(block, l)
  pad = -l % c
  dt = q_BxLxHxE.dtype
  # Head-major, so a block is a slice of one axis and every dot has leading batch dims; keys
  # as E×L, since XLA:CPU runs q·kᵀ 2-3× slower with both operands E-minor.
  q = q_BxLxHxE.reshape(b, l, kv, h // kv, e).transpose(0, 2, 3, 1, 4)
  k = k_BxLxKxE.astype(dt).transpose(0, 2, 3, 1)
  v = v_BxLxKxE.astype(dt).transpose(0, 2, 1, 3)
  if pad:
    q = jnp.pad(q, ((0, 0),) * 3 + ((0, pad), (0, 0)))
    k = jnp.pad(k, ((0, 0),) * 3 + ((0, pad),))
    v = jnp.pad(v, ((0, 0),) * 2 + ((0, pad), (0, 0)))
  out_BxKxGxLxE = _flash(c, window, softcap, q, k, v)[..., :l, :]
  return out_BxKxGxLxE.transpose(0, 3, 1, 2, 4).reshape(b, l, h, e)


def _block(x, i, c, axis):
  return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis)


def _unblock(x_Nx, axis):
  """N stacked blocks (leading) back into the length axis `axis` (counted without N)."""
  x = jnp.moveaxis(x_Nx, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _reach(window: int, c: int) -> int:
  """How many blocks before its own a query block's window can reach into: a query sees
  keys up to window - 1 positions back."""
  return (window + c - 2) // c


def _offset(window, i, j, c: int):
  """How many positions key block j starts before query block i; only the window needs it
  (and without one, a loop that never reads i need not carry it)."""
  return 0 if window is None else (i - j) * c


def _scores(q_BxKxGxCxE, k_BxKxExC, diagonal: bool, window=None, softcap=None, offset=0):
  """fp32 scaled (then capped) scores of one block pair and the uncapped ones; keys after the
  query (on the diagonal) and, with a window, `window` or more positions before it are -inf.
  `offset`: how many positions the key block starts before the query block."""
  raw = jnp.einsum("bkgqe,bkem->bkgqm", q_BxKxGxCxE, k_BxKxExC, preferred_element_type=F32)
  raw = raw * q_BxKxGxCxE.shape[-1] ** -0.5
  s, c = cap(raw, softcap), raw.shape[-1]
  seen = jnp.tril(jnp.ones((c, c), bool)) if diagonal else None
  if window is not None:  # query a at offset + a, key b at b (relative to the key block)
    near = offset + jnp.arange(c)[:, None] - jnp.arange(c)[None, :] < window
    seen = near if seen is None else seen & near
  if seen is not None:
    s = jnp.where(seen, s, -jnp.inf)
  return s, raw


def _online_step(carry, q_i, k_j, v_j, diagonal: bool, window, softcap, offset=0):
  """Folds one key block into the running max, sum and unnormalised output (all fp32)."""
  m, total, acc = carry
  s = _scores(q_i, k_j, diagonal, window, softcap, offset)[0]
  m_new = jnp.maximum(m, s.max(-1))
  m_exp = m_new
  if window is not None:  # a row may have seen no key yet: exp(-inf - -inf) would be nan
    m_exp = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.exp(s - m_exp[..., None])
  alpha = jnp.exp(m - m_exp)  # 0 at the first block (m = -inf)
  total = total * alpha + p.sum(-1)
  pv = jnp.einsum("bkgqm,bkme->bkgqe", p.astype(v_j.dtype), v_j, preferred_element_type=F32)
  return m_new, total, acc * alpha[..., None] + pv


def _forward(c, window, softcap, q, k, v):
  """Output (q's dtype) and log-sum-exp (fp32) per query row. Query block i visits key
  blocks 0..i-1 (with a window, the last few of them) unmasked but for the window, in a
  loop with dynamic bounds, then its diagonal block masked: the blocks above the diagonal
  (and behind the window) cost nothing."""
  n = q.shape[3] // c

  def query_block(i):
    q_i = _block(q, i, c, 3)
    init = (jnp.full(q_i.shape[:-1], -jnp.inf, F32), jnp.zeros(q_i.shape[:-1], F32),
            jnp.zeros(q_i.shape, F32))
    first = 0 if window is None else jnp.maximum(0, i - _reach(window, c))
    off = jax.lax.fori_loop(first, i, lambda j, carry: _online_step(
        carry, q_i, _block(k, j, c, 3), _block(v, j, c, 2), False, window, softcap,
        _offset(window, i, j, c)), init)
    m, total, acc = _online_step(off, q_i, _block(k, i, c, 3), _block(v, i, c, 2), True,
                                 window, softcap)
    return (acc / total[..., None]).astype(q.dtype), m + jnp.log(total)

  out, lse = jax.lax.map(query_block, jnp.arange(n))
  return _unblock(out, 3), _unblock(lse, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(c, window, softcap, q_BxKxGxLxE, k_BxKxExL, v_BxKxLxE):
  return _forward(c, window, softcap, q_BxKxGxLxE, k_BxKxExL, v_BxKxLxE)[0]


def _flash_fwd(c, window, softcap, q, k, v):
  out, lse = _forward(c, window, softcap, q, k, v)
  return out, (q, k, v, out, lse)


def _pair_grads(carry, i, j, k_j, v_j, saved, c, diagonal: bool, window, softcap):
  """Adds query block i's share to dq (all rows) and to key block j's dkᵀ, dvᵀ (fp32)."""
  dq, dk, dv = carry
  q, do, lse, delta = saved
  q_i, do_i = _block(q, i, c, 3), _block(do, i, c, 3)
  s, raw = _scores(q_i, k_j, diagonal, window, softcap, _offset(window, i, j, c))
  p = jnp.exp(s - _block(lse, i, c, 3)[..., None])
  dp = jnp.einsum("bkgqe,bkem->bkgqm", do_i, v_j, preferred_element_type=F32)
  # d(scores) through the cap, times the scale: the gradient w.r.t. the raw q·k products.
  ds = cap_grad(p * (dp - _block(delta, i, c, 3)[..., None]), raw, softcap)
  ds = (ds * q.shape[-1] ** -0.5).astype(q.dtype)
  # E×C outputs: XLA:CPU's fast form of a product summed over (g, q).
  dv = dv + jnp.einsum("bkgqm,bkgqe->bkem", p.astype(q.dtype), do_i, preferred_element_type=F32)
  dk = dk + jnp.einsum("bkgqm,bkgqe->bkem", ds, q_i, preferred_element_type=F32)
  dq_i = jnp.einsum("bkgqm,bkem->bkgqe", ds, k_j, preferred_element_type=F32)
  dq = jax.lax.dynamic_update_slice_in_dim(dq, _block(dq, i, c, 3) + dq_i, i * c, 3)
  return dq, dk, dv


def _flash_bwd(c, window, softcap, residuals, do):
  """FlashAttention-2's backward, one pass: key block j visits query blocks j..N-1 (its
  diagonal masked; with a window, only those whose window reaches back to it), recomputing
  p = exp(s - lse); dk, dv build up per key block and dq across them. Five block matmuls
  per pair, no L×L array."""
  q, k, v, out, lse = residuals
  n = q.shape[3] // c
  v = v.swapaxes(2, 3)  # E×L, like k: both are the right operand of a C×E · E×C product
  delta = jnp.sum(do.astype(F32) * out.astype(F32), -1)  # rowsum(dO·O) = Σ_m p·dp
  saved = (q, do.astype(q.dtype), lse, delta)
  grads = functools.partial(_pair_grads, saved=saved, c=c, window=window, softcap=softcap)

  def key_block(dq, j):
    k_j, v_j = _block(k, j, c, 3), _block(v, j, c, 3)
    zeros = jnp.zeros(k_j.shape, F32)
    diag = grads((dq, zeros, zeros), j, j, k_j, v_j, diagonal=True)
    end = n if window is None else jnp.minimum(n, j + 1 + _reach(window, c))
    dq, dk, dv = jax.lax.fori_loop(j + 1, end, lambda i, carry: grads(
        carry, i, j, k_j, v_j, diagonal=False), diag)
    return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, F32), jnp.arange(n))
  return dq.astype(q.dtype), _unblock(dk, 3), _unblock(dv, 3).swapaxes(2, 3)


_flash.defvjp(_flash_fwd, _flash_bwd)


# -- gpu: cuDNN --------------------------------------------------------------------------

def _cudnn(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, window=None, softcap=None):
  if softcap is not None:
    raise ValueError(f"attention softcap = {softcap!r} is not supported by model.attention = "
                     f"'flash' on gpu (cuDNN's fused attention has no logit soft-capping); "
                     f"use model.attention = 'xla', or fp32 inputs (the blockwise path)")
  # (left, right) = (window - 1, 0): query i sees keys i - window + 1 .. i, which cuDNN
  # runs as its sliding_window_length = window, the window (i - window, i].
  local = None if window is None else (window - 1, 0)
  try:
    return jax.nn.dot_product_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, is_causal=True,
                                        local_window_size=local, implementation="cudnn")
  except RuntimeError as e:  # e.g. "cuDNN is not detected." on a host without a GPU
    raise RuntimeError(f"model.attention = 'flash' on gpu uses cuDNN's fused attention, which "
                       f"failed here (backend {jax.default_backend()}): {e}") from e


# -- tpu: Pallas splash attention ---------------------------------------------------------

def _splash(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, block: int, window=None, softcap=None):
  """Splash attention per device: the Mosaic kernel cannot be partitioned by XLA, so under
  `activation_rules` it runs in shard_map over the mesh with the specs `constrain` uses."""
  kernel = functools.partial(_splash_local, block=block, window=window, softcap=softcap)
  where = activations.current(QUERIES, q_BxLxHxE.shape)
  if where is None:
    return kernel(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)
  mesh, q_spec = where
  kv_spec = activations.current(KEYS_VALUES, k_BxLxKxE.shape)[1]
  if len(q_spec) > 1 and q_spec[1] is not None:
    raise ValueError(f"flash attention on tpu needs whole sequences per device; the rules "
                     f"shard `length` over {q_spec[1]!r}")
  return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                       out_specs=q_spec, check_vma=False)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)


def _splash_local(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, block: int, window=None, softcap=None):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)

  _, l, h, e = q_BxLxHxE.shape
  # Blocks are multiples of the 128 lanes; L is padded at the end as in `blockwise`.
  c = min(block, -(-l // 128) * 128)
  padded = -(-l // c) * c
  sizes = splash.BlockSizes(block_q=c, block_kv=c, block_kv_compute=c, block_q_dkv=c,
                            block_kv_dkv=c, block_kv_dkv_compute=c, block_q_dq=c,
                            block_kv_dq=c)
  one = masks.CausalMask((padded, padded))
  if window is not None:  # query i sees keys i - (window - 1) .. i + 0: causal and windowed
    one = masks.LocalMask((padded, padded), window_size=(window - 1, 0), offset=0)
  # The kernel caps q·k of the pre-scaled queries: the scaled scores, as the other paths do.
  kernel = splash.make_splash_mha(masks.MultiHeadMask([one] * h), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap)
  # The kernel takes one example, H×L×E, and applies no scale.
  q = (q_BxLxHxE * e**-0.5).astype(q_BxLxHxE.dtype)
  q, k, v = (jnp.pad(x.astype(q.dtype), ((0, 0), (0, padded - l), (0, 0), (0, 0)))
             .transpose(0, 2, 1, 3) for x in (q, k_BxLxKxE, v_BxLxKxE))
  return jax.vmap(kernel)(q, k, v)[:, :, :l].transpose(0, 2, 1, 3)
