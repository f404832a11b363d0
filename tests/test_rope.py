"""models/llama.py's rotary embedding (every bundled family's): its values and gradients
against a float64 complex rotation, bit for bit the formula rotated in fp32, and on a TPU
compile no fp32 copy of the rotated halves in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlab.models import llama
from shardlab.observe import hlo_cycles, hlo_text
from shardlab.plan.compiled import aot
from shardlab.runtime import compile_only

THETA = 10000.0


def _rotated_in_fp32(x, cos, sin):
  """The formula as first written: x widened to fp32 before its halves are swapped. The
  control that shows what the TPU test looks for."""
  xf = x.astype(jnp.float32)
  half = xf.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def _complex_rotation(x, cos, sin, sign=1.0):
  """float64 reference: each pair (i, i + E/2) as a complex number times cos ± i·sin, the
  tables' own values (their fp32 angles at position 5,000 differ from numpy's by ~5e-4 rad,
  one ulp of a frequency times the position), so what is compared is the rotation."""
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  c, s = (np.asarray(t, np.float64)[:, :, None, :half] for t in (cos, sin))
  z = (x[..., :half] + 1j * x[..., half:]) * (c + sign * 1j * s)
  return np.concatenate([z.real, z.imag], -1)


def _case(dtype):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((2, 300, 4, 64)) * 3).astype(np.float32)
  g = rng.standard_normal(x.shape).astype(np.float32)
  positions = np.arange(300)[None] + np.array([[0], [5000]])
  cos, sin = llama.rope_tables(jnp.asarray(positions), 64, THETA)
  return jnp.asarray(x, dtype), jnp.asarray(g, dtype), cos, sin


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -7)])
def test_values_and_gradients_are_the_rotation(dtype, tol):
  """Output = x rotated by position × frequency; gradient = the cotangent rotated back (a
  rotation's transpose). Positions up to 5,300; `tol` is relative to the largest value:
  fp32 arithmetic, or one bf16 rounding of the output (2^-8 of a value)."""
  x, g, cos, sin = _case(dtype)
  out, vjp = jax.vjp(lambda x: llama.apply_rope(x, cos, sin), x)
  (grad,) = vjp(g)
  xd, gd = (np.asarray(a, np.float64) for a in (x, g))
  for got, want in ((out, _complex_rotation(xd, cos, sin)),
                    (grad, _complex_rotation(gd, cos, sin, sign=-1.0))):
    assert got.dtype == dtype
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < tol, err


@pytest.mark.parametrize("batch", [2, 1])
def test_values_and_gradients_are_autodiffs_of_the_fp32_formula(batch):
  """Swapping and negating the halves before widening is exact, and the written-out gradient
  makes autodiff's products and sums: x's output and gradient are the same bit for bit (bf16).
  The tables' gradients (unused in training) agree to fp32 summation order, also when one
  table row is broadcast over the batch (`batch` 1)."""
  x, g, cos, sin = _case(jnp.bfloat16)
  cos, sin = cos[:batch], sin[:batch]

  def outputs(rope):
    out, vjp = jax.vjp(rope, x, cos, sin)
    return (out, *vjp(g))

  got, want = outputs(llama.apply_rope), outputs(_rotated_in_fp32)
  for a, b in zip(got[:2], want[:2]):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  for a, b in zip(got[2:], want[2:]):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def _entry_arrays(text: str) -> list[tuple]:
  """(dtype, dims) of each array the entry computation's instructions write to memory."""
  computations, entry = hlo_text.parse(text)
  return [a for i in computations[entry] for a in hlo_text.arrays(i.shape)]


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_tpu_compile_keeps_no_fp32_copy_of_the_rotated_halves():
  """q and k projected, rotated and multiplied, forward and backward, on one v5e chip.
  Widening x before swapping its halves left the compiler fp32 halves B×L×H×(E/2) to write
  out and read back, 0.70M cycles; swapping in bf16 leaves none, 0.56M (measured). On
  llama2-7b's v5e-256 step this was 1.085 → 1.044 s with bf16 scores (docs/performance.md)."""
  devices, _ = aot.tpu_devices("v5e", 1)
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  length, d, heads, e = 2048, 1024, 8, 128
  x = jax.ShapeDtypeStruct((1, length, d), jnp.bfloat16, sharding=sharding)
  w = jax.ShapeDtypeStruct((d, heads, e), jnp.bfloat16, sharding=sharding)
  positions = jax.ShapeDtypeStruct((1, length), jnp.int32, sharding=sharding)

  def compiled(rope):
    def loss(x, wq, wk, positions):
      cos, sin = llama.rope_tables(positions, e, THETA)
      q, k = (rope(jnp.einsum("bld,dhe->blhe", x, w), cos, sin) for w in (wq, wk))
      return jnp.einsum("blhe,bmhe->bhlm", q, k, preferred_element_type=jnp.float32).sum()
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return compile_only.compile_lowered(step.lower(x, w, w, positions), "tpu").as_text()

  halves = ("f32", (1, length, heads, e // 2))
  shipped, control = compiled(llama.apply_rope), compiled(_rotated_in_fp32)
  assert _entry_arrays(shipped).count(halves) == 0
  assert _entry_arrays(control).count(halves) >= 2  # the control: the check can see them
  ratio = hlo_cycles.estimated_cycles(shipped) / hlo_cycles.estimated_cycles(control)
  assert ratio < 0.9, ratio  # 0.80 measured
