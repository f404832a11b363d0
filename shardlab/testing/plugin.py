"""The pytest plugin (entry point `pytest11: shardlab`): simulated CPU devices chosen before
JAX starts, a persistent compilation cache shared with the processes tests start, XLA:CPU's
faster-compiling settings, and a `mesh` fixture with the CLI's mesh syntax. Does nothing
unless asked."""

import jax
import pytest

from shardlab.bounds import Int
from shardlab.errors import ConfigError
from shardlab.runtime import devices
from shardlab.sharding import mesh as mesh_lib
from shardlab.testing import cache, fast_compile

OPTION, INI = "--shardlab-devices", "shardlab_devices"
CACHE_OPTION, CACHE_INI = "--shardlab-cache", "shardlab_cache"
FAST_OPTION, FAST_INI = "--shardlab-fast-compile", "shardlab_fast_compile"
FAST_FLAGS = " ".join(fast_compile.FLAGS)  # as the help and the error show them
DEVICES = Int(min=0)  # the option's and the ini value's range


def pytest_addoption(parser: pytest.Parser) -> None:
  group = parser.getgroup("shardlab")
  group.addoption(OPTION, type=DEVICES, default=None, metavar="N",
                  help="run the tests on N simulated CPU devices (before JAX starts; "
                       f"%(type)s; 0 or unset: the {INI} ini value)")
  parser.addini(INI, f"N simulated CPU devices for the tests ({DEVICES}; 0: leave JAX alone)",
                default="0")
  group.addoption(CACHE_OPTION, default=None, metavar="DIR",
                  help="keep compiled programs in DIR (JAX's persistent compilation cache, one "
                       "subdirectory per CPU kind), for the tests and every process they start; "
                       "default: no cache")
  parser.addini(CACHE_INI, "directory of JAX's persistent compilation cache for the tests "
                "(empty: none)", default="")
  group.addoption(FAST_OPTION, action="store_true", default=False,
                  help=f"compile with XLA:CPU's older loop emitters at LLVM level 1 "
                       f"({FAST_FLAGS}): quicker compiles, slower programs; "
                       f"for the tests and every process they start (default: the {FAST_INI} "
                       "ini value)")
  parser.addini(FAST_INI, f"faster-compiling XLA:CPU settings for the tests "
                f"({FAST_FLAGS})", type="bool", default=False)


def requested_devices(config: pytest.Config) -> int:
  # The command line is only pre-parsed this early: its value is in known_args_namespace.
  value = getattr(config.known_args_namespace, "shardlab_devices", None)
  if value:  # parsed by DEVICES; 0 defers to the ini value
    return value
  try:
    return DEVICES.parse(config.getini(INI) or "0")
  except ValueError as e:
    raise pytest.UsageError(f"{INI} {e}") from None


def requested_cache(config: pytest.Config) -> str:
  return getattr(config.known_args_namespace, "shardlab_cache", None) or config.getini(CACHE_INI)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
  """Runs before any conftest.py imports the test code, so the device count is set before
  anything can start JAX's backend."""
  if (getattr(early_config.known_args_namespace, "shardlab_fast_compile", False) or
      early_config.getini(FAST_INI)):
    try:
      fast_compile.enable()
    except RuntimeError as e:
      raise pytest.UsageError(f"{FAST_OPTION}: {e} (start JAX later, or set "
                              f"XLA_FLAGS='{FAST_FLAGS}')") from None
  directory = requested_cache(early_config)
  if directory:
    try:
      cache.enable(directory)
    except OSError as e:
      raise pytest.UsageError(f"{CACHE_OPTION}: cannot use {directory!r}: {e}") from None
  n = requested_devices(early_config)
  if not n:
    return
  try:
    devices.simulate(n)
  except ConfigError:
    raise pytest.UsageError(
        f"shardlab: cannot simulate {n} devices: the JAX backend already started with "
        f"{jax.device_count()} {jax.default_backend()} device(s) before the plugin ran "
        f"(a plugin or sitecustomize called jax.devices() or ran a computation at start-up); "
        f"start JAX later, or set XLA_FLAGS=--xla_force_host_platform_device_count={n}") \
        from None


@pytest.fixture
def mesh():
  """`mesh("data:2,fsdp:2,tensor:2")`: a jax Mesh over the first devices it needs (all of
  them for a -1 axis), in the syntax of `--mesh`."""

  def make(text: str, devices=None):
    spec = mesh_lib.load(text)
    sizes = [s for part in (spec.ici, spec.dcn) for s in part.values()]
    available = list(jax.devices() if devices is None else devices)
    if -1 not in sizes:
      n = 1
      for s in sizes:
        n *= s
      if n > len(available):
        raise ConfigError(f"mesh {text!r} needs {n} devices; {len(available)} are available "
                          f"(--shardlab-devices {n})")
      available = available[:n]
    return mesh_lib.build(spec, available)

  return make
