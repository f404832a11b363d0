"""Sliding-window attention and logit soft-capping (shardlab.parallel.attention's `window`
and `softcap`) on every path: output and gradients w.r.t. q, k, v against a plain-jnp
reference written here (an explicit mask, tanh cap, softmax, autodiff; Hugging Face's
semantics: query i sees key j iff i - window < j <= i, scores scaled, then capped, then
masked), for the dense path, the CPU blockwise flash path, packed documents, context
parallelism (all-gather and ring) on the simulated mesh and a KV cache; cuDNN's and splash's
use of their kernels' options; the refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlab.parallel import context, flash, ring
from shardlab.parallel.attention import attend, attention, causal_mask
from shardlab.sharding import rules as rules_lib
from shardlab.sharding.activations import activation_rules

B, E = 2, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def inputs(l, h=4, kv=2, e=E, dtype=jnp.float32, seed=0):
  """q, k, v and an output cotangent (numpy's generator: no eager JAX op to compile)."""
  rng = np.random.default_rng(seed)
  shapes = ((B, l, h, e), (B, l, kv, e), (B, l, kv, e), (B, l, h, e))
  # Scores of a few units, so that a cap of 2-5 bends them and a window changes the result.
  scale = (2.0, 2.0, 1.0, 1.0)
  return tuple(jnp.asarray((s * rng.standard_normal(shape, np.float32)).astype(dtype))
               for s, shape in zip(scale, shapes))


def reference(q, k, v, positions=None, segments=None, window=None, softcap=None,
              causal=True):
  """Plain jnp, differentiated by autodiff: GQA by repeating kv heads (HF's repeat_kv), an
  explicit B×L×M mask from per-token positions and segments."""
  b, l, h, e = q.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(l), (b, l))
  if segments is None:
    segments = jnp.ones((b, l), jnp.int32)
  rep = h // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  s = jnp.einsum("blhe,bmhe->bhlm", q, k, precision="highest") / np.sqrt(e)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  qp, kp = positions[:, None, :, None], positions[:, None, None, :]
  seen = ((kp <= qp) | (not causal)) & (segments[:, None, :, None] == segments[:, None, None, :])
  if window is not None:
    seen &= kp > qp - window
  p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
  return jnp.einsum("bhlm,bmhe->blhe", p, v, precision="highest")


def with_grads(f):
  """Output and the vjp of a fixed cotangent w.r.t. q, k, v: one jitted program."""
  def run(q, k, v, cotangent):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cotangent)
  return jax.jit(run)


def assert_close(got, want, rtol=1e-5, atol=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=rtol, atol=atol)


def test_reference_follows_hugging_face():
  """window=1: a query sees only itself, so the output is its own value; window=2 on
  three tokens: the last one sees the last two (kv_idx > q_idx - window)."""
  q, k, v, _ = inputs(8)
  out = reference(q, k, v, window=1, softcap=3.0)
  np.testing.assert_allclose(out, jnp.repeat(v, 2, axis=2), rtol=1e-6)
  q, k, v = (x[:1, :3, :1] for x in (q, k, v))
  p_last = reference(q, k, jnp.eye(3)[None, :, None, :], window=2)[0, 2, 0]
  assert p_last[0] == 0 and p_last[1] > 0 and p_last[2] > 0


OPTIONS = [(None, None), (8, None), (None, 2.0), (5, 3.0)]


@pytest.mark.parametrize("window,softcap", OPTIONS)
def test_dense_path(window, softcap):
  args = inputs(32)
  f = functools.partial(attention, impl="xla", window=window, softcap=softcap)
  want = with_grads(functools.partial(reference, window=window, softcap=softcap))(*args)
  assert_close(with_grads(f)(*args), want)


def test_bidirectional_softcap():
  args = inputs(32)
  segments, _ = documents(32)
  f = functools.partial(attention, causal=False, segment_ids=segments, softcap=2.0)
  want = with_grads(functools.partial(reference, segments=segments, softcap=2.0,
                                      causal=False))(*args)
  assert_close(with_grads(f)(*args), want)


@pytest.mark.parametrize("length,block,window,softcap", [
    (60, 16, 5, None),    # L not a multiple of the block; window inside one block or two
    (60, 8, 17, 3.0),     # window spans 3 blocks, partly
    (64, 16, 16, None),   # window = block
    (64, 16, 1, 2.0),     # only the diagonal
    (60, 8, 100, None),   # window longer than L: plain causal
    (64, 512, 7, 2.0),    # one block of L
])
def test_blockwise_flash(length, block, window, softcap):
  args = inputs(length)
  f = functools.partial(flash.causal, platform="cpu", block=block, window=window,
                        softcap=softcap)
  want = with_grads(functools.partial(reference, window=window, softcap=softcap))(*args)
  assert_close(with_grads(f)(*args), want)


def test_flash_through_attention_and_attend():
  """impl="flash" on cpu reaches the blockwise kernel with both options."""
  args = inputs(48)
  f = functools.partial(attention, impl="flash", window=6, softcap=2.5)
  want = with_grads(functools.partial(reference, window=6, softcap=2.5))(*args)
  assert_close(with_grads(f)(*args), want)


