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

On XLA:CPU the fast path depends on the host: with native bf16 instructions (AVX512-BF16,
AMX, Arm BF16) it is bf16 × bf16 → fp32 (562 vs 138 GFLOP/s with a bf16 result on a host
with AMX); without them a bf16 result is the fastest (2048³ on an AMD EPYC without
AVX512-BF16: 75 GFLOP/s, against 53 for bf16 × bf16 → fp32 and 73 for an fp32 dot), and its
error is that of rounding the exact product to bf16, so it accumulates in fp32 as a TPU
does (XLA:CPU widens the operands to fp32 for it: a copy of each, which a dot whose operand
is large, such as the output head's, can opt out of). There the output dtype is asked for
directly, as on TPU and GPU. `/proc/cpuinfo` decides; `SHARDLAB_CPU_DOT=fp32` (accumulate
into fp32) or `=output` (ask for the output dtype) overrides it.
"""

import functools
import os

import jax
import jax.numpy as jnp

from shardlab.runtime import cpu_info
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


def einsum(spec: str, a, b, out_dtype=None, copies: bool = True):
  """`jnp.einsum(spec, a, b)` accumulated in fp32, returned in `out_dtype` (default: the
  operands' common dtype). Gradients flow back in the operands' dtypes. `copies=False`
  keeps XLA:CPU from widening the operands (forward and backward) on a host where that is
  the faster path: for operands too large to copy."""
  _parse(spec)
  dtype = jnp.result_type(a, b)
  return _einsum(spec, jnp.dtype(out_dtype or dtype), copies, a.astype(dtype),
                 b.astype(dtype))


@functools.cache  # asked on every traced dot; the CPU does not change under a process
def _native_bf16() -> bool:
  flags = cpu_info.flags()
  if flags is None:  # not Linux: assume the fp32-result path, as before this check
    return True
  return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_result() -> str:
  """What an XLA:CPU dot is asked for: "fp32" (then cast) on a CPU with native bf16
  instructions, else "output" (the output dtype, as on TPU); SHARDLAB_CPU_DOT overrides."""
  forced = os.environ.get("SHARDLAB_CPU_DOT", "")
  if forced not in ("", "fp32", "output"):
    raise ValueError(f"SHARDLAB_CPU_DOT={forced!r}; valid: fp32 (accumulate into fp32), "
                     f"output (ask for the output dtype), or unset (detect)")
  return forced or ("fp32" if _native_bf16() else "output")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum(spec, out_dtype, copies, a, b):
  return _dot(spec, a, b, out_dtype, copies)


def _dot(spec, a, b, out_dtype, copies):
  fp32 = platform() == "cpu" and (cpu_result() == "fp32" or not copies)
  acc = jnp.float32 if fp32 else out_dtype
  return jnp.einsum(spec, a, b, preferred_element_type=acc).astype(out_dtype)


def _forward(spec, out_dtype, copies, a, b):
  return _einsum(spec, out_dtype, copies, a, b), (a, b)


def _backward(spec, out_dtype, copies, residuals, g):
  a, b = residuals
  sa, sb, so = _parse(spec)
  g = g.astype(a.dtype)
  if platform() == "cpu" and cpu_result() == "output" and copies:
    a, b = _after(g, a, b)
  return (_dot(f"{so},{sb}->{sa}", g, b, a.dtype, copies),
          _dot(f"{sa},{so}->{sb}", a, g, b.dtype, copies))


_einsum.defvjp(_forward, _backward)


def _after(g, *xs):
  """`xs` unchanged, but computed from the cotangent `g`, so not before the backward pass.
  Where XLA:CPU widens each bf16 operand to fp32 for a dot (the "output" path), it would
  otherwise widen a saved activation as soon as the forward pass made it (the conversion
  fused into its producer) and hold that fp32 copy until the backward's dot reads it: twice
  the saved bytes (the peer config at remat none: 143.6 MiB a device, 126.0 with this). A
  zero that depends on `g` is added; `where` keeps it zero when g is not finite."""
  first = g.reshape(-1)[0].astype(jnp.float32)
  zero = jnp.where(jnp.isfinite(first), first * 0, 0.0)
  return tuple((x.astype(jnp.float32) + zero).astype(x.dtype) for x in xs)

