"""Simulated CPU devices, for laptops and tests: must be chosen before the backend starts."""

import os

import jax

from shardlab.bounds import Int
from shardlab.errors import ConfigError
from shardlab.runtime import jax_compat, xla_flags
from shardlab.runtime.accelerators import accelerator_present  # noqa: F401 (re-exported)


ONE_THREAD_PER_DEVICE = "--xla_cpu_multi_thread_eigen=false"
POOL_THREADS_PER_DEVICE = 4
SIMULATED = Int(min=1)  # simulate()'s n, and every --simulate-devices


def simulate(n: int) -> None:
  """Makes the CPU backend expose `n` devices. Call before any JAX computation."""
  SIMULATED.check(n, "--simulate-devices")
  if jax_compat.backends_are_initialized():
    have = jax.device_count()
    if jax.default_backend() == "cpu" and have == n:
      return
    raise ConfigError(
        f"cannot simulate {n} devices: the JAX backend already started with {have} "
        f"{jax.default_backend()} device(s). Call shardlab.simulate_devices() (or pass "
        f"--simulate-devices) before the first jax.devices() or computation, or set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} in the environment")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)
  if n > 1:
    # N simulated devices already run in parallel; letting each also spread its ops over
    # every core oversubscribes them (bf16 peer benchmark: 3.6 → 2.1 s/step on 2 cores).
    xla_flags.add(ONE_THREAD_PER_DEVICE)
  if n > 1 and "PJRT_NPROC" not in os.environ:
    # XLA:CPU runs a program's independent collectives concurrently, each holding a thread
    # of the client's pool (max(cores, devices) threads) until its peers arrive; with more
    # devices than cores the pool can fill with waiting collectives while another device's
    # part never starts: a deadlock XLA aborts after 40 s (3 runs in 8 of docs/your-model.md
    # on a busy 2-core host; none in 16 with this headroom).
    os.environ["PJRT_NPROC"] = str(POOL_THREADS_PER_DEVICE * n)
