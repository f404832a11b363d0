"""Compiling a program only to read it (its optimised HLO, memory analysis, collectives),
never to run it: what the planner's compile checks, `shardlab inspect --collectives`,
`shardlab explain` and shardlab.testing's collective assertions do.

On XLA:CPU most of a compile is LLVM turning the optimised HLO into machine code. The HLO
passes, the SPMD partitioner and buffer assignment do not read LLVM's optimisation level, so
at level 0 the optimised HLO and the memory analysis are the same as at the default level
(tests/test_compile_only.py compares them) and only machine code that nobody runs is slower;
the compile takes about 0.6 of the time (a 125M-parameter step on 8 CPU devices: 1.9 s
against 3.0 s). Other platforms compile as usual: their compilers have no such split.

A compile-only executable (a TPU topology compiled from a CPU host, no TPU client) cannot be
reloaded from JAX's persistent cache, so such compiles bypass it rather than fill it with
entries that only warn when read.
"""

import contextlib

import jax

from shardlab.runtime import jax_compat

# XLA's DebugOptions field; unset, XLA optimises machine code fully.
CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def options(platform: str, extra: dict | None = None) -> dict | None:
  """The compile options for an analysis-only compile on `platform`, with `extra` (e.g.
  {"xla_dump_to": dir}) added; None where there are none."""
  merged = (CPU_OPTIONS if platform == "cpu" else {}) | (extra or {})
  return merged or None


def compile_lowered(lowered, platform: str | None = None, extra: dict | None = None):
  """`lowered.compile()` for reading, not running (`platform`: where it was lowered for; by
  default JAX's default backend)."""
  platform = platform or jax.default_backend()
  with _uncached(platform):
    return lowered.compile(options(platform, extra))


@contextlib.contextmanager
def _uncached(platform: str):
  """The persistent cache off around a compile for an accelerator this process has no client
  for (JAX decides once per process whether the cache is on, hence the resets)."""
  if platform == "cpu":
    yield
    return
  cached = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  jax_compat.reset_compilation_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)
    jax_compat.reset_compilation_cache()
