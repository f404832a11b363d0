"""`--shardlab-cache DIR`: JAX's persistent compilation cache for a pytest session and the
processes its tests start, one subdirectory per CPU kind; and why loading from it is no riskier
than compiling on XLA:CPU (memory mappings)."""

import subprocess
import sys
from pathlib import Path

from shardlab.testing import cache

CHILD = """
import jax, jax.numpy as jnp
def started_by_a_test(x):
    return jnp.cos(x) * 3
jax.jit(started_by_a_test)(jnp.ones(8)).block_until_ready()
"""

USER_TEST = f"""
import os, subprocess, sys
import jax, jax.numpy as jnp
from jax import monitoring

hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("/cache_hits") else None)

def in_the_test(x):
    return jnp.sin(x) @ x

def test_compiles():
    jax.jit(in_the_test)(jnp.ones((16, 16))).block_until_ready()
    subprocess.run([sys.executable, "-c", {CHILD!r}], check=True)
    print("CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"], "HITS", len(hits))
"""


def test_cache_option_keeps_programs_of_the_tests_and_of_the_processes_they_start(
    pytester, monkeypatch, tmp_path):
  monkeypatch.delenv(cache.DIR_ENV, raising=False)  # the suite's own cache is not this one
  pytester.makepyfile(test_user=USER_TEST)
  where = tmp_path / "jax-cache"
  args = ("-s", "-p", "no:cacheprovider", "--shardlab-cache", str(where))
  first = pytester.runpytest_subprocess(*args)
  first.assert_outcomes(passed=1)
  per_host = where / cache.host_key()
  first.stdout.fnmatch_lines([f"*CACHE {per_host} HITS 0"])
  entries = {p.name for p in per_host.iterdir()}
  assert {"jit_in_the_test", "jit_started_by_a_test"} <= {e.split("-")[0] for e in entries}
  # A second session loads both programs instead of compiling them.
  second = pytester.runpytest_subprocess(*args)
  second.assert_outcomes(passed=1)
  hits = int(second.stdout.str().split("HITS ")[1].split()[0])
  assert hits >= 1
  assert {p.name for p in per_host.iterdir()} == entries  # nothing compiled anew


def test_cache_ini_option_and_an_unusable_directory(pytester, monkeypatch, tmp_path):
  monkeypatch.delenv(cache.DIR_ENV, raising=False)
  per_host = tmp_path / "ini-cache" / cache.host_key()
  pytester.makepyfile(test_user=f"""
import os
def test_env():
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == {str(per_host)!r}
""")
  pytester.makeini(f"[pytest]\nshardlab_cache = {tmp_path / 'ini-cache'}\n")
  pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
  assert per_host.is_dir()
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  result = pytester.runpytest_subprocess("--shardlab-cache", str(blocker))
  assert result.ret != 0
  result.stderr.fnmatch_lines([f"*--shardlab-cache: cannot use '{blocker}'*"])


def test_host_key_follows_the_cpu_model_and_features(tmp_path):
  def key(text: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return cache.host_key(str(path))

  avx512 = "model name\t: Xeon\nflags\t\t: sse avx2 avx512f\n"
  two_cores = avx512 + "\n" + avx512  # one line per core: the same host
  assert key(avx512) == key(two_cores)
  assert key(avx512) != key("model name\t: Xeon\nflags\t\t: sse avx2\n")
  assert key(avx512) != key("model name\t: EPYC\nflags\t\t: sse avx2 avx512f\n")
  assert cache.host_key(str(tmp_path / "missing")).startswith("cpu-")


MAPS = """
import sys, jax, jax.numpy as jnp
from shardlab.testing import cache
cache.enable(sys.argv[1])
jnp.ones(3).block_until_ready()
count = lambda: sum(1 for _ in open("/proc/self/maps"))
before, keep = count(), []
for k in range(8):
  f = jax.jit(lambda x, k=k: jnp.sin(x) @ x + k)
  f(jnp.ones((16, 16))).block_until_ready()
  keep.append(f)
print(count() - before)
"""


def test_a_loaded_executable_maps_no_more_than_a_compiled_one(tmp_path):
  """The segfault that once switched the suite's cache off came from running out of memory
  mappings (vm.max_map_count), where compiling afresh aborts too: loading must not need more."""
  if not Path("/proc/self/maps").exists():
    return
  run = lambda: int(subprocess.run([sys.executable, "-c", MAPS, str(tmp_path)], check=True,
                                   capture_output=True, text=True).stdout.split()[-1])
  compiled, loaded = run(), run()
  assert any((tmp_path / cache.host_key()).iterdir())
  assert 0 < loaded <= compiled * 1.1 + 8, (compiled, loaded)
