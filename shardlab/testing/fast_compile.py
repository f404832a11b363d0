"""XLA:CPU's older loop emitters for a test session and the processes it starts.

A suite on a CPU spends most of its time compiling many small programs, and XLA:CPU's
default fusion emitters take longer to compile them than the older ones
(`--xla_cpu_use_fusion_emitters=false`): shardlab's test_parity.py ran in 72 s against 92,
and eight compile-heavy files (planner against compiled memory, HLO collectives, accumulation
and offload bytes, remat policies) in 196 s against 256, every test passing both ways. The
partitioning and the collectives are the same; what changes is how each fused loop becomes
machine code, and a scatter (an embedding's gradient) becomes a while loop in the HLO.
Buffers can differ by a few KB (tiny's fsdp step at full remat: 12,412,296 temp bytes
against 12,412,168), and bf16 programs may run slower (the peer benchmark's steps: 11–14%):
a test asserts no speed, but a benchmark should not run under it.

Off unless asked (`--shardlab-fast-compile`, or `shardlab_fast_compile = true` in the ini).
A value the user set in XLA_FLAGS, either way, is left as it is.
"""

from shardlab.runtime import jax_compat, xla_flags

FLAG = "--xla_cpu_use_fusion_emitters=false"


def enable() -> bool:
  """Adds FLAG to XLA_FLAGS for this process (before JAX's backend starts) and every process
  it starts; False where XLA_FLAGS already chose. Raises RuntimeError once the backend has
  started, when XLA no longer reads its flags."""
  if xla_flags.named(FLAG):
    return False
  if jax_compat.backends_are_initialized():
    raise RuntimeError("the JAX backend already started, so XLA has read its flags")
  return xla_flags.add(FLAG)
