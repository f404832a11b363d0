"""Every test runs on 8 simulated CPU devices: `shardlab_devices = 8` in pyproject.toml turns
on shardlab's own pytest plugin (shardlab.testing.plugin, the one users get), which sets
them up before JAX starts."""

import os
import tempfile

import jax

pytest_plugins = ["pytester"]  # tests/test_testing.py runs the plugin in throwaway sessions

assert jax.device_count() == 8, jax.devices()

# No persistent compilation cache: XLA:CPU crashed (SIGSEGV) deserialising a cached
# executable late in a full run, twice at the same test; every program compiles afresh.

# The host's CPU peak (observe/throughput.py) is kept in a cache file: the suite keeps its own,
# so it neither reads nor raises the one in the user's home.
os.environ.setdefault("SHARDLAB_CACHE_DIR", tempfile.mkdtemp(prefix="shardlab-test-cache-"))
