"""The host's CPU as /proc/cpuinfo names it: its model and the instruction sets XLA:CPU's speed
depends on. The peer benchmark's step took 1.4x longer on one of the CPUs CI runs on than on
another (docs/performance.md), and the dot path is chosen by the CPU (parallel/dot.py), so
benchmarks print this with their figures."""

import functools
import os
import platform
from pathlib import Path

CPUINFO = "/proc/cpuinfo"
# The vector and matrix extensions that decide XLA:CPU's dot and elementwise speed (x86:
# AVX2/AVX-512 and their bf16/int8 dot forms, AMX; Arm: NEON, SVE and their bf16/int8 dots).
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
               "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


@functools.cache
def _lines() -> tuple[str, ...]:
  try:
    return tuple(Path(CPUINFO).read_text().splitlines())
  except OSError:  # not Linux
    return ()


def model() -> str:
  """The CPU's model name ('Intel(R) Xeon(R) Processor'), or what Python knows of it."""
  for line in _lines():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine() or "unknown CPU"


def flags() -> frozenset[str] | None:
  """Every feature flag of the first CPU listed, or None where there is no /proc/cpuinfo."""
  for line in _lines():
    if line.startswith(("flags", "Features")):
      return frozenset(line.split(":", 1)[1].split())
  return None


def describe() -> str:
  """One line for a benchmark's header: the model, the core count, and which of SPEED_FLAGS
  the CPU has (and which it lacks, which matters as much: no avx512_bf16, no amx)."""
  have = flags()
  if have is None:
    return f"host CPU: {model()}, {os.cpu_count()} cores (no /proc/cpuinfo: flags unknown)"
  present = [f for f in SPEED_FLAGS if f in have]
  absent = [f for f in SPEED_FLAGS if f not in have and not _other_isa(f, present)]
  return (f"host CPU: {model()}, {os.cpu_count()} cores; flags {' '.join(present) or '(none)'}"
          f"; without {' '.join(absent) or '(none)'}")


def _other_isa(flag: str, present: list[str]) -> bool:
  """An Arm flag on an x86 CPU, or the reverse: not worth saying it is missing."""
  arm = flag in ("asimd", "sve", "sve2", "bf16", "i8mm")
  return arm != ("asimd" in present)
