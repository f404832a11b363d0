"""Two-operand einsums that accumulate in fp32 and return the operands' dtype, forward and
backward.

Under bf16 compute an MXU/tensor core accumulates in fp32 whatever the output dtype, but
XLA:CPU takes a much slower path for a dot with a bf16 result than for bf16 × bf16 → fp32
(3–5× on a host with AMX or AVX512-BF16). Asking for fp32 output only fixes the forward:
autodiff's transposed dots then multiply an fp32 cotangent by a bf16 operand, which is the
slow path again. So the backward is written out: the cotangent is cast to the compute dtype
and both gradient dots accumulate in fp32 too. TPUs and GPUs accumulate in fp32 whatever
the output dtype, and there an fp32 result would be materialised before the cast (a
llama2-7b MLP weight gradient: 172 MiB instead of 86), so they are asked for the output
dtype directly.
"""

import functools

import jax
import jax.numpy as jnp

from shardlab.sharding.activations import platform


def _parse(spec: str) -> tuple[str, str, str]:
  inputs, out = spec.replace(" ", "").split("->")
  a, b = inputs.split(",")
  for name, s in (("first", a), ("second", b), ("output", out)):
    if len(set(s)) != len(s):
      raise ValueError(f"einsum {spec!r}: repeated index in the {name} operand")
  for name, s, other in (("first", a, b), ("second", b, a)):
    lonely = set(s) - set(other) - set(out)
    if lonely:  # summed over one operand alone: its transpose would be a broadcast
      raise ValueError(f"einsum {spec!r}: index {''.join(sorted(lonely))} of the {name} "
                       f"operand appears nowhere else")
  return a, b, out


def einsum(spec: str, a, b, out_dtype=None):
  """`jnp.einsum(spec, a, b)` accumulated in fp32, returned in `out_dtype` (default: the
  operands' common dtype). Gradients flow back in the operands' dtypes."""
  _parse(spec)
  dtype = jnp.result_type(a, b)
  return _einsum(spec, jnp.dtype(out_dtype or dtype), a.astype(dtype), b.astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(spec, out_dtype, a, b):
  return _dot(spec, a, b, out_dtype)


def _dot(spec, a, b, out_dtype):
  acc = jnp.float32 if platform() == "cpu" else out_dtype
  return jnp.einsum(spec, a, b, preferred_element_type=acc).astype(out_dtype)


def _forward(spec, out_dtype, a, b):
  return _einsum(spec, out_dtype, a, b), (a, b)


def _backward(spec, out_dtype, residuals, g):
  a, b = residuals
  sa, sb, so = _parse(spec)
  g = g.astype(a.dtype)
  return _dot(f"{so},{sb}->{sa}", g, b, a.dtype), _dot(f"{sa},{so}->{sb}", a, g, b.dtype)


_einsum.defvjp(_forward, _backward)
