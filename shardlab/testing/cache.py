"""JAX's persistent compilation cache for a test session and the processes it starts.

A test suite on a CPU spends most of its time compiling, and a program compiled by one test
is compiled again by the next that builds it afresh, and by every `train.py` a test starts
(each its own process, where JAX's in-memory cache cannot help). The persistent cache keeps
each executable in a directory, keyed by JAX on the program, the compile options, the XLA
flags and the jax/jaxlib versions.

Why this is safe on XLA:CPU. It was once switched off in shardlab's suite after a segfault
while loading a cached executable late in a full run. That was the process running out of
memory mappings (vm.max_map_count, 65530 by default): each live XLA:CPU executable maps its
code in ~50 pieces, whether compiled or loaded, and with the limit reached XLA:CPU aborts
compiling afresh just as it segfaults loading (docs/testing.md). The cache adds no mappings.

Processes sharing the directory at once (pytest-xdist workers, the two ranks of a
multi-process test) are safe: JAX writes an entry once, and a reader that meets one still
being written finds a truncated compressed stream, which JAX reports as a warning and
compiles afresh; nothing half-written is ever loaded.

The key holds nothing about the host's CPU, and an executable is compiled for the CPU
features of the host that compiled it: XLA:CPU refuses to load one that needs a feature the
host lacks (and compiles afresh), but would load one built for a lesser CPU, slower. So the
directory given is divided per CPU model and feature set.
"""

import hashlib
import os
import platform

import jax

from shardlab.runtime import jax_compat

DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_SECS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Tests compile many small programs (0.1-1 s each on 2 cores): keep every one, unless the
# user's JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise (JAX's default is 1 s).
MIN_COMPILE_SECS = 0.0


def host_key(cpuinfo: str = "/proc/cpuinfo") -> str:
  """`cpu-<hash>` of the CPU model and its feature flags (what XLA:CPU compiles for)."""
  try:
    with open(cpuinfo) as f:
      lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
    text = "".join(sorted(set(lines)))
  except OSError:  # no /proc (macOS): the architecture and processor name
    text = f"{platform.machine()} {platform.processor()}"
  return "cpu-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def enable(directory: str) -> str:
  """Turns the cache on in `directory`/<host key> for this process (before or after its first
  compile) and, through the environment, for every process it starts. Returns that path."""
  path = os.path.join(os.path.abspath(os.path.expanduser(directory)), host_key())
  os.makedirs(path, exist_ok=True)
  os.environ[DIR_ENV] = path
  min_secs = float(os.environ.setdefault(MIN_SECS_ENV, str(MIN_COMPILE_SECS)))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
  jax_compat.reset_compilation_cache()  # JAX decides once a process whether the cache is on
  return path
