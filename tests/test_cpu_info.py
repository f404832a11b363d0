"""What the benchmarks print about the host's CPU (runtime/cpu_info.py), and the dot path it
picks (parallel/dot.py), from /proc/cpuinfo texts of the three host kinds CI runs on and an
Arm one."""

from unittest import mock

import pytest

from shardlab.parallel import dot
from shardlab.runtime import cpu_info

AVX2_EPYC = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx fma avx2 bmi2
"""
BF16_EPYC = """model name\t: AMD EPYC 9B14
flags\t\t: avx fma avx2 avx512f avx512_bf16 avx512_vnni avx_vnni
"""
AMX_XEON = ("model name\t: Intel(R) Xeon(R) Processor\n"
            "flags\t\t: avx fma avx2 avx512f avx512_bf16 avx512_fp16 avx512_vnni avx_vnni amx_bf16 "
            "amx_tile amx_int8\n")
NEOVERSE = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes sve sve2 bf16 i8mm
"""


def _on(text: str):
  return mock.patch.object(cpu_info, "_lines", return_value=tuple(text.splitlines()))


@pytest.mark.parametrize("text, model, have, lack, native_bf16", [
    (AVX2_EPYC, "AMD EPYC 7B12", "avx2 fma", "avx512f avx512_bf16", False),
    (BF16_EPYC, "AMD EPYC 9B14", "avx512f avx512_bf16 avx512_vnni", "amx_bf16", True),
    (AMX_XEON, "Intel(R) Xeon(R) Processor", "avx512_bf16 amx_tile amx_bf16 amx_int8", "", True),
    (NEOVERSE, None, "asimd sve sve2 bf16 i8mm", "", True)])
def test_the_header_names_the_model_and_what_the_cpu_has_and_lacks(text, model, have, lack,
                                                                   native_bf16):
  with _on(text):
    line = cpu_info.describe()
    assert dot._native_bf16.__wrapped__() is native_bf16  # past the process's cached answer
  if model:
    assert line.startswith(f"host CPU: {model}, "), line
  flags, without = line.split("; flags ")[1].split("; without ")
  assert set(have.split()) <= set(flags.split()), line
  assert set(lack.split()) <= set(without.split()), line
  assert not set(flags.split()) & set(without.split()), line
  # A flag of the other architecture is not reported as missing.
  other = {"asimd", "sve"} if "avx2" in flags else {"avx2", "amx_bf16"}
  assert not other & set(without.split()), line


def test_without_proc_cpuinfo_the_flags_are_unknown_not_absent():
  with _on(""):
    assert cpu_info.flags() is None
    assert "flags unknown" in cpu_info.describe()
    assert dot._native_bf16.__wrapped__()  # the fp32-result path, as before the check existed
