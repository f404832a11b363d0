"""`plan --compile`: compile the real step for the planned mesh and set XLA's figures beside
the analytic ones (ratio = analytic / compiled).

On CPU, XLA lowers a reduce-scatter as an all-reduce followed by a slice, so the analytic
figures it is compared with are computed the same way there; the TPU compiler forms real
reduce-scatters.
"""

import dataclasses

from shardlab.plan.compiled import aot
from shardlab import config as config_lib
from shardlab.runtime import accelerators, devices, jax_compat
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.plan.training import planner as plan_lib
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.observe.step_report import StepReport
from shardlab.runtime.units import gib



def inline_mesh(spec: mesh_lib.MeshSpec) -> str:
  parts = [f"{a}:{spec.ici.get(a, 1)}" for a in spec.axis_names]
  parts += [f"dcn.{a}:{s}" for a, s in spec.dcn.items() if s > 1]
  return ",".join(parts)


def run_config(req: plan_lib.Request, spec: mesh_lib.MeshSpec) -> config_lib.Config:
  """The run Config of the request on `spec`, inline (the compile's subprocess rebuilds it)."""
  return plan_lib.run_config(req, req.model_config(), inline_mesh(spec))


def _spec(req: plan_lib.Request) -> mesh_lib.MeshSpec:
  return plan_lib.resolve_mesh(req, req.model_config(), hardware.get(req.target))


def prepare_cpu_devices(req: plan_lib.Request) -> None:
  """Simulates the mesh's device count on CPU, if no backend has started yet (else the
  compile runs in a subprocess that has them)."""
  if not jax_compat.backends_are_initialized():
    devices.simulate(_spec(req).n_devices)


def cpu_only() -> None:
  """Keeps JAX on the CPU backend (no probing for a TPU when libtpu is installed)."""
  import jax
  if not jax_compat.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")


def compare(report: StepReport, est: plan_lib.Estimate) -> dict:
  mem = est.memory
  analytic = {"state_bytes": mem.state + mem.batch, "total_bytes": mem.total,
              "collectives": est.collectives}
  ratio = {"state": analytic["state_bytes"] / max(report.argument_bytes, 1),
           "total": mem.total / max(report.total_bytes, 1)}
  for kind, b in est.collectives.items():
    got = report.kinds().get(kind, {}).get("bytes", 0)
    if got or b:
      ratio[kind] = b / got if got else None  # analytic traffic the compiler did not emit
  return {"report": report.as_dict(), "analytic": analytic, "ratio": ratio,
          "fits": report.total_bytes <= est.usable_bytes, "usable_bytes": est.usable_bytes}


def where(req: plan_lib.Request, choice: str = "auto") -> tuple[str, ...]:
  """Where to compile: ("cpu",), ("tpu",), both, or ("gpu",). auto: the TPU compiler for a
  TPU target when libtpu is installed (its figures are the ones that matter there), else
  CPU; gpu only when asked, on a machine with a GPU."""
  kind = hardware.get(req.target).kind
  if choice == "gpu":
    if kind != "gpu":
      raise ConfigError(f"--compile-on gpu needs a GPU target, got {req.target!r}")
    if not accelerators.accelerator_present():
      raise ConfigError("--compile-on gpu compiles on this machine's GPU, and it has none "
                        "(no /dev/nvidia*): use --compile-on cpu")
    spec = _spec(req)
    if mesh_lib.MeshSpec(ici={}, dcn=spec.dcn).n_devices > 1:
      # Each mocked process holds this machine's GPUs, not a node of the plan's.
      raise ConfigError(f"--compile-on gpu mocks processes of this machine's GPUs, not the "
                        f"plan's nodes, so the mesh {inline_mesh(spec)!r} cannot be laid "
                        f"out: its DCN axes group GPUs into nodes; plan one node's mesh (no "
                        f"dcn.* axes) or use --compile-on cpu")
    return ("gpu",)
  tpu_target = kind == "tpu"
  if choice in ("tpu", "both") and not tpu_target:
    raise ConfigError(f"--compile-on {choice} needs a TPU target, got {req.target!r}")
  if choice in ("tpu", "both") and not aot.libtpu_available():
    raise ConfigError(f"--compile-on {choice} needs libtpu: pip install 'jax[tpu]==0.10.2' "
                      f"(it installs and compiles without a TPU)")
  if choice == "auto":
    return ("tpu",) if tpu_target and aot.libtpu_available() else ("cpu",)
  return ("cpu", "tpu") if choice == "both" else (choice,)


