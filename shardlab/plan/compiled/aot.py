"""Ahead-of-time compile of the real train step with abstract inputs: nothing is allocated.

The step is `run.make_steps` — the function train.py runs — lowered with
ShapeDtypeStructs that carry their shardings, then compiled for
  * N simulated CPU devices (this process if it has them, else a subprocess started with
    --xla_force_host_platform_device_count=N), or
  * a TPU topology (v4/v5e/v5p/v6e) through jax.experimental.topologies, when libtpu is
    installed: the real TPU compiler's memory analysis, from a machine without a TPU, or
  * N GPUs mocked on this machine's (JAX's `mock_num_gpu_processes`: the GPU client
    presents N processes' worth of this machine's GPUs and compiles their collectives;
    nothing runs): XLA:GPU's memory analysis for a node's worth of GPUs from one.
The report holds XLA's per-device memory analysis and the collectives in the optimised HLO.

    python -m shardlab.plan.compiled.aot --json '<Config as JSON>' --devices N [--gpu]
    (the subprocess form)
"""

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax

from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.observe import step_report
from shardlab.observe.step_report import StepReport
from shardlab.runtime import compile_only, devices as devices_lib, jax_compat
from shardlab.runtime import signal_dispositions, xla_flags
from shardlab.training import run as run_lib
from shardlab.training import state as state_lib


ACCELERATOR_TYPES = {"v4": "v4-8", "v5e": "v5litepod-8", "v5p": "v5p-8", "v6e": "v6e-8"}


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def tpu_topology_name(prefix: str, n_chips: int) -> str:
  """'v5e:16x16', 'v5p:4x4x4', 'v5p:2x2x1': balanced power-of-two sides, 2-D tori for
  v5e/v6e and 3-D for v4/v5p, spelled as Cloud TPU names its slices."""
  if n_chips < 1 or n_chips & (n_chips - 1):
    raise ConfigError(f"a TPU slice here has a power-of-two chip count, got {n_chips}")
  dims = 2 if prefix in ("v5e", "v6e") else 3
  sides = [1] * dims
  for i in range(n_chips.bit_length() - 1):
    sides[i % dims] *= 2
  sides = sorted(sides, reverse=min(sides) == 1 and dims == 3)
  return f"{prefix}:{'x'.join(map(str, sides))}"


def tpu_devices(prefix: str, n_chips: int, num_slices: int = 1):
  """Compile-only TPU devices for `num_slices` slices of `n_chips // num_slices` chips."""
  if not libtpu_available():
    raise ConfigError("compiling for a TPU topology needs libtpu: pip install "
                      "'jax[tpu]==0.10.2' (it installs on machines without a TPU)")
  # Compile-only use takes no TPU, so libtpu's one-process lockfile would only stop a second
  # planner (or a test run beside one) from compiling at the same time.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # libtpu looks for the TPU VM it runs on at start-up and logs errors when there is none;
  # naming a one-host slice of the same generation keeps it quiet (the topology compiled for
  # is the one passed below).
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", ACCELERATOR_TYPES[prefix])
  from jax.experimental import topologies
  per_slice = n_chips // num_slices
  name = tpu_topology_name(prefix, per_slice)
  host_bounds = (1, 1, 1) if per_slice == 1 else (2, 2, 1) if per_slice >= 4 else (2, 1, 1)
  # One core per chip: v4's two TensorCores as one megacore device, like v5p's.
  chip_config = "megacore" if prefix == "v4" else "default"
  # libtpu's load leaves SIGHUP ignored for the whole process (runtime/signal_dispositions.py).
  with signal_dispositions.kept(frozenset({signal.SIGHUP})):
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        chip_config_name=chip_config,
                                        chips_per_host_bounds=host_bounds,
                                        num_slices=num_slices)
  return topo.devices, name


def compile_step(cfg: Config, devices, where: str, dump: str | None = None,
                 options: dict | None = None) -> StepReport:
  """Lowers and compiles the train step over `devices` with abstract, sharded inputs; `dump`:
  a folder for XLA's dumps (`compile_train_step`); `options`: compiler options for this
  compile (a TPU recipe's flags, {"xla_tpu_scoped_vmem_limit_kib": "98304"})."""
  compiled, mesh, seconds = compiled_step(cfg, devices, dump, options)
  return step_report.report(compiled, mesh, where, seconds, flops=True)


def compiled_step(cfg: Config, devices, dump: str | None = None, options: dict | None = None):
  """(the compiled train step of `cfg` over `devices`, its mesh, the compile's seconds): for
  a caller that reads the program itself."""
  if cfg.train.precision == "auto":
    raise ConfigError("train.precision must be explicit for an AOT compile (not 'auto', "
                      "which depends on the backend this process runs on)")
  p = run_lib.place(cfg, devices, offload=True)
  train_step = run_lib.make_steps(cfg, p.abstract, p.shardings)[0]
  compiled, seconds = _compiled(train_step, p.abstract, p.shardings,
                                run_lib.abstract_batch(cfg, p.shardings), dump, options)
  return compiled, p.shardings.mesh, seconds


