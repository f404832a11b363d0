"""models/llama.py's rotary embedding (every bundled family's): its values and gradients
against a float64 complex rotation, and on a TPU compile no fp32 copy of the rotated halves
in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlab.models import llama
from shardlab.observe import hlo_cycles, hlo_text
from shardlab.plan.compiled import aot
from shardlab.runtime import compile_only

THETA = 10000.0


def _joined_in_fp32(x, cos, sin):
  """The same rotation with the halves joined in fp32 and cast after (the formula as first
  written): the control that shows what the TPU test looks for."""
  half = x.shape[-1] // 2
  xf = x.astype(jnp.float32)
  c, s = (jnp.concatenate([t, t], -1)[:, :, None, :] for t in (cos, sin))
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
  return (xf * c + rotated * s).astype(x.dtype)


def _complex_rotation(x, cos, sin, sign=1.0):
  """float64 reference: each pair (i, i + E/2) as a complex number times cos ± i·sin, the
  tables' own values (their fp32 angles at position 5,000 differ from numpy's by ~5e-4 rad,
  one ulp of a frequency times the position), so what is compared is the rotation."""
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  turn = (np.asarray(cos, np.float64) + sign * 1j * np.asarray(sin, np.float64))[:, :, None]
  z = (x[..., :half] + 1j * x[..., half:]) * turn
  return np.concatenate([z.real, z.imag], -1)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -7)])
def test_values_and_gradients_are_the_rotation(dtype, tol):
  """Output = x rotated by position × frequency; gradient = the cotangent rotated back (a
  rotation's transpose). Positions up to 5,300; `tol` is relative to the largest value:
  fp32 arithmetic, or one bf16 rounding of the output (2^-8 of a value)."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((2, 300, 4, 64)) * 3).astype(np.float32)
  g = rng.standard_normal(x.shape).astype(np.float32)
  positions = np.arange(300)[None] + np.array([[0], [5000]])
  cos, sin = llama.rope_tables(jnp.asarray(positions), 64, THETA)
  out, vjp = jax.vjp(lambda x: llama.apply_rope(x, cos, sin), jnp.asarray(x, dtype))
  (grad,) = vjp(jnp.asarray(g, dtype))
  xd, gd = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (x, g))
  for got, want in ((out, _complex_rotation(xd, cos, sin)),
                    (grad, _complex_rotation(gd, cos, sin, sign=-1.0))):
    assert got.dtype == dtype
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < tol, err


def _entry_arrays(text: str) -> list[tuple]:
  """(dtype, dims) of each array the entry computation's instructions write to memory."""
  computations, entry = hlo_text.parse(text)
  return [a for i in computations[entry] for a in hlo_text.arrays(i.shape)]


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_tpu_compile_keeps_no_fp32_copy_of_the_rotated_halves():
  """q and k projected, rotated and multiplied, forward and backward, on one v5e chip.
  Joining the halves in fp32 left the compiler six fp32 halves B×L×H×(E/2) to write out
  and read back, 0.70M cycles; casting each half first leaves none, 0.52M (measured). On
  llama2-7b's v5e-256 step this was 1.085 → 1.022 s (docs/performance.md)."""
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
  shipped, joined = compiled(llama.apply_rope), compiled(_joined_in_fp32)
  assert _entry_arrays(shipped).count(halves) == 0
  assert _entry_arrays(joined).count(halves) >= 2  # the control: the check can see them
  ratio = hlo_cycles.estimated_cycles(shipped) / hlo_cycles.estimated_cycles(joined)
  assert ratio < 0.8, ratio
