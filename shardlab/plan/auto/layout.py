"""`auto_layout(cfg)`: the layout search (auto.choice) for a run's Config, on the
devices that will run it or for a target that is not attached.

    choice = auto_layout(cfg)                     # the attached devices
    cfg = choice.apply(cfg)                       # strategy, mesh (remat, microbatches)
    choice = auto_layout(cfg, target="tpu-v5e", n_devices=256)   # planning, nothing attached
"""

import dataclasses
import os
import sys

import jax

from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.observe import throughput
from shardlab.observe.step_report import StepReport
from shardlab.plan.compiled import aot
from shardlab.plan.auto import choice as auto
from shardlab.plan.auto import module as auto_module
from shardlab.plan.training.estimate import Request
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib

AUTO = "auto"
# This host as a target: its simulated devices share its cores, memory and memory bus. Fixed
# figures, not measured ones, so that the same run searches the same way every time; only
# the relative costs of candidates on the same host matter.
HOST_FLOPS = 100e9  # FLOP/s of the whole host
HOST_BW = 10e9  # bytes/s the host moves, between memory and between devices' buffers


def host_cpu(n_devices: int) -> hardware.Accelerator:
  """This host as n simulated devices sharing its cores and memory (memory divided evenly)."""
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  share = lambda x: x / n_devices
  return hardware.Accelerator(
      "host-cpu", share(HOST_FLOPS), share(memory), share(HOST_BW), share(HOST_BW),
      share(HOST_BW), n_devices, 0.0, "cpu", efficiency=1.0,
      efficiency_source="assumed host figures, shared by its simulated devices")


def attached_target(devices) -> hardware.Accelerator:
  """The hardware table's entry for the attached devices, or this host for CPU devices."""
  kind = devices[0].device_kind
  if devices[0].platform == "cpu":
    return host_cpu(len(devices))
  acc = throughput.accelerator_for(kind)
  if acc is None:
    raise ConfigError(f"auto layout: device kind {kind!r} is not in shardlab/runtime/"
                      f"hardware.py; pass --target NAME or a target TOML file")
  return acc


def precision_name(cfg: Config, platform: str) -> str:
  """train.precision with 'auto' made explicit for the platform the step compiles for."""
  if cfg.train.precision != "auto":
    return cfg.train.precision
  return "fp32" if platform == "cpu" else "bf16"


def request(cfg: Config, n_devices: int, precision: str) -> Request:
  strategy = "fsdp" if cfg.strategy == AUTO else cfg.strategy
  cfg = dataclasses.replace(cfg, strategy=strategy)
  return Request.from_config(cfg, devices=n_devices, mesh=None).with_train(precision=precision)


def auto_layout(cfg: Config, devices=None, target: str | None = None,
                n_devices: int | None = None, top_k: int = 4, budget_s: float = 600.0,
                memory_options: bool = False, vary_microbatches: bool = True,
                say=lambda text: print(text, file=sys.stderr, flush=True),
                **module_options) -> auto.Choice:
  """The fastest layout that fits, for `cfg` with strategy and/or mesh "auto" (a fixed one
  is kept). On `devices` (default: every attached one) unless `target` and `n_devices` plan
  for hardware that is not attached: then the target's TPU topology when libtpu is
  installed, else as many simulated CPU devices. A module factory instead of `cfg` searches
  for any module (shardlab.plan.auto.module: optimizer=, batch=, loss_fn=, ...)."""
  if not isinstance(cfg, Config):
    return _for_module(cfg, devices, target, n_devices, top_k, say, module_options)
  if module_options:
    raise ConfigError(f"auto_layout: {sorted(module_options)} apply to a module factory, "
                      f"not to a run Config")
  if cfg.strategy != AUTO:
    rules_lib.strategy(cfg.strategy, cfg.rules)
  planning = target is not None and n_devices is not None and devices is None
  if not planning:
    devices = list(devices if devices is not None else jax.devices())
    n_devices = len(devices)
  acc = hardware.get(target) if target else attached_target(devices)
  backend = _backend(acc, devices, planning)
  precision = precision_name(cfg, "cpu" if backend == "cpu" else acc.kind)
  req = request(cfg, n_devices, precision)

  def compile_fn(o: auto.Option) -> StepReport:
    run_cfg = o.apply(cfg, precision)
    if not planning:
      return aot.compile_step(run_cfg, devices, f"{devices[0].platform} x{n_devices}")
    if backend == "tpu":
      return aot.compile_on_tpu(run_cfg, acc.topology, n_devices, _slices(o))
    return aot.compile_on_cpu(run_cfg, n_devices)

  choice = auto.choose(
      req, cfg.model, acc, n_devices, compile_fn, backend,
      strategy=None if cfg.strategy == AUTO else cfg.strategy,
      mesh=None if cfg.mesh == AUTO else cfg.mesh, memory_options=memory_options,
      vary_microbatches=vary_microbatches, top_k=top_k, budget_s=budget_s, say=say)
  return _agreed(choice)


def _for_module(factory, devices, target, n_devices, top_k, say, options):
  if target is not None or n_devices is not None:
    raise ConfigError("auto_layout of a module factory searches the attached devices; "
                      "target= and n_devices= apply to a run Config only")
  devices = list(devices if devices is not None else jax.devices())
  return auto_module.auto_layout_module(factory, attached_target(devices), devices,
                                        top_k=top_k, say=say, **options)


def _backend(acc: hardware.Accelerator, devices, planning: bool) -> str:
  if not planning:
    return devices[0].platform
  return "tpu" if acc.kind == "tpu" and aot.libtpu_available() else "cpu"


def _slices(option: auto.Option) -> int:
  spec = mesh_lib.load(option.mesh)
  return mesh_lib.MeshSpec(ici={}, dcn=spec.dcn).n_devices


def _agreed(choice: auto.Choice) -> auto.Choice:
  """Process 0's choice on every process: the budget's clock may stop the processes'
  searches at different candidates."""
  if jax.process_count() == 1:
    return choice
  import numpy as np
  from jax.experimental import multihost_utils
  index = next(i for i, c in enumerate(choice.candidates) if c is choice.winner)
  index = int(multihost_utils.broadcast_one_to_all(np.int32(index)))
  return dataclasses.replace(choice, winner=choice.candidates[index])


def for_request(req: Request, n_devices: int, on: str, top_k: int = 4,
                budget_s: float = 600.0, say=lambda text: None,
                found: list | None = None) -> auto.Choice:
  """`shardlab plan --search --compile`: the search for a planner Request, compiled `on`
  "tpu" (the target's topology) or "cpu" (simulated devices). `found`: the planner's own
  search of it (not run twice)."""
  from shardlab.plan.compiled import train_step as plan_compile
  acc = hardware.get(req.target)

  def compile_fn(o: auto.Option) -> StepReport:
    r = dataclasses.replace(req, strategy=o.strategy).with_train(
        remat=o.remat, microbatches=o.microbatches)
    cfg = plan_compile.run_config(r, mesh_lib.load(o.mesh))
    if on == "tpu":
      return aot.compile_on_tpu(cfg, acc.topology, n_devices, _slices(o))
    return aot.compile_on_cpu(cfg, n_devices)

  return auto.choose(req, req.model_config(), acc, n_devices, compile_fn, on,
                     top_k=top_k, budget_s=budget_s, say=say, found=found)