def attach(result: plan_lib.Plan, on: tuple[str, ...] = ("cpu",)) -> plan_lib.Plan:
  """Compiles the planned step on simulated CPU devices and/or the target's TPU topology,
  or on GPUs mocked on this machine's."""
  req, acc = result.request, result.target
  spec = _spec(req)
  cfg = run_config(req, spec)
  compiled = []
  if "cpu" in on:
    cpu = aot.compile_on_cpu(cfg, spec.n_devices)
    cpu_est = plan_lib.estimate(req, result.model, acc, spec, backend="cpu")
    compiled.append(dict(compare(cpu, cpu_est), precision=req.train.precision))
  if "gpu" in on:  # XLA:GPU forms real reduce-scatters: the target's own figures
    gpu = aot.compile_on_gpu(cfg, spec.n_devices)
    compiled.append(dict(compare(gpu, result.estimate), precision=req.train.precision))
  if "tpu" in on:
    slices = mesh_lib.MeshSpec(ici={}, dcn=spec.dcn).n_devices
    tpu = aot.compile_on_tpu(cfg, acc.topology, spec.n_devices, slices)
    compiled.append(dict(compare(tpu, result.estimate), precision=req.train.precision))
  return dataclasses.replace(result, compiled=compiled)


def render(compiled: list[dict]) -> list[str]:
  lines = ["compiled train step (XLA memory analysis per device; ratio = analytic/compiled)"]
  for c in compiled:
    r, a, q = c["report"], c["analytic"], c["ratio"]
    lines.append(f"  {r['where']}: compiled in {r['compile_s']:.1f} s")
    if r["where"].startswith("cpu") and c.get("precision") != "fp32":
      lines.append("    (XLA:CPU computes bf16 in fp32: its temporaries are not what a GPU or "
                   "TPU holds; trust its state and collective counts)")
    lines.append(f"    state (arguments)          {gib(r['argument_bytes'], 9, 3)}   "
                 f"analytic {gib(a['state_bytes'], 9, 3)}   ratio {q['state']:.3f}")
    lines.append(f"    total (arg+out-alias+temp) {gib(r['total_bytes'], 9, 3)}   "
                 f"analytic {gib(a['total_bytes'], 9, 3)}   ratio {q['total']:.3f}   "
                 f"{'fits' if c['fits'] else 'DOES NOT FIT'} in "
                 f"{gib(c['usable_bytes'])}")
    for kind, s in r["kinds"].items():
      if not s["ops"] and not a["collectives"].get(kind):
        continue
      ratio = q.get(kind)
      lines.append(f"    {kind:18s} {s['count']:5d} runs ({s['ops']:3d} ops) "
                   f"{gib(s['bytes'], 9, 3)}   analytic "
                   f"{gib(a['collectives'].get(kind, 0), 9, 3)}" +
                   (f"   ratio {ratio:.3f}" if ratio is not None else ""))
    if r["where"].startswith("tpu") and "reduce-scatter" in q and "all-reduce" in q:
      lines.append("    (the TPU compiler all-reduces some gradients it could reduce-scatter; "
                   "compare their sum)")
  return lines



# The reference grid the planner's per-device memory is checked on (tests/test_plan_compile.py;
# bench/plan_grid.py prints it, docs/planning.md has the table): the real presets in fp32
# (XLA:CPU computes bf16 in fp32), one sequence per simulated device. GPT-2's learned position
# table stops at 1024 tokens, and its 50257-word vocabulary does not split over tensor=2, so
# under fsdp_tp it stays whole.
GRID_DEVICES = {"125m": 8, "gpt2-124m": 8, "llama2-7b": 64}
GRID_SEQS = {"125m": (512, 2048), "gpt2-124m": (512, 1024), "llama2-7b": (512, 2048)}
GRID = tuple((model, strategy, remat, seq) for model in GRID_DEVICES
             for strategy in ("fsdp", "zero2", "fsdp_tp") for remat in ("none", "full")
             for seq in GRID_SEQS[model])


def grid_request(model: str, strategy: str, remat: str, seq_len: int) -> plan_lib.Request:
  n = GRID_DEVICES[model]
  mesh = {"fsdp": f"fsdp:{n}", "zero2": f"data:{n}", "fsdp_tp": f"fsdp:{n // 2},tensor:2"}
  whole_vocab = strategy == "fsdp_tp" and registry.load(model).vocab_size % 2
  rules = ({table: {"vocab": None} for table in ("params", "opt_state", "activations")}
           if whole_vocab else {})
  return plan_lib.Request.of(model=model, precision="fp32", global_batch=n, seq_len=seq_len,
                             remat=remat, strategy=strategy, mesh=mesh[strategy],
                             target="a100-80g", rules=rules)


def compare_on_cpu(req: plan_lib.Request) -> dict:
  """compare() for the request's step compiled on as many simulated CPU devices as its mesh
  has, beside the analytic figures spelled for CPU."""
  spec = _spec(req)
  report = aot.compile_on_cpu(run_config(req, spec), spec.n_devices)
  est = plan_lib.estimate(req, req.model_config(), hardware.get(req.target), spec,
                          backend="cpu")
  return compare(report, est)
