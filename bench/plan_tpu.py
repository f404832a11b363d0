"""Compiles the real train step for TPU topologies (needs libtpu; no TPU) and prints per-chip
memory, the compiler's compute estimate and compile time beside the planner's analytic
figures and a reference trainer's.

  .venv/bin/python bench/plan_tpu.py [--only llama2-7b/v5e-256 ...] [--per-chip N]
      [--set model.attention=flash ...] [--dump DIR] [--json PATH] [--maxtext]

The compute estimate is XLA:TPU's `estimated_cycles` summed over the step with loop trip
counts (shardlab.observe.hlo_cycles), in seconds at the chip's TensorCore clock. With
`--maxtext`, MaxText compiles the same recipe in the same run (bench/maxtext_tpu.py; its
venv from ../shared/peers/maxtext/run.sh install) and both sides' memory and compute are
printed; `--set model.attention=...` and `model.n_layers=...` are passed on to it, other
`--set` keys change shardlab's side only.

Setup (the reference's): FSDP over all chips, one sequence of 2048 per chip (--per-chip to
see how each grows with the batch), full remat, fp32 weights and Adam moments with bf16
compute, plain XLA attention (`--set` changes any of it, e.g. `model.n_layers=2` for a
quick look; `--dump DIR` writes XLA's buffer assignment per config, docs/performance.md
says what to read). tests/test_plan_tpu.py holds the v5e-256 rows within 15%.
Reference per-chip totals (argument + output − alias + temp), from another JAX trainer's AOT
tool on this machine (jax 0.12, libtpu 0.0.50): llama2-7b v5e-256 2.95 GiB in ≈38 s,
llama2-70b v5e-256 14.23 GiB in ≈43 s, llama2-7b v5p-8 (4 chips) 31.0 GiB.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab import config  # noqa: E402
from shardlab.models import registry  # noqa: E402
from shardlab.observe import hlo_cycles  # noqa: E402
from shardlab.plan.compiled import aot  # noqa: E402
from shardlab.plan.compiled import train_step as plan_compile  # noqa: E402
from shardlab.plan.training import planner as plan  # noqa: E402

GiB = 2**30
CONFIGS = {
    # name: (model, target, chips, reference GiB, reference compile s)
    "llama2-7b/v5e-256": ("llama2-7b", "tpu-v5e", 256, 2.95, 38),
    "llama2-70b/v5e-256": ("llama2-70b", "tpu-v5e", 256, 14.23, 43),
    "llama2-7b/v5p-8": ("llama2-7b", "tpu-v5p", 4, 31.0, None),
}


def run(name: str, per_chip: int = 1, overrides=(), dump: Path | None = None) -> dict:
  model, target, chips, ref_gib, ref_s = CONFIGS[name]
  # Plain XLA attention unless --set names one: the reference's setup (the presets' "auto"
  # takes the splash kernel on a TPU), in the planner's figures too.
  attention = next((o.partition("=")[2] for o in overrides
                    if o.startswith("model.attention=")), "xla")
  model_cfg = dataclasses.replace(registry.load(model), attention=attention)
  req = plan.Request.of(model=model_cfg, precision="bf16", global_batch=chips * per_chip,
                        seq_len=2048, remat="full", strategy="fsdp", devices=chips, target=target)
  spec = plan_compile._spec(req)
  cfg = config.apply_overrides(plan_compile.run_config(req, spec), list(overrides))
  acc = plan.hardware.get(target)
  est = plan.estimate(req, model_cfg, acc, spec)
  cpu0 = time.process_time()
  report = aot.compile_on_tpu(cfg, acc.topology, chips,
                              dump=dump / name.replace("/", "_") if dump else None)
  cpu_s = time.process_time() - cpu0
  cmp = plan_compile.compare(report, est)
  return {
      "config": name, "per_chip": per_chip, "overrides": list(overrides),
      "where": report.where,
      "compiled_gib": report.total_bytes / GiB,
      "analytic_gib": est.memory.total / GiB, "ratio_total": cmp["ratio"]["total"],
      "ratio_state": cmp["ratio"]["state"], "fits": report.total_bytes <= acc.usable_bytes,
      "usable_gib": acc.usable_bytes / GiB, "compile_s": report.compile_s,
      "compile_cpu_s": cpu_s, "reference_gib": ref_gib, "reference_compile_s": ref_s,
      "collectives": report.kinds(), "analytic_collectives": est.collectives,
      "cycles": report.cycles, "compute_s": hlo_cycles.seconds(report.cycles, acc.topology),
  }


def maxtext_keys(name: str, per_chip: int, overrides) -> list[str]:
  """MaxText's config keys for config `name` (its topology after the "/") and the `--set`
  keys it has an equivalent of."""
  model = CONFIGS[name][0]
  keys = [f"model_name={model}", f"per_device_batch_size={per_chip}"]
  for item in overrides:
    key, _, value = item.partition("=")
    if key == "model.attention":
      keys.append(f"attention={'flash' if value == 'flash' else 'dot_product'}")
    elif key == "model.n_layers":
      keys += [f"base_num_decoder_layers={value}", "override_model_config=True"]
  return keys


def with_maxtext(r: dict, name: str, per_chip: int, overrides) -> dict:
  """`r` with MaxText's compile of the same recipe, and shardlab's ratios to it."""
  import maxtext_tpu
  topology = name.partition("/")[2]
  theirs = maxtext_tpu.compile_recipe(topology, maxtext_keys(name, per_chip, overrides))
  chip = CONFIGS[name][1].removeprefix("tpu-")
  r["maxtext"] = {**theirs, "gib": theirs["total_bytes"] / GiB,
                  "compute_s": hlo_cycles.seconds(theirs["cycles"], chip)}
  r["memory_vs_maxtext"] = r["compiled_gib"] / r["maxtext"]["gib"]
  r["compute_vs_maxtext"] = r["cycles"] / theirs["cycles"] if theirs["cycles"] else None
  return r


def _compute(cycles: int, seconds: float | None) -> str:
  return f"{seconds:.3f} s" if seconds is not None else f"{cycles / 1e9:.2f} Gcycles"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", nargs="*", choices=list(CONFIGS), help="configs to run")
  p.add_argument("--per-chip", type=int, default=1, help="sequences per chip (default 1)")
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                 help="config overrides, e.g. model.attention=flash train.loss_chunk=1024")
  p.add_argument("--dump", type=Path, help="write XLA's dumps here, a folder per config")
  p.add_argument("--json", help="also write the results here")
  p.add_argument("--maxtext", action="store_true",
                 help="compile each recipe with MaxText too, alternating, and compare")
  args = p.parse_args()
  if not aot.libtpu_available():
    print("libtpu is not installed: pip install 'jax[tpu]==0.10.2' (works without a TPU)")
    return 1
  if args.maxtext:
    import maxtext_tpu
    if not maxtext_tpu.maxtext_available():
      print("--maxtext: MaxText's venv is missing: bash ../shared/peers/maxtext/run.sh install")
      return 1
  results = []
  for name in args.only or CONFIGS:
    r = run(name, args.per_chip, args.set, args.dump)
    if args.maxtext:
      print(f"{name}: compiled by shardlab; compiling with MaxText ...", flush=True)
      r = with_maxtext(r, name, args.per_chip, args.set)
    results.append(r)
    ref_s = f"≈{r['reference_compile_s']} s" if r["reference_compile_s"] else "n/a"
    without = (" (of the config without --set)" if any(
        not o.startswith("model.attention=") for o in args.set) else "")
    print(f"{name:20s} {r['where']:16s} compiled {r['compiled_gib']:6.2f} GiB per chip "
          f"(reference {r['reference_gib']:.2f}; usable {r['usable_gib']:.2f}; "
          f"{'fits' if r['fits'] else 'DOES NOT FIT'})  analytic{without} "
          f"{r['analytic_gib']:6.2f} GiB "
          f"(ratio {r['ratio_total']:.3f}, state {r['ratio_state']:.3f})  compile "
          f"{r['compile_s']:.1f} s wall, {r['compile_cpu_s']:.1f} s CPU (reference {ref_s}); "
          f"compute estimate {_compute(r['cycles'], r['compute_s'])}", flush=True)
    if "maxtext" in r:
      m = r["maxtext"]
      vs = f" (x{r['compute_vs_maxtext']:.3f})" if r["compute_vs_maxtext"] else ""
      print(f"{'':20s} MaxText, same run: {m['gib']:6.2f} GiB per chip (shardlab "
            f"x{r['memory_vs_maxtext']:.3f}), compute estimate "
            f"{_compute(m['cycles'], m['compute_s'])}{vs}, compile {m['compile_s']:.1f} s wall",
            flush=True)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f"peak resident memory of this process: {peak:.2f} GiB")
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=2))
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
