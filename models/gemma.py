"""Gemma 2 and Gemma 3 (text) in Flax NNX: llama's projections with GeGLU, RMSNorm scaled by
(1 + w), embeddings scaled by √d, a norm before and after each sub-block, attention logit
soft-capping (Gemma 2) or q/k norms (Gemma 3), query scaling by query_pre_attn_scalar^-½, a
final-logit soft-cap, and local (sliding-window) layers between global ones.

The math is transformers' (models/gemma2, models/gemma3): norms compute in fp32 and multiply
by (1 + w) before casting back; the embedding scale is cast to the table's (compute) dtype;
scores are scaled, capped, then masked. The configs are in gemma_config.py.

Layers differ in their window, and the window is a static Python int (flash and splash build
their block masks from it; a traced per-layer window would leave only the dense path). So
the layers are scanned in groups of one period of the pattern (Gemma 2: local, global;
Gemma 3: five local, one global): each scan step runs the group's layers in order, each with
its own static window and rope tables. Parameters stay stacked per layer (N, ...), as
llama's, and are regrouped to (N/P, P, ...) at the call; a depth that is not a multiple of
the period scans its last (local) layers as one more, shorter group. The KV cache keeps
the local layers' rings of `window` entries and the global layers' whole-length buffers in
two stacks (decoder.KVCache's local_* and k/v); each layer gets its slice of its kind's.
Shape suffixes: B batch, L length, D d_model, H heads, E head_dim, F mlp, V vocab.
"""

import types

import jax
import jax.numpy as jnp
from flax import nnx

from shardlab import parallel
from shardlab.models import llama, rope
from shardlab.models.decoder import ACTIVATIONS, KVCache, causal_mask, embed, logits
from shardlab.models.decoder import token_layout
from shardlab.parallel import constrain, reduce_grads_early, stacked_param as _param


class GemmaNorm(nnx.Module):
  """RMSNorm whose scale is (1 + w), in fp32 (w is zero at init: the identity scale)."""

  def __init__(self, size: int, names: tuple, eps: float, dtype, rngs: nnx.Rngs, stack=()):
    self.scale = _param(rngs, (size,), names, "zeros", dtype, stack)
    self.eps = eps

  def __call__(self, x):
    return llama.rms_norm(x, 1.0 + self.scale[...].astype(jnp.float32), self.eps)


class GemmaAttention(llama.Attention):
  """llama's projections; q and k normed per head (Gemma 3), scores scaled by
  query_pre_attn_scalar^-½ and capped by attn_softcap (Gemma 2)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None, lora_rngs=None):
    super().__init__(cfg, dtype, rngs, stack, lora_cfg, lora_rngs)
    if cfg.qk_norm:
      self.q_norm, self.k_norm = (GemmaNorm(cfg.head_dim, ("head_dim",), cfg.norm_eps, dtype,
                                            rngs, stack) for _ in range(2))
    self.softcap = cfg.attn_softcap or None
    # The building block scales scores by E^-½; Gemma's scale is query_pre_attn_scalar^-½,
    # so q carries the ratio (1 when they are equal, as in the released 2B, 9B and 12B).
    self.q_scale = (cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5

  def project(self, target: str, x):
    y = super().project(target, x)
    norm = getattr(self, f"{target}_norm", None) if target in ("q", "k") else None
    return y if norm is None else norm(y)

  def __call__(self, x_BxLxD, cos, sin, mask_LxM, index, doc=None, cache_kv=None,
               window=None):
    q, k, v = (self.project(t, x_BxLxD) for t in ("q", "k", "v"))
    q = llama.apply_rope(q, cos, sin)
    if self.q_scale != 1.0:
      q = q * jnp.asarray(self.q_scale, q.dtype)
    out, cache_kv = parallel.attend(q, llama.apply_rope(k, cos, sin), v, mask_LxM, cache_kv,
                                    index, self.impl, doc, self.exchange, window=window,
                                    softcap=self.softcap, scores=self.scores)
    return self.project("o", out), cache_kv


# gelu_tanh(gate)·up with its gradient written out, as parallel.swiglu: the backward keeps
# gate and up only (autodiff kept seven fp32 B×L×F intermediates a layer, measured).
@jax.custom_vjp
def geglu(gate, up):
  return (_gelu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def _gelu(x):
  return jax.nn.gelu(x, approximate=True)


def _geglu_forward(gate, up):
  return geglu(gate, up), (gate, up)


def _geglu_backward(residuals, d_h):
  gate, up = residuals
  g, u, d = (t.astype(jnp.float32) for t in (gate, up, d_h))
  act, act_vjp = jax.vjp(_gelu, g)
  return act_vjp(d * u)[0].astype(gate.dtype), (d * act).astype(up.dtype)


geglu.defvjp(_geglu_forward, _geglu_backward)


class GeGLU(llama.MLP):
  """llama's gated MLP with tanh-approximate GELU on the gate (gelu_pytorch_tanh)."""

  def __call__(self, x_BxLxD):
    x, (w_gate, w_up) = reduce_grads_early(x_BxLxD, self.gate_DxF, self.up_DxF)
    gate, up = self.project("gate", x, w_gate), self.project("up", x, w_up)
    h_BxLxF = constrain(geglu(gate, up), ACTIVATIONS["mlp_hidden"])
    h_BxLxF, (w_down,) = reduce_grads_early(h_BxLxF, self.down_FxD)
    return self.project("down", h_BxLxF, w_down)

  def project(self, target: str, x, weight):
    return parallel.lora_project_target(llama.LORA_SPECS, self, target, x, weight)