def documents(l):
  """Three documents in row 0, two and padding (segment 0) in row 1; per-document
  positions."""
  cuts = ([1] * (l // 4) + [2] * (l // 2) + [3] * (l - 3 * l // 4),
          [1] * (l // 2 + 3) + [2] * (l // 4) + [0] * (l - 3 * l // 4 - 3))
  segments = jnp.asarray(np.array(cuts, np.int32))
  return segments, context.document_positions(segments)


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_packed_documents(impl):
  """The window runs on per-document positions: it restarts with each document."""
  args = inputs(64)
  segments, positions = documents(64)
  f = functools.partial(attention, segment_ids=segments, impl=impl, window=6, softcap=3.0)
  want = with_grads(functools.partial(reference, positions=positions, segments=segments,
                                      window=6, softcap=3.0))(*args)
  assert_close(with_grads(f)(*args), want)


@pytest.mark.parametrize("exchange,impl", [("all-gather", "xla"), ("all-gather", "flash"),
                                           ("ring", "xla")])
def test_context_parallel(monkeypatch, mesh, exchange, impl):
  """data:2 × context:4, the inputs in zig-zag order (as a model lays them out), packed
  documents; ring.py in tiles of 8 so its tile loops run."""
  monkeypatch.setattr(ring, "CHUNK", 8)
  l = 64
  q, k, v, do = inputs(l)
  segments, positions = documents(l)
  order = context.zigzag_order(l, 4)
  q, k, v, do, segments, positions = (x[:, order] for x in (q, k, v, do, segments, positions))
  mesh = mesh("data:2,context:4")
  options = dict(window=6, softcap=3.0)

  def cp(q, k, v):
    with activation_rules(mesh, rules_lib.strategy("dp")):
      return attention(q, k, v, segment_ids=segments, positions=positions, impl=impl,
                       kv_exchange=exchange, **options)

  got = with_grads(cp)(q, k, v, do)
  want = with_grads(functools.partial(reference, positions=positions, segments=segments,
                                      **options))(q, k, v, do)
  assert_close(got, want)


@pytest.mark.parametrize("window,softcap", [(5, 3.0), (None, 2.0)])
def test_kv_cache_prefill_then_decode(window, softcap):
  """attend with a cache of S = 24: a prefill of 23 tokens, then one decoded at position
  23, equal the whole sequence's attention (outputs, and gradients through both calls)."""
  s, prefill = 24, 23
  args = inputs(s)
  options = dict(window=window, softcap=softcap)

  def cached(q, k, v):
    cache = (jnp.zeros_like(k), jnp.zeros_like(v))
    first, cache = attend(q[:, :prefill], k[:, :prefill], v[:, :prefill],
                          causal_mask(prefill, s, 0), cache, 0, **options)
    last, _ = attend(q[:, prefill:], k[:, prefill:], v[:, prefill:],
                     causal_mask(1, s, prefill), cache, prefill, **options)
    return jnp.concatenate([first, last], axis=1)

  want = with_grads(functools.partial(reference, **options))(*args)
  assert_close(with_grads(cached)(*args), want)


def test_window_is_not_ignored():
  """A guard on the tests themselves: the windowed reference differs from plain causal by
  far more than the tolerance on these inputs."""
  q, k, v, _ = inputs(32)
  assert np.abs(reference(q, k, v, window=6) - reference(q, k, v)).max() > 0.1
  assert np.abs(reference(q, k, v, softcap=2.0) - reference(q, k, v)).max() > 0.1


# ---- the platform kernels ----------------------------------------------------------------

def test_gpu_window_maps_to_dot_product_attention(monkeypatch):
  """cuDNN's path with jax.nn.dot_product_attention's xla implementation standing in for
  cuDNN (same `local_window_size` argument): our (window - 1, 0) is HF's window."""
  real = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, **kw: real(*a, **{**kw, "implementation": "xla"}))
  args = inputs(32, dtype=jnp.bfloat16)
  got = with_grads(functools.partial(flash.causal, platform="gpu", window=6))(*args)
  want = with_grads(functools.partial(reference, window=6))(
      *(x.astype(jnp.float32) for x in args))
  assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_gpu_window_lowers_to_cudnn_sliding_window(monkeypatch):
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  loss = lambda q, k, v: flash.causal(q, k, v, platform="gpu", window=100).sum()
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = step.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text
  assert '\\22sliding_window_length\\22: 100' in text or '"sliding_window_length": 100' in text


@pytest.fixture
def splash_interpreted(monkeypatch):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  monkeypatch.setattr(sk, "make_splash_mha", functools.partial(sk.make_splash_mha,
                                                               interpret=True))


def test_tpu_splash_interpreted(splash_interpreted):
  """The splash kernel in Pallas interpret mode with LocalMask and its logit soft cap: L =
  200 padded to two blocks of 128, the window reaching into the block before."""
  args = inputs(200, h=2, kv=1, e=128)
  f = functools.partial(flash.causal, platform="tpu", block=128, window=70, softcap=4.0)
  want = with_grads(functools.partial(reference, window=70, softcap=4.0))(*args)
  assert_close(with_grads(f)(*args), want)


# ---- refusals ------------------------------------------------------------------------------

def test_refusals_name_the_argument():
  q, k, v, _ = inputs(16, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"softcap = 5\.0 .*'flash' on gpu.*cuDNN"):
    flash.causal(q, k, v, platform="gpu", softcap=5.0)
  with pytest.raises(ValueError, match=r"window = 4 needs causal=True"):
    attention(q, k, v, causal=False, window=4)
  for bad in (0, -3, 2.5, True, jnp.int32(4)):
    with pytest.raises(ValueError, match=r"attention window = .*valid: None .* int >= 1"):
      attention(q, k, v, window=bad)
  for bad in (0.0, -1.0, float("inf"), "50", jnp.float32(50.0)):
    with pytest.raises(ValueError, match=r"attention softcap = .*valid: None .* float > 0"):
      attend(q, k, v, causal_mask(16), softcap=bad)
