"""Faster XLA:CPU compiles for a test session and the processes it starts.

A suite on a CPU spends most of its time compiling many small programs, each run for a few
steps. Two XLA:CPU settings trade a program's speed for its compile time:

- `--xla_cpu_use_fusion_emitters=false`, the older loop emitters: shardlab's test_parity.py
  ran in 72 s against 92, and eight compile-heavy files (planner against compiled memory,
  HLO collectives, accumulation and offload bytes, remat policies) in 196 s against 256. The
  partitioning and the collectives are the same; what changes is how each fused loop becomes
  machine code, and a scatter (an embedding's gradient) becomes a while loop in the HLO.
  Buffers can differ by a few KB (tiny's fsdp step at full remat: 12,412,296 temp bytes
  against 12,412,168), and bf16 programs may run slower (the peer benchmark's steps: 11–14%).
- `--xla_backend_optimization_level=1`, LLVM's level 1 where XLA's default is 3: on top of
  the emitters, test_parity.py, test_lora_any_module.py and test_init_state.py ran in 66 s
  against 105 (2 cores, 2026-11-29), every test passing, the bit-for-bit ones included: level
  1 leaves the arithmetic as it is (level 0, faster still, contracts multiply-adds
  differently and moves results by an ulp). The code it makes ran as fast here: the default
  run's 300 steps (tests/test_learning.py) took 83 s against 84 at level 3. Level 0 took
  that test twice as long.

The HLO passes, buffer assignment and collectives are XLA's and untouched by either; a test
may assert bytes and collectives under them, but no speed, and a benchmark should not run
under them. Compiles for TPU or GPU are not affected by the emitters flag and a TPU compile
not by the level either.

Off unless asked (`--shardlab-fast-compile`, or `shardlab_fast_compile = true` in the ini).
An option the user set in XLA_FLAGS, either way, is left as it is.
"""

from shardlab.runtime import jax_compat, xla_flags

FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")


def enable() -> list[str]:
  """Adds FLAGS to XLA_FLAGS for this process (before JAX's backend starts) and every process
  it starts, each unless XLA_FLAGS already sets its option; returns those added. Raises
  RuntimeError once the backend has started, when XLA no longer reads its flags."""
  missing = [flag for flag in FLAGS if not xla_flags.named(flag)]
  if missing and jax_compat.backends_are_initialized():
    raise RuntimeError("the JAX backend already started, so XLA has read its flags")
  return [flag for flag in missing if xla_flags.add(flag)]


def only(env: dict[str, str]) -> str:
  """The FLAGS in `env`'s XLA_FLAGS, alone: XLA_FLAGS for a process that sets its own
  devices but should compile as the tests do."""
  return " ".join(f for f in env.get("XLA_FLAGS", "").split() if f in FLAGS)