class GemmaBlock(nnx.Module):
  """x + post_attn_norm(attn(attn_norm(x))), then + post_mlp_norm(mlp(mlp_norm(x)))."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, stack=(), lora_cfg=None):
    extra = ({} if lora_cfg is None else
             {"lora_cfg": lora_cfg, "lora_rngs": parallel.adapter_rngs(rngs)})
    norm = lambda: GemmaNorm(cfg.d_model, ("embed",), cfg.norm_eps, dtype, rngs, stack)
    self.attn_norm, self.attn = norm(), GemmaAttention(cfg, dtype, rngs, stack, **extra)
    self.post_attn_norm, self.mlp_norm = norm(), norm()
    self.mlp, self.post_mlp_norm = GeGLU(cfg, dtype, rngs, stack, **extra), norm()

  def __call__(self, x_BxLxD, cos, sin, mask_LxM, index, doc, layer_kv, window=None):
    y, layer_kv = self.attn(self.attn_norm(x_BxLxD), cos, sin, mask_LxM, index, doc,
                            layer_kv, window)
    x = x_BxLxD + self.post_attn_norm(y)
    x = x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
    return constrain(x, ACTIVATIONS["residual"]), layer_kv


def scan_pattern(blocks, x_BxLxD, stacks, remat: str, unroll: int, windows: tuple,
                 local_args: tuple, global_args: tuple):
  """The stacked `blocks` in groups of one period of `windows` (each layer's static window;
  None: a global layer), scanned over the groups; (x, the new key/value stacks or None).
  `stacks`: the cache's {"local": (k, v), "global": (k, v)}, each stack holding its kind's
  layers in order (a kind with no layer absent), or None without a cache."""
  n, period = jax.tree.leaves(nnx.state(blocks))[0].shape[0], len(windows)
  kinds = [_kind(windows[i % period]) for i in range(n)]
  full = n - n % period
  parts = [(0, full, windows), (full, n, windows[:n - full])]
  out = {kind: [] for kind in stacks or ()}
  for lo, hi, group in (p for p in parts if p[1] > p[0]):
    groups = (hi - lo) // len(group)
    regroup = lambda a, lo, hi: a[lo:hi].reshape(groups, -1, *a.shape[1:])
    graphdef, state = nnx.split(blocks)
    part = nnx.merge(graphdef, jax.tree.map(lambda a: regroup(a, lo, hi), state))
    kv = None
    if stacks is not None:  # each kind's layers of this part, (groups, per group, ...)
      span = {kind: (kinds[:lo].count(kind), kinds[:hi].count(kind)) for kind in stacks}
      kv = {kind: tuple(regroup(a, *span[kind]) for a in stack)
            for kind, stack in stacks.items() if span[kind][1] > span[kind][0]}
    x_BxLxD, kv, _ = parallel.scan(part, x_BxLxD, (local_args, global_args),
                                   _group_call(group), remat, kv, None,
                                   max(1, min(unroll // len(group), groups)))
    for kind, (k, v) in (kv or {}).items():
      out[kind].append(tuple(a.reshape(-1, *a.shape[2:]) for a in (k, v)))
  if stacks is None:
    return x_BxLxD, None
  join = lambda arrays: arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays)
  return x_BxLxD, {kind: tuple(map(join, zip(*pieces))) if pieces else stacks[kind]
                   for kind, pieces in out.items()}


def _kind(window) -> str:
  return "global" if window is None else "local"


def _group_call(windows: tuple):
  """parallel.scan's call for one group: its layers in order, each with its window and
  its slice of its kind's cache stack (local layers: rings of the window)."""

  def call(group, x_BxLxD, args, group_kv):
    graphdef, state = nnx.split(group)
    new = {kind: ([], []) for kind in group_kv or ()}
    for p, window in enumerate(windows):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[p], state))
      kind = _kind(window)
      layer_kv = None
      if group_kv is not None:  # this layer's place among its kind's layers of the group
        j = [_kind(w) for w in windows[:p]].count(kind)
        layer_kv = (group_kv[kind][0][j], group_kv[kind][1][j])
      x_BxLxD, layer_kv = layer(x_BxLxD, *args[window is None], layer_kv, window)
      if layer_kv is not None:
        new[kind][0].append(layer_kv[0])
        new[kind][1].append(layer_kv[1])
    stacked = {kind: (jnp.stack(k), jnp.stack(v)) for kind, (k, v) in new.items()}
    return x_BxLxD, stacked or None, None

  return call


