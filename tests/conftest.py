"""Every test runs on 8 simulated CPU devices: `shardlab_devices = 8` in pyproject.toml turns
on shardlab's own pytest plugin (shardlab.testing.plugin, the one users get), which sets
them up before JAX starts."""

import atexit
import os
import shutil
import tempfile

import jax

from shardlab.testing import cache

pytest_plugins = ["pytester"]  # tests/test_testing.py runs the plugin in throwaway sessions

assert jax.device_count() == 8, jax.devices()

# A persistent compilation cache for this session, unless `--shardlab-cache DIR` (or the
# environment) names one: tests build the same programs again, and every train.py a test
# starts compiles its step in a process of its own. CI starts clean, so it pays off within one
# run. (The XLA:CPU segfault that once switched it off was the memory-mapping limit, which
# compiling afresh hits too: shardlab/testing/cache.py.)
if not os.environ.get(cache.DIR_ENV):
  _JAX_CACHE = tempfile.mkdtemp(prefix="shardlab-test-jax-cache-")
  cache.enable(_JAX_CACHE)
  atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)

# The processes the suite starts (train.py, shardlab) skip their restart for huge pages: each
# costs a second interpreter start, and the suite's tiny programs gain nothing from it
# (tests/test_host_memory.py runs the restart itself, with this variable removed).
os.environ.setdefault("SHARDLAB_HUGE_PAGES", "0")

# The host's CPU peak (observe/throughput.py) is kept in a cache file: the suite keeps its own,
# so it neither reads nor raises the one in the user's home.
os.environ.setdefault("SHARDLAB_CACHE_DIR", tempfile.mkdtemp(prefix="shardlab-test-cache-"))
