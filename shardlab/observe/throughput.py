"""Model FLOPs, the accelerator's peak, and from them TFLOP/s per device and MFU.

Model FLOPs come from the model (`flops_per_token`: for the bundled decoders 6·N plus
attention's 12·layers·heads·head_dim·seq; remat's recompute is not useful work, so it is
left out, as MFU requires). The peak is the dense bf16 figure from `shardlab.hardware` for
the attached accelerator. On CPU there is no datasheet: the peak is the host's fp32 matmul
rate, shared by the simulated devices (they share the host's cores), measured once per host
and kept in a cache file — measured afresh in every run it swung 20–165 GFLOP/s on a loaded
host, and MFU with it, past 100%. A step faster than the kept peak proves the peak low: the
peak is raised to it (and kept), so MFU never exceeds 100%.
"""

import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from shardlab.runtime import cpu_info, hardware

CPU_PEAK_FILE = "cpu-peak.json"

# device_kind substrings (lower case) → hardware.ACCELERATORS name, most specific first.
DEVICE_KINDS = (
    ("h200", "h200"),
    ("h100", "h100-80g"),
    ("a100-sxm4-80gb", "a100-80g"), ("a100 80gb", "a100-80g"), ("a100", "a100-40g"),
    ("tpu v4", "tpu-v4"),
    ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"),
    ("tpu v5p", "tpu-v5p"), ("tpu v5", "tpu-v5p"),
    ("tpu v6 lite", "tpu-v6e"), ("tpu v6e", "tpu-v6e"),
)


def accelerator_for(device_kind: str) -> hardware.Accelerator | None:
  """The hardware table's entry for a jax device_kind ('NVIDIA H100 80GB HBM3', 'TPU v5
  lite'), or None for one it does not list."""
  kind = device_kind.lower()
  for pattern, name in DEVICE_KINDS:
    if pattern in kind:
      return hardware.get(name)
  return None


@functools.cache  # once per process: the host does not change between runs
def measure_cpu_matmul(seconds: float = 0.6, n: int = 1024) -> float:
  """The host's fp32 matmul rate (FLOP/s): the best of repeated n×n matmuls on one device,
  which XLA:CPU spreads over all the host's cores."""
  device = jax.local_devices(backend="cpu")[0]
  a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()  # compile and warm up
  best, deadline, reps = float("inf"), time.perf_counter() + seconds, 0
  while reps < 3 or time.perf_counter() < deadline:
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    best = min(best, time.perf_counter() - start)
    reps += 1
  return 2 * n**3 / best


def cache_dir() -> Path:
  """$SHARDLAB_CACHE_DIR, else $XDG_CACHE_HOME/shardlab, else ~/.cache/shardlab."""
  if os.environ.get("SHARDLAB_CACHE_DIR"):
    return Path(os.environ["SHARDLAB_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "shardlab"


def host_key() -> str:
  """The CPU model, its core count and the jax version: what the matmul rate depends on."""
  return f"{cpu_info.model()} | {os.cpu_count()} cores | jax {jax.__version__}"


def _read_peaks(path: Path) -> dict:
  try:
    peaks = json.loads(path.read_text())
    return peaks if isinstance(peaks, dict) else {}
  except (OSError, ValueError):
    return {}  # no cache yet, or one another process left half-written: measure again


def keep_cpu_peak(flops: float) -> None:
  """Records `flops` as this host's peak if it is higher than the one kept (best effort: an
  unwritable cache only means the next run measures again)."""
  path = cache_dir() / CPU_PEAK_FILE
  peaks = _read_peaks(path)
  if peaks.get(host_key(), 0) >= flops:
    return
  peaks[host_key()] = flops
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(peaks, indent=1))
    os.replace(tmp, path)  # atomic: concurrent runs never read a torn file
  except OSError:
    pass


def cpu_peak() -> tuple[float, str]:
  """(FLOP/s, where it comes from): the host's kept peak, measured and kept the first time."""
  kept = _read_peaks(cache_dir() / CPU_PEAK_FILE).get(host_key())
  if isinstance(kept, (int, float)) and kept > 0:
    return float(kept), f"kept in {cache_dir() / CPU_PEAK_FILE}"
  measured = measure_cpu_matmul()
  keep_cpu_peak(measured)
  return measured, "measured now"


@dataclasses.dataclass
class Throughput:
  flops_per_step: float  # model FLOPs of one optimizer step, all devices together
  n_devices: int
  peak_per_device: float | None  # FLOP/s; None when the accelerator is not in the table
  peak_source: str  # where the peak comes from, for the run description
  # A measured peak (CPU) that a faster step raises; a datasheet's is never raised.
  measured: bool = False

  def record(self, step_time_s: float) -> dict:
    """{'tflops_per_device', 'mfu'} for a measured step time (mfu omitted without a peak)."""
    achieved = self.flops_per_step / step_time_s / self.n_devices
    out = {"tflops_per_device": achieved / 1e12}
    if self.peak_per_device and self.measured and achieved > self.peak_per_device:
      self.peak_per_device = achieved
      keep_cpu_peak(achieved * jax.local_device_count())
    if self.peak_per_device:
      out["mfu"] = achieved / self.peak_per_device
    return out

  def describe(self) -> str:
    peak = (f"{self.peak_per_device / 1e12:.3g} TFLOP/s per device ({self.peak_source})"
            if self.peak_per_device else f"unknown ({self.peak_source}): no MFU")
    return (f"{self.flops_per_step / 1e12:.3g} TFLOP of model FLOPs per step; "
            f"peak {peak}")


def for_run(flops: float, n_devices: int, devices=None) -> Throughput:
  """Throughput figures for a step of `flops` model FLOPs on `n_devices` (on CPU, the
  host's kept peak, measured the first time)."""
  device = (devices or jax.devices())[0]
  if device.platform == "cpu":
    host, where = cpu_peak()
    local = jax.local_device_count()
    return Throughput(flops, n_devices, host / local,
                      f"fp32 matmul, {host / 1e9:.0f} GFLOP/s per host ({where}) shared by "
                      f"{local} device(s)", measured=True)
  acc = accelerator_for(device.device_kind)
  if acc is None:
    return Throughput(flops, n_devices, None, f"device kind {device.device_kind!r} is not "
                                              f"in shardlab/hardware.py")
  return Throughput(flops, n_devices, acc.peak_flops, f"{acc.name} dense bf16 peak")
