"""shardlab/parallel/flash.py: the blockwise path against attention.attend (values and gradients), on a
sharded mesh, its memory; the TPU path run in Pallas interpret mode and compiled for a v5e
topology; the GPU path lowered to cuDNN's custom call."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import helpers as H
from shardlab.parallel import flash as attention
from shardlab.parallel.attention import attend, causal_mask
from shardlab.plan.compiled import aot
from shardlab.runtime import compile_only
from shardlab.sharding import rules as rules_lib
from shardlab.sharding.activations import activation_rules
from shardlab.testing import assert_collectives

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")


def inputs(b, l, h, kv, e, dtype, seed=0):
  """q, k, v and an output cotangent (numpy's generator: no eager JAX op to compile)."""
  rng = np.random.default_rng(seed)
  shapes = ((b, l, h, e), (b, l, kv, e), (b, l, kv, e), (b, l, h, e))
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
               for shape in shapes)


def reference(q, k, v):
  return attend(q, k, v, causal_mask(q.shape[1]))[0]


def with_grads(f):
  """Output and the vjp of a fixed cotangent w.r.t. q, k, v: one jitted program."""
  def run(q, k, v, cotangent):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cotangent)
  return jax.jit(run)


def assert_close(got, want, atol, rtol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=atol, rtol=rtol)


def test_resolve():
  assert attention.resolve("auto", "tpu") == attention.resolve("auto", "gpu") == "flash"
  assert attention.resolve("auto", "cpu") == "xla"
  assert attention.resolve("xla", "tpu") == "xla"
  assert attention.resolve("flash", "cpu") == "flash"
  with pytest.raises(ValueError, match=r"model.attention = 'fast'.*xla, flash, auto"):
    attention.resolve("fast", "cpu")


def test_shapes_are_checked():
  q, k, v, _ = inputs(1, 16, 3, 2, 8, jnp.float32)
  with pytest.raises(ValueError, match="K dividing H"):
    attention.causal(q, k, v, platform="cpu")


F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("dtype,heads,kv_heads,length,block", [
    (F32, 4, 2, 64, 16),  # L = 4 blocks
    (F32, 4, 4, 60, 16),  # MHA; L padded to a multiple of the block
    (F32, 4, 1, 32, 32),  # MQA; L == block
    (BF16, 4, 2, 64, 16),
    (BF16, 4, 4, 24, 512),  # a block longer than L: one block of L
])
def test_blockwise_matches_attend(dtype, heads, kv_heads, length, block):
  tol = 1e-5 if dtype == F32 else 3e-2
  args = inputs(2, length, heads, kv_heads, 16, dtype)
  got = with_grads(functools.partial(attention.causal, platform="cpu", block=block))(*args)
  want = with_grads(reference)(*args)
  assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])
  assert_close(got, want, atol=tol, rtol=tol)


def test_fp32_on_gpu_runs_blockwise():
  """cuDNN takes 16-bit inputs only: fp32 goes the blockwise way on every platform."""
  q, k, v, _ = inputs(1, 16, 2, 1, 8, jnp.float32)
  on = lambda platform: jax.jit(functools.partial(attention.causal, platform=platform))
  assert_close(on("gpu")(q, k, v), on("cpu")(q, k, v), 0, 0)


def test_sharded_blockwise_matches_one_device(mesh):
  """Batch over data and heads over tensor: the same numbers, and XLA partitions the block
  loops without a single collective."""
  mesh = mesh("data:4,tensor:2")
  args = inputs(4, 128, 4, 2, 16, jnp.float32)
  sharding = NamedSharding(mesh, P("data", None, "tensor"))
  flash = with_grads(functools.partial(attention.causal, platform="cpu", block=32))
  want = flash(*args)
  sharded = jax.jit(flash, in_shardings=(sharding,) * 4).lower(*args).compile()
  got = sharded(*jax.device_put(args, sharding))
  assert got[0].sharding.is_equivalent_to(sharding, 4)
  assert_close(got, want, atol=1e-6, rtol=1e-6)
  assert_collectives(sharded, mesh=mesh, forbid=COLLECTIVES)