class Gemma(nnx.Module):
  """Gemma 2 / Gemma 3 text decoder (gemma_config.py holds which). Same surface as
  models/llama.py's Llama: __call__, hidden, output_head, extend."""

  # The 1F1B schedule runs one stacked layer per call; these layers run in groups with
  # static windows, and the final soft-cap sits outside the head's matmul: gpipe only.
  pipeline_parts = None

  def __init__(self, cfg, rngs: nnx.Rngs, param_dtype=jnp.float32, remat: str = "none",
               lora_cfg=None, unroll: int = 1):
    self.cfg, self.remat, self.unroll = cfg, remat, unroll
    d, v = cfg.d_model, cfg.vocab_size
    self.embed_VxD = _param(rngs, (v, d), ("vocab", "embed"), d, param_dtype)
    self.blocks = GemmaBlock(cfg, param_dtype, rngs, (cfg.n_layers,), lora_cfg)
    self.final_norm = GemmaNorm(d, ("embed",), cfg.norm_eps, param_dtype, rngs)
    if not cfg.tie_embeddings:
      self.head_DxV = _param(rngs, (d, v), ("embed", "vocab"), d, param_dtype)
    # Read by the loss (models/lm.py): logits become cap·tanh(logits / cap).
    self.final_softcap = cfg.final_softcap or None

  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """fp32 logits B×L×V, soft-capped."""
    return self.capped(logits(self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL),
                              self.output_head()))

  def capped(self, logits_BxLxV):
    cap = self.final_softcap
    return logits_BxLxV if cap is None else cap * jnp.tanh(logits_BxLxV / cap)

  def hidden(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """The final-normed residual stream B×L×D (before the head and its soft-cap)."""
    return self._forward(tokens_BxL, positions_BxL, None, segment_ids_BxL)[0]

  def output_head(self):
    return self.embed_VxD[...].T if self.cfg.tie_embeddings else self.head_DxV[...]

  def extend(self, tokens_BxL, cache: KVCache):
    x, cache = self._forward(tokens_BxL, None, cache)
    return self.capped(logits(x, self.output_head())), cache

  def _forward(self, tokens_BxL, positions_BxL, cache: KVCache | None, segments_BxL=None):
    l = tokens_BxL.shape[1]
    tokens_BxL, positions_BxL, doc, restore, start = token_layout(
        tokens_BxL, positions_BxL, cache, segments_BxL, self.cfg.d_model)
    x = embed(self.embed_VxD[...], tokens_BxL)
    # √d in the table's (compute) dtype, as transformers casts it (bf16: 55.4256 → 55.5).
    x = x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype)
    mask = None if doc else causal_mask(l, cache, start)
    local, global_ = self._rope(positions_BxL)
    x, stacks = scan_pattern(self.blocks, x, _stacks(cache), self.remat, self.unroll,
                             self.cfg.layer_windows, (*local, mask, start, doc),
                             (*global_, mask, start, doc))
    x = restore(self.final_norm(x))
    if cache is None:
      return x, None
    global_kv = stacks.get("global", (cache.k_NxBxSxKxE, cache.v_NxBxSxKxE))
    return x, KVCache(*global_kv, start + l, *stacks.get("local", ()))

  def _rope(self, positions_BxL):
    """(cos, sin) of the local layers and of the global ones: Gemma 3's local layers have
    their own base (rope_local_theta) and no scaling; Gemma 2's share the global tables."""
    cfg = self.cfg
    global_ = llama.rope_tables(positions_BxL, cfg.head_dim, cfg.rope_theta,
                                rope.inverse_frequencies(cfg))
    if not cfg.rope_local_theta:
      return global_, global_
    local = types.SimpleNamespace(head_dim=cfg.head_dim, rope_theta=cfg.rope_local_theta)
    return llama.rope_tables(positions_BxL, cfg.head_dim, cfg.rope_local_theta,
                             rope.inverse_frequencies(local)), global_


def _stacks(cache: KVCache | None):
  """scan_pattern's view of the cache: the global layers' buffers (when there are any) and
  the local layers' rings (init_cache in gemma_config.py)."""
  if cache is None:
    return None
  stacks = {}
  if cache.k_NxBxSxKxE.shape[0]:
    stacks["global"] = (cache.k_NxBxSxKxE, cache.v_NxBxSxKxE)
  if cache.local_k_NxBxWxKxE is not None:
    stacks["local"] = (cache.local_k_NxBxWxKxE, cache.local_v_NxBxWxKxE)
  return stacks
