"""shardlab/parallel/dot.einsum: fp32 accumulation forward and backward, gradients in the operands'
dtype, equal to autodiff of the fp32 einsum."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlab.parallel import dot

SPECS = [("bld,df->blf", (2, 3, 8), (8, 5)), ("blhe,hed->bld", (2, 3, 4, 6), (4, 6, 8)),
         ("blkge,bmke->bkglm", (2, 5, 2, 3, 4), (2, 7, 2, 4))]


@pytest.mark.parametrize("spec, a_shape, b_shape", SPECS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 4e-2)])
def test_value_and_gradients_match_the_fp32_einsum(spec, a_shape, b_shape, dtype, tol):
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal(a_shape), dtype)
  b = jnp.asarray(rng.standard_normal(b_shape), dtype)
  f32 = lambda t: t.astype(jnp.float32)
  ours = lambda a, b: jnp.sum(jnp.sin(f32(dot.einsum(spec, a, b))))
  ref = lambda a, b: jnp.sum(jnp.sin(jnp.einsum(spec, f32(a), f32(b))))
  out, ref_out = f32(dot.einsum(spec, a, b)), jnp.einsum(spec, f32(a), f32(b))
  np.testing.assert_allclose(out, ref_out, atol=tol * float(jnp.max(jnp.abs(ref_out))))
  for g, r in zip(jax.grad(ours, (0, 1))(a, b), jax.grad(ref, (0, 1))(a, b)):
    assert g.dtype == dtype
    np.testing.assert_allclose(f32(g), r, atol=tol * float(jnp.max(jnp.abs(r))))


def _dots(fn, *args) -> list[str]:
  hlo = jax.jit(fn).lower(*args).as_text()
  return [l for l in hlo.splitlines() if "dot_general" in l and "=" in l]


@pytest.mark.parametrize("result", ["fp32", "output"])
def test_output_dtype_and_lowering(result, monkeypatch):
  monkeypatch.setenv("SHARDLAB_CPU_DOT", result)
  a = jnp.ones((4, 8), jnp.bfloat16)
  b = jnp.ones((8, 2), jnp.bfloat16)
  assert dot.einsum("ij,jk->ik", a, b).dtype == jnp.bfloat16
  assert dot.einsum("ij,jk->ik", a, b, jnp.float32).dtype == jnp.float32
  # Every dot of the step, forward and both gradients, multiplies bf16 by bf16: into fp32
  # (a CPU with native bf16), or into the output dtype, as on TPU (a CPU without).
  for copies, want in ((True, "f32" if result == "fp32" else "bf16"), (False, "f32")):
    grad = jax.grad(lambda a, b: jnp.sum(dot.einsum("ij,jk->ik", a, b, copies=copies)
                                         .astype(jnp.float32)), (0, 1))
    dots = _dots(grad, a, b)
    assert len(dots) == 2  # the forward dot is dead code under grad
    assert all("bf16>, tensor<" in l and f"x{want}>" in l.split("->")[-1] for l in dots), dots


def test_widened_operands_are_made_in_the_backward_pass(monkeypatch):
  """Where XLA:CPU widens bf16 operands to fp32 for every dot (the "output" path, a CPU
  without native bf16), the backward's operands are made from its cotangent (dot._after).
  Without that XLA widens each saved activation in the forward pass and holds the fp32 copy
  until the backward: measured 13.6 against 9.0 MiB of temporaries here, where the four
  saved MLP activations are 2 MiB in bf16. The gradients are the same to the bit."""
  monkeypatch.setenv("SHARDLAB_CPU_DOT", "output")

  def loss(ws, x):
    for w_in, w_out in ws:  # unrolled: each layer's activations are saved for its backward
      x = x + dot.einsum("bf,fd->bd", jax.nn.silu(dot.einsum("bd,df->bf", x, w_in)), w_out)
    return jnp.sum(x.astype(jnp.float32) ** 2)

  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
  ws, x = [(normal(256, 1024), normal(1024, 256)) for _ in range(4)], normal(256, 256)
  grad = jax.jit(jax.grad(loss))

  def temp_and_grads():
    return grad.lower(ws, x).compile().memory_analysis().temp_size_in_bytes, grad(ws, x)

  temp, grads = temp_and_grads()
  grad = jax.jit(jax.grad(loss))  # a fresh trace for the path switched off
  with mock.patch.object(dot, "_after", lambda g, *xs: xs):
    temp_off, grads_off = temp_and_grads()
  saved = 4 * 256 * 1024 * 2  # the MLP activations the backward reads, in bf16
  assert temp <= temp_off - saved, (temp, temp_off)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_off)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_cpu_result_detects_or_takes_the_override(monkeypatch):
  monkeypatch.delenv("SHARDLAB_CPU_DOT", raising=False)
  assert dot.cpu_result() == ("fp32" if dot._native_bf16() else "output")
  monkeypatch.setenv("SHARDLAB_CPU_DOT", "int8")
  with pytest.raises(ValueError, match="SHARDLAB_CPU_DOT='int8'; valid: fp32"):
    dot.cpu_result()


@pytest.mark.parametrize("spec, why", [("ii,ij->ij", "repeated index"),
                                       ("ij,jk->k", "appears nowhere else")])
def test_unsupported_specs_are_refused(spec, why):
  with pytest.raises(ValueError, match=why):
    dot.einsum(spec, jnp.ones((3, 3)), jnp.ones((3, 3)))