def temp_bytes(f, length):
  q = jax.ShapeDtypeStruct((1, length, 2, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, length, 1, 64), jnp.bfloat16)
  loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return compile_only.compile_lowered(step.lower(q, k, k)).memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_length():
  """Forward + backward at L=4096: the xla path holds L×L scores and probabilities (~200
  MiB here), the blockwise one a few blocks."""
  flash = functools.partial(attention.causal, platform="cpu", block=512)
  xla_bytes, flash_bytes = temp_bytes(reference, 4096), temp_bytes(flash, 4096)
  assert xla_bytes > 2 * 4096**2 * 4, xla_bytes  # at least the fp32 scores of both heads
  assert flash_bytes * 10 < xla_bytes, (flash_bytes, xla_bytes)


@pytest.fixture
def splash_interpreted(monkeypatch):
  """The TPU path with the Pallas kernel interpreted on the CPU: slow, but the real kernel
  code and our scaling, layout and shard_map around it."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  monkeypatch.setattr(sk, "make_splash_mha", functools.partial(sk.make_splash_mha,
                                                               interpret=True))


def test_tpu_path_interpreted_matches_attend(splash_interpreted, mesh):
  """Under the rules of `tp` (batch over data, heads over tensor): in shard_map over the mesh,
  the kernel run per device on its examples and heads; L = 200 padded to two blocks of 128."""
  args = inputs(4, 200, 4, 2, 128, jnp.float32)
  want = with_grads(reference)(*args)
  mesh = mesh("data:2,tensor:2")
  tpu = with_grads(functools.partial(attention.causal, platform="tpu", block=128))
  with activation_rules(mesh, rules_lib.strategy("tp")):
    sharded = tpu(*args)
  assert sharded[0].sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "tensor")), 4)
  assert_close(sharded, want, atol=1e-5, rtol=1e-5)


def test_tpu_path_refuses_a_sharded_length(mesh):
  q, k, v, _ = inputs(2, 256, 4, 2, 128, jnp.bfloat16)
  rules = rules_lib.strategy("dp", {"activations": {"length": "tensor"}})
  with activation_rules(mesh("data:2,tensor:2"), rules):
    with pytest.raises(ValueError, match="whole sequences"):
      jax.eval_shape(functools.partial(attention.causal, platform="tpu"), q, k, v)


@pytest.mark.slow
@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_tpu_path_compiles_to_the_splash_kernel_for_v5e():
  """Forward + backward for 8 v5e chips (batch over data, heads over tensor), compiled by
  the real TPU compiler without a TPU: the Mosaic kernels are there (forward, dq, dkv) and
  nothing is gathered."""
  devices, _ = aot.tpu_devices("v5e", 8)
  from shardlab.sharding import mesh as mesh_lib
  mesh = mesh_lib.build(mesh_lib.load("data:4,tensor:2"), devices)
  sharding = NamedSharding(mesh, P("data", None, "tensor"))
  q = jax.ShapeDtypeStruct((8, 1024, 4, 128), jnp.bfloat16, sharding=sharding)
  k = jax.ShapeDtypeStruct((8, 1024, 2, 128), jnp.bfloat16, sharding=sharding)
  loss = lambda q, k, v: attention.causal(q, k, v, platform="tpu").astype(jnp.float32).sum()
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  with activation_rules(mesh, rules_lib.strategy("tp")):
    text = compile_only.compile_lowered(step.lower(q, k, k), "tpu").as_text()
  assert text.count("tpu_custom_call") >= 3, text.count("tpu_custom_call")
  assert "all-gather" not in text


def test_gpu_path_lowers_to_cudnn(monkeypatch):
  """Lowered (not compiled: that needs a GPU) for CUDA, with cuDNN's version check, which
  needs a GPU, stubbed: forward and backward are cuDNN's fused attention calls."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  loss = lambda q, k, v: attention.causal(q, k, v, platform="gpu").astype(jnp.float32).sum()
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  text = step.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text


def test_gpu_path_without_cudnn_fails_clearly():
  q, k, v, _ = inputs(1, 32, 2, 1, 8, jnp.bfloat16)
  with pytest.raises(RuntimeError, match="model.attention = 'flash' on gpu uses cuDNN"):
    attention.causal(q, k, v, platform="gpu")


