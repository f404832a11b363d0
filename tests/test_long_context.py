"""Long context: document masks, context parallelism (all-gather and ring KV exchange) and
Megatron sequence parallelism compute what one device computes (loss, gradients, three AdamW
steps) on the tiny model at 1024 tokens with packed documents; a document never sees another;
ring attention's collectives; activation bytes per device as the context axis grows."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.parallel import context
from shardlab.observe import hlo, hlo_groups
from shardlab.runtime import compile_only
from shardlab.sharding.activations import activation_rules

SEQ, BATCH, STEPS = 1024, 4, 3
TINY = dataclasses.replace(registry.load("tiny"), max_seq_len=SEQ)
FP32 = dict(rtol=1e-5, scaled_atol=1e-5)
# Adam's m/sqrt(v) turns the rounding difference of a near-zero gradient into a step of full
# size (test_parity.py); here 2 of 196608 elements of down_FxD moved 4e-5 of the leaf's scale.
FP32_ADAM = dict(rtol=1e-5, scaled_atol=1e-4)


def packed(seed: int = 0, length: int = SEQ, rows: int = BATCH) -> dict:
  """Token rows of several documents each (lengths 1..L/2), the last row ending in padding
  (segment 0); positions are left to the loss to derive."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (rows, length + 1), dtype=np.int32)
  segments = np.zeros((rows, length + 1), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, length), 3 + r, replace=False))
    segments[r] = 1 + np.searchsorted(cuts, np.arange(length + 1), side="right")
  segments[-1, -length // 8:] = 0
  return {"tokens": tokens, "segment_ids": segments}


def tiny(**model) -> object:
  return dataclasses.replace(TINY, **model)


def run(strategy, mesh, **model) -> H.Run:
  return H.run(strategy, mesh, model=tiny(**model), seq_len=SEQ, global_batch=BATCH)


def numpy(tree):
  return jax.tree.map(np.asarray, tree)


@functools.cache
def init():
  return numpy(run("dp", "data:1").init)


@functools.cache
def results(strategy: str, mesh: str, exchange: str = "all-gather", impl: str = "xla"):
  """(optimizer state after the first step, per-step metrics, final state) on the host.
  The schedule's first step has lr 0, so after it AdamW's moments hold exactly the (clipped)
  gradients of the first batch: mu = (1 - b1)·g, nu = (1 - b2)·g². One compiled program
  per case gives the loss, the gradients and three steps."""
  r = run(strategy, mesh, kv_exchange=exchange, attention=impl)
  state, history = r.fresh_state(like=init()), []
  for i in range(STEPS):
    state, metrics = r.train_step(state, jax.device_put(packed(i), r.sh.batch))
    history.append({k: float(v) for k, v in metrics.items()})
    if i == 0:
      first = numpy(state.opt_state)
  return first, history, numpy(state)


CASES = [  # strategy, mesh, kv exchange, model.attention
    ("dp", "context:8", "all-gather", "xla"),
    ("dp", "context:8", "ring", "xla"),
    ("fsdp_tp", "fsdp:2,context:2,tensor:2", "all-gather", "flash"),
    ("fsdp_tp", "fsdp:2,context:2,tensor:2", "ring", "flash"),
    ("tp_sp", "data:4,tensor:2", "all-gather", "xla"),
    ("fsdp_tp_sp", "fsdp:2,context:2,tensor:2", "ring", "xla"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_matches_one_device(case):
  first, history, state = results(*case)
  want_first, want_history, want_state = results("dp", "data:1")
  assert want_history[0]["lr"] == 0 and want_history[-1]["lr"] > 0
  H.assert_trees_close(first, want_first, what=f"{case} gradients (first moments)", **FP32)
  for got, want in zip(history, want_history):
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{case} {key}")
  H.assert_trees_close(state.params, want_state.params, what=f"{case} params", **FP32_ADAM)
  assert want_history[-1]["loss"] < want_history[0]["loss"]


# ---- documents -----------------------------------------------------------------------

def _doc_logits(mesh: str | None, exchange: str, tokens, positions, segments):
  model = tiny(kv_exchange=exchange, max_seq_len=64)
  r = H.run("dp", mesh or "data:1", model=model, seq_len=64, global_batch=2)
  params = r.fresh_state().params

  @jax.jit
  def logits(params, tokens, positions, segments):
    with activation_rules(r.mesh, r.rules):
      return H.state_lib.model(r.abstract, params)(tokens, positions, segments)

  return np.asarray(logits(params, tokens, positions, segments))


@pytest.mark.parametrize("mesh,exchange", [(None, "ring"), ("data:2,context:4", "ring"),
                                           ("data:2,context:4", "all-gather")])
def test_a_document_never_sees_another(mesh, exchange):
  """Row 0 holds documents x (24 tokens) and y; row 1 holds z (16), then the same x, then
  padding. x's logits are the same in both rows (attention stops at the boundary and RoPE
  restarts), and changing y changes y's logits but not x's."""
  rng = np.random.default_rng(0)
  x, y, z = (rng.integers(0, 256, n, dtype=np.int32) for n in (24, 40, 16))
  tokens = np.stack([np.concatenate([x, y]), np.concatenate([z, x, np.zeros(24, np.int32)])])
  segments = np.array([[1] * 24 + [2] * 40, [1] * 16 + [2] * 24 + [0] * 24], np.int32)
  positions = np.asarray(context.document_positions(jnp.asarray(segments)))
  assert positions[1, 16] == 0 and positions[1, 39] == 23
  logits = _doc_logits(mesh, exchange, tokens, positions, segments)
  np.testing.assert_allclose(logits[0, :24], logits[1, 16:40], rtol=1e-5, atol=1e-5)
  changed = tokens.copy()
  changed[0, 24:] = rng.integers(0, 256, 40)
  again = _doc_logits(mesh, exchange, changed, positions, segments)
  np.testing.assert_allclose(again[0, :24], logits[0, :24], rtol=1e-6, atol=1e-6)
  assert np.abs(again[0, 24:] - logits[0, 24:]).max() > 1e-2


def test_bad_kv_exchange_names_the_field_and_choices():
  with pytest.raises(ConfigError, match=r"model.kv_exchange.*'ringg'.*all-gather.*ring"):
    tiny(kv_exchange="ringg")


def test_zigzag_layout_and_its_length_check():
  assert context.zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
  with pytest.raises(ConfigError, match=r"train.seq_len \(12\).*2 × the context-parallel "
                                      r"degree \(4\)"):
    context.zigzag_order(12, 4)


# ---- compiled ------------------------------------------------------------------------

def _compiled_text(strategy, mesh, exchange):
  r = run(strategy, mesh, kv_exchange=exchange)
  state = H.state_lib.placed(r.abstract.state, r.sh.state)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=r.sh.batch),
                       packed())
  return r.mesh, compile_only.compile_lowered(r.train_step.lower(state, batch)).as_text()


@pytest.mark.parametrize("exchange", ["ring", "all-gather"])
def test_ring_permutes_over_context_and_gathers_no_kv(exchange):
  mesh, text = _compiled_text("fsdp_tp", "fsdp:2,context:2,tensor:2", exchange)
  ops = hlo.collective_ops(text)
  axes = lambda op: hlo_groups.mesh_axes(op.groups, mesh)
  # A K or V block: local batch 2 (fsdp), 1 kv head (tensor), half the sequence (context).
  block = (BATCH // 2, TINY.n_kv_heads // 2, SEQ // 2, TINY.head_dim)
  permutes = [op for op in ops if op.op == "collective-permute" and block in op.shapes]
  # Gathers of the sequence over context (FSDP also gathers the weights over fsdp × context).
  context_gathers = [op for op in ops if op.op == "all-gather" and "context" in axes(op) and
                     any(SEQ in shape for shape in op.shapes)]
  if exchange == "ring":  # forward: k, v; backward: k, v and their gradients
    assert len(permutes) >= 4 and all(axes(op) == ("context",) for op in permutes)
    assert not context_gathers, [(op.shapes, axes(op)) for op in context_gathers]
  else:  # the other mode gathers K and V (and their positions, segments) over context
    assert not permutes
    kv_shape = (BATCH // 2, SEQ, TINY.n_kv_heads // 2, TINY.head_dim)
    assert any(kv_shape in op.shapes for op in context_gathers), [op.shapes for op in ops]


# ---- the kernel's tiles --------------------------------------------------------------

@pytest.mark.parametrize("mesh,exchange", [(None, "ring"), ("data:2,context:4", "ring"),
                                           ("data:2,context:4", "all-gather")])
def test_tiled_kernel_matches_dense_attention(monkeypatch, mesh, exchange):
  """ring.py in tiles of 16 (queries and keys) on 128 zig-zag-ordered tokens of packed
  documents, GQA (4 heads, 2 kv heads): output and gradients equal decoder's dense masked
  softmax."""
  from shardlab.parallel import ring
  from shardlab.parallel.softmax import softmax_attention
  monkeypatch.setattr(ring, "CHUNK", 16)
  rng = np.random.default_rng(0)
  b, l = 2, 128
  q, do = (jnp.asarray(rng.standard_normal((b, l, 4, 16), np.float32)) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((b, l, 2, 16), np.float32)) for _ in range(2))
  segments = jnp.asarray(np.repeat([[1, 2, 3, 3], [1, 1, 2, 0]], l // 4, axis=1), jnp.int32)
  positions = context.document_positions(segments)
  order = context.zigzag_order(l, 4)
  q, do, k, v, positions, segments = (x[:, order] for x in (q, do, k, v, positions, segments))
  impl = dict(impl="flash", exchange=exchange, dense=softmax_attention,
              platform="cpu")
  r = H.run("dp", mesh or "data:1", model=tiny(max_seq_len=l), seq_len=l, global_batch=b)

  def attend(q, k, v):
    with activation_rules(r.mesh, r.rules):
      return context.attend(q, k, v, positions, segments, **impl)

  def dense(q, k, v):
    out = softmax_attention(q.reshape(b, l, 2, 2, 16), k, v, ring_mask())
    return out.reshape(b, l, 4, 16)

  ring_mask = lambda: ring.mask(positions, segments, positions, segments)
  got = jax.jit(lambda *a: jax.vjp(attend, *a)[1](do) + (attend(*a),))(q, k, v)
  want = jax.jit(lambda *a: jax.vjp(dense, *a)[1](do) + (dense(*a),))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
