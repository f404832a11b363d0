"""shardlab/parallel/dot.einsum: fp32 accumulation forward and backward, gradients in the operands'
dtype, equal to autodiff of the fp32 einsum."""

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