@pytest.mark.parametrize("strategy", ["fsdp_tp", "tp"])
def test_flash_model_step_matches_xla_on_one_device(strategy):
  """model.attention = "flash" through the whole sharded model: loss and every gradient equal
  the plain attention's on one device."""
  flash = dataclasses.replace(H.MICRO, attention="flash")
  r = H.run(strategy, model=flash)
  ref = H.reference()
  loss, grads = r.value_and_grad(r.fresh_state(like=ref.init).params, r.batch(0))
  want_loss, want_grads = ref.value_and_grad(ref.init.params, ref.batch(0))
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  H.assert_trees_close(jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, want_grads),
                       rtol=1e-4, atol=1e-6, what=f"{strategy} flash grads")


def dense(scores: str):
  return lambda q, k, v: attend(q, k, v, causal_mask(q.shape[1]), scores=scores)[0]


def test_compute_dtype_scores_are_fp32_scores_at_fp32_and_close_at_bf16():
  """`scores="compute"` computes the scores and softmax in the inputs' dtype: with fp32
  inputs it is the default path bit for bit; with bf16 ones its outputs and gradients are
  within bf16's rounding of the fp32-scores path (measured: at most 0.031 on values of up
  to 6.6, two bf16 ulps there)."""
  for dtype, atol in ((jnp.float32, 0.0), (jnp.bfloat16, 0.0625)):
    q, k, v, cotangent = inputs(2, 256, 4, 2, 64, dtype)
    want = with_grads(dense("fp32"))(q, k, v, cotangent)
    got = with_grads(dense("compute"))(q, k, v, cotangent)
    assert_close(got, want, atol=atol, rtol=0)
  with pytest.raises(ValueError, match="attention scores 'bf16'; valid: fp32, compute"):
    attend(q, k, v, causal_mask(256), scores="bf16")


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_compute_dtype_scores_hold_a_third_of_the_score_bytes_on_tpu():
  """Forward + backward of 2048 tokens, 8 heads, bf16, compiled for one v5e chip: fp32
  scores hold 6 bytes a score at the peak (the fp32 scores or their gradient beside the
  bf16 probabilities), compute-dtype ones 2 (measured: 201.4 and 67.2 MB)."""
  devices, _ = aot.tpu_devices("v5e", 1)
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16, sharding=sharding)
  scores_bytes = 2048 * 2048 * 8

  def temp(scores):
    loss = lambda q, k, v: dense(scores)(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = compile_only.compile_lowered(step.lower(q, q, q), "tpu")
    return compiled.memory_analysis().temp_size_in_bytes

  fp32, compute = temp("fp32"), temp("compute")
  assert 6 * scores_bytes <= fp32 < 6.1 * scores_bytes, fp32 / scores_bytes
  assert 2 * scores_bytes <= compute < 2.1 * scores_bytes, compute / scores_bytes


@pytest.mark.parametrize("family", ["tiny", "gpt2-tiny", "mistral-tiny", "gemma2-tiny"])
def test_every_family_passes_its_attention_scores_setting_on(family):
  """A model built with attention_scores="compute" (llama's attention, GPT-2's, Mistral's
  windowed one and Gemma's soft-capped one) traces no fp32 L×L array in bf16, forward or
  backward; with the default it does (the scores)."""
  from flax import nnx
  from shardlab.errors import ConfigError
  from shardlab.models import registry
  length = 40  # no other dim of these models is 40 (head_dim, d_model: a false match)

  def fp32_square_arrays(scores: str) -> int:
    m = dataclasses.replace(registry.load(family), attention="xla", attention_scores=scores)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: m.make(nnx.Rngs(0), jnp.bfloat16)))
    tokens = jnp.zeros((1, length), jnp.int32)
    loss = lambda s: nnx.merge(graphdef, s)(tokens).astype(jnp.float32).sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
    avals = [v.aval for e in jaxpr.jaxpr.eqns for v in e.outvars]
    return sum(1 for a in avals if getattr(a, "shape", ())[-2:] == (length, length)
               and a.dtype == jnp.float32)

  assert fp32_square_arrays("fp32") > 0
  assert fp32_square_arrays("compute") == 0
  with pytest.raises(ConfigError, match="model.attention_scores 'bf16'"):
    dataclasses.replace(registry.load(family), attention_scores="bf16")