def compile_train_step(train_step, abstract: state_lib.Abstract,
                       shardings: state_lib.Shardings, batch,
                       where: str = "", dump: str | None = None) -> StepReport:
  """Compiles any module's train step (`shardlab.train_step`) for the devices of
  `shardings.mesh` — simulated CPU devices, or a TPU topology from `tpu_devices` — with
  `batch` a tree of ShapeDtypeStructs: XLA's memory per device and the collectives, with
  nothing allocated. With `dump`, XLA writes its programs and buffer assignment there (for a
  TPU too): `*memory-usage-report.txt` lists the largest buffers, `*live-range.txt` ends
  with what is live at the peak."""
  compiled, seconds = _compiled(train_step, abstract, shardings, batch, dump)
  return step_report.report(compiled, shardings.mesh, where, seconds, flops=True)


def _compiled(train_step, abstract: state_lib.Abstract, shardings: state_lib.Shardings,
              batch, dump: str | None, options: dict | None = None):
  state = state_lib.placed(abstract.state, shardings.state)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                      sharding=shardings.batch), batch)
  devices = shardings.mesh.devices.flat
  start = time.perf_counter()
  extra = (options or {}) | ({"xla_dump_to": str(dump)} if dump else {})
  compiled = compile_only.compile_lowered(train_step.lower(state, batch), devices[0].platform,
                                          extra or None)
  return compiled, time.perf_counter() - start


def compile_on_cpu(cfg: Config, n_devices: int) -> StepReport:
  """On n simulated CPU devices: here if this process has at least n, else in a subprocess
  (the device count is fixed once a backend starts)."""
  if jax_compat.backends_are_initialized() or "device_count" in os.environ.get("XLA_FLAGS", ""):
    cpus = jax.devices("cpu")
    if len(cpus) >= n_devices:
      return compile_step(cfg, cpus[:n_devices], f"cpu x{n_devices}")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(_strip_device_count(os.environ.get("XLA_FLAGS", "")) +
                        f" --xla_force_host_platform_device_count={n_devices}").strip())
  return _in_subprocess(cfg, n_devices, env)


def compile_on_gpu(cfg: Config, n_devices: int) -> StepReport:
  """On n GPUs mocked on this machine's, in a subprocess: the mock must be set before JAX
  starts its GPU client."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # JAX's own pick
  return _in_subprocess(cfg, n_devices, env, "--gpu")


def mocked_gpus(n: int) -> list:
  """n GPU devices mocked on this machine's GPU, to compile for and never run: call before
  JAX starts its backend (the mock and XLA_FLAGS are read then)."""
  # Autotuning times candidate kernels for every matmul on the real GPU, which a program
  # nobody runs does not need: on an H200, llama2-7b for 8 mocked GPUs compiled in 5.6 s
  # without it and not within 150 s with it.
  xla_flags.add("--xla_gpu_autotune_level=0")
  jax.config.update("mock_num_gpu_processes", n)
  gpus = jax.devices()  # JAX falls back to the CPU when it finds no GPU
  if gpus[0].platform != "gpu":
    raise ConfigError(f"JAX sees no GPU here (its devices: {gpus[0].platform}): compiling "
                      "for mocked GPUs needs an NVIDIA GPU and JAX's CUDA plugin (pip "
                      "install 'shardlab[cuda12]' or 'shardlab[cuda13]')")
  return gpus[:n]


def _in_subprocess(cfg: Config, n_devices: int, env: dict, *flags: str) -> StepReport:
  cmd = [sys.executable, "-m", "shardlab.plan.compiled.aot", "--devices", str(n_devices),
         "--json", json.dumps(dataclasses.asdict(cfg)), *flags]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
    if proc.returncode == 2:
      raise ConfigError(tail[0].removeprefix("error: "))
    raise RuntimeError(f"the compile subprocess failed: {tail[0]}")
  return StepReport.from_dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def compile_on_tpu(cfg: Config, prefix: str, n_chips: int, num_slices: int = 1,
                   dump: str | None = None, options: dict | None = None) -> StepReport:
  devices, name = tpu_devices(prefix, n_chips, num_slices)
  where = f"tpu {name}" + (f" x{num_slices} slices" if num_slices > 1 else "")
  return compile_step(cfg, devices, where, dump, options)


def _strip_device_count(flags: str) -> str:
  return " ".join(f for f in flags.split() if "device_count" not in f)


def _config_from_json(text: str) -> Config:
  return registry.run_config_from_dict(json.loads(text))


def main(argv=None) -> int:
  import argparse
  p = argparse.ArgumentParser(prog="python -m shardlab.plan.compiled.aot")
  p.add_argument("--json", required=True, help="the Config, as dataclasses.asdict JSON")
  p.add_argument("--devices", type=devices_lib.SIMULATED, required=True,
                 help="simulated CPU devices, or mocked GPUs, to compile for (%(type)s)")
  p.add_argument("--gpu", action="store_true",
                 help="compile for --devices GPUs mocked on this machine's GPU")
  args = p.parse_args(argv)
  try:
    cfg = _config_from_json(args.json)
    if args.gpu:
      report = compile_step(cfg, mocked_gpus(args.devices), f"gpu x{args.devices} (mocked)")
    else:
      report = compile_step(cfg, jax.devices("cpu")[:args.devices], f"cpu x{args.devices}")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(report.as_dict()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
