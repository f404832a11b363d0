"""The private JAX internals shardlab reads, in one place: each has no public equivalent in
jax 0.10.2 (pinned in pyproject.toml). Upgrading JAX means checking this file only.
"""

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


def source_line(eqn) -> str:
  """The file:line (function) a jaxpr equation was traced from, as
  jax.ad_checkpoint.print_saved_residuals names it: no public accessor."""
  return _private("source_info_util").summarize(eqn.source_info)
