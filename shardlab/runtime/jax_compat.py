"""The private JAX internals shardlab reads, in one place: each has no public equivalent in
jax 0.10.2 (pinned in pyproject.toml). Upgrading JAX means checking this file only.
"""

import contextlib
import importlib


def _private(module: str):
  return importlib.import_module(f"jax._src.{module}")


def backends_are_initialized() -> bool:
  """Whether JAX has started its backends (after which the simulated device count, the
  platform and the XLA flags are fixed for this process)."""
  return _private("xla_bridge").backends_are_initialized()


def distributed_state():
  """jax.distributed's runtime client state (its preemption sync manager, client): no public
  accessor."""
  return _private("distributed").global_state


def reset_compilation_cache() -> None:
  """Forgets the persistent compilation cache's settings, so a change to
  jax_enable_compilation_cache takes effect in this process."""
  _private("compilation_cache").reset_cache()


@contextlib.contextmanager
def fresh_compiles():
  """Compiles inside skip the persistent compilation cache (neither read nor written), so XLA
  runs and logs what it logs while compiling; the cache's key also leaves out source
  locations, so a hit can carry another file's line numbers in its HLO metadata."""
  import jax
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  reset_compilation_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    reset_compilation_cache()


def source_line(eqn) -> str:
  """The file:line (function) a jaxpr equation was traced from, as
  jax.ad_checkpoint.print_saved_residuals names it: no public accessor."""
  return _private("source_info_util").summarize(eqn.source_info)
