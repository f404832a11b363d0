"""Compiles the real train step for TPU topologies (needs libtpu; no TPU) and prints per-chip
memory, the compiler's compute estimate and compile time beside the planner's analytic
figures and a reference trainer's.

  .venv/bin/python bench/plan_tpu.py [--only llama2-7b/v5e-256 ...] [--per-chip N]
      [--set model.attention=flash ...] [--dump DIR] [--json PATH] [--maxtext] [--recipes]

`--recipes` compiles MaxText's published training recipes (RECIPES: its model tables for
v5p and v6e, their batch, sequence, remat policy, attention and, where a recipe lists them,
its TPU compiler flags, given to both) with both tools, alternating, and prints per-chip
memory and compute side by side.

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

from shardlab import config, remat  # noqa: E402
from shardlab.models import registry  # noqa: E402
from shardlab.observe import hlo_cycles  # noqa: E402
from shardlab.plan.compiled import aot  # noqa: E402
from shardlab.plan.compiled import train_step as plan_compile  # noqa: E402
from shardlab.plan.training import planner as plan  # noqa: E402

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One training setup, compiled for a TPU topology (the name's part after "/", as MaxText
  names it: v5p-128 is 64 chips) by shardlab and, with --maxtext, by MaxText."""
  model: str
  target: str  # shardlab's hardware target
  chips: int
  per_chip: int = 1  # sequences per chip (--per-chip overrides it for CONFIGS)
  seq_len: int = 2048
  remat: str = "full"  # shardlab's train.remat
  attention: str = "xla"  # shardlab's model.attention ("flash": the splash kernel on TPU)
  maxtext: tuple[str, ...] = ()  # MaxText's own keys for the recipe (its remat_policy, ...)
  reference_gib: float | None = None  # a figure from another day, for orientation only
  reference_s: float | None = None
  source: str = ""  # where the recipe is published
  maxtext_model: str | None = None  # MaxText's model_name where it is not `model`
  # The recipe's TPU compiler flags (its xla_flags): MaxText's compile gets them as its
  # launcher passes them (LIBTPU_INIT_ARGS), shardlab's as compiler options of its compile.
  # Its splash kernel's 2048-wide blocks need the larger scoped VMEM to compile at all.
  libtpu_flags: tuple[str, ...] = ()
  # shardlab's own settings for the recipe (config KEY=VALUE, before any --set).
  settings: tuple[str, ...] = ()


# Our setups: FSDP over every chip, full remat, plain attention (the reference's defaults).
CONFIGS = {
    "llama2-7b/v5e-256": Recipe("llama2-7b", "tpu-v5e", 256, reference_gib=2.95,
                                reference_s=38),
    "llama2-70b/v5e-256": Recipe("llama2-70b", "tpu-v5e", 256, reference_gib=14.23,
                                 reference_s=43),
    "llama2-7b/v5p-8": Recipe("llama2-7b", "tpu-v5p", 4, reference_gib=31.0),
}
# MaxText's published training recipes (its benchmarks/maxtext_*_model_configs.py, the
# model tables users copy), each with the closest settings shardlab offers: FSDP over every
# chip, splash attention (MaxText's "autoselected" takes its splash kernel on a TPU), and
# MaxText's remat policy by its shardlab name (shardlab/remat.py). MaxText's splash block
# sizes and embedding layout are passed to MaxText as published; shardlab keeps its own.
_V5P = "benchmarks/maxtext_v5p_model_configs.py"
_V6E = "benchmarks/maxtext_trillium_model_configs.py"
_SPLASH_BLOCKS = ("sa_block_q=1024", "sa_block_q_dkv=2048", "sa_block_q_dq=2048")
# The Llama 3.1 recipes' splash kernel: 2048-wide blocks everywhere, the fused backward.
_SPLASH_2048 = (*(f"sa_block_{b}=2048" for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv",
                                                  "kv_dkv_compute", "q_dq", "kv_dq")),
                "sa_use_fused_bwd_kernel=True")
# The recipes' xla_flags (benchmarks/xla_flags_library.py). Left out everywhere:
# CF_FOR_ALL_GATHER (libtpu 0.0.50 refuses continuation fusion on a compile-only v5p and
# v6e alike: "not supported/recommended on platforms other than TPU v5e"; MaxText's own
# comment calls it enabled by default) and the Llama 3.1 8B's SparseCore all-reduce
# offloading (a compile-only topology has none).
_DENSE_VMEM_LIMIT = ("--xla_tpu_scoped_vmem_limit_kib=98304",)
_DATA_PARALLEL_OVERLAP = ("--xla_tpu_enable_data_parallel_all_reduce_opt=true",
                          "--xla_tpu_data_parallel_opt_different_sized_ops=true")
# The Llama 3.1 recipes': DENSE_VMEM_LIMIT_FLAG and HOST_OFFLOAD_FLAGS; the 8B's also
# LAYOUT_FOR_ALL_REDUCE_SCATTER and DATA_PARALLEL_OVERLAP.
_LLAMA31_FLAGS = (
    *_DENSE_VMEM_LIMIT,
    "--xla_tpu_enable_all_experimental_scheduler_features=true",
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true",
    "--xla_tpu_host_transfer_overlap_limit=24",
    "--xla_tpu_aggressive_opt_barrier_removal=ENABLED",
    "--xla_lhs_prioritize_async_depth_over_stall=ENABLED",
    "--xla_tpu_enable_ag_backward_pipelining=true",
    "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED",
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED",
    "--xla_max_concurrent_host_send_recv=100",
    "--xla_tpu_scheduler_percent_shared_memory_limit=100",
    "--xla_latency_hiding_scheduler_rerun=2")
_LLAMA31_8B_FLAGS = (*_LLAMA31_FLAGS, "--xla_tpu_use_minor_sharding_for_major_trivial_input=true",
                     "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1",
                     "--xla_tpu_assign_all_reduce_scatter_layout=true",
                     *_DATA_PARALLEL_OVERLAP)


def _custom(offloaded: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
  """(shardlab's train.remat, MaxText's keys) for MaxText's `custom` policy that offloads
  the decoder layer's input and `offloaded` projections and recomputes the rest."""
  ours = remat.custom(offloaded=(remat.LAYER_INPUT, *offloaded))
  return ours, ("remat_policy=custom", "decoder_layer_input=offload",
                *(f"{n}=offload" for n in offloaded))


_LLAMA31_8B = _custom((*remat.QKV, "out_proj"))
_LLAMA31_70B = _custom(remat.QKV)
RECIPES = {
    "llama2_7b_v5p_128/v5p-128": Recipe(
        "llama2-7b", "tpu-v5p", 64, 4, 4096, "save-matmul-outputs", "flash",
        ("remat_policy=minimal", "use_iota_embed=True"), source=_V5P,
        libtpu_flags=_DATA_PARALLEL_OVERLAP),
    "llama2_70b_v5p_128/v5p-128": Recipe(
        "llama2-70b", "tpu-v5p", 64, 4, 4096, "save-dot-except-mlpwi", "flash",
        ("remat_policy=save_dot_except_mlpwi", "use_iota_embed=True"), source=_V5P,
        libtpu_flags=_DATA_PARALLEL_OVERLAP),
    "llama2-7b-4096/v6e-256": Recipe(
        "llama2-7b", "tpu-v6e", 256, 12, 4096, "full", "flash",
        ("remat_policy=full", "use_iota_embed=True", *_SPLASH_BLOCKS), source=_V6E,
        libtpu_flags=_DENSE_VMEM_LIMIT),
    # MaxText splits its FSDP over fsdp_transpose here (the same chips, the weights'
    # other dimension); shardlab's FSDP splits the embedding dimension.
    "llama2_70b_4096_synthetic/v6e-256": Recipe(
        "llama2-70b", "tpu-v6e", 256, 2, 4096, "qkv-proj-offloaded", "flash",
        ("remat_policy=qkv_proj_offloaded", "ici_fsdp_parallelism=1",
         "ici_fsdp_transpose_parallelism=-1", "use_iota_embed=True", *_SPLASH_BLOCKS),
        source=_V6E, libtpu_flags=_DENSE_VMEM_LIMIT),
    # Llama 3.1 (the llama3 presets: the same shapes; 3.1's RoPE scaling changes only the
    # rotation frequencies) at 8192 tokens, MaxText's custom policy offloading the decoder
    # input and projections. MaxText's logits are bf16, shardlab's fp32: shardlab runs its
    # loss in 2048-position chunks (the whole 4-5 × 8192 × 128,256 fp32 logits are 16-20
    # GiB of a 32 GiB chip).
    "llama3_1-8b-8192/v6e-256": Recipe(
        "llama3-8b", "tpu-v6e", 256, 4, 8192, _LLAMA31_8B[0], "flash",
        (*_LLAMA31_8B[1], "use_iota_embed=True", *_SPLASH_2048),
        source=_V6E, maxtext_model="llama3.1-8b", libtpu_flags=_LLAMA31_8B_FLAGS,
        settings=("train.loss_chunk=2048",)),
    "llama3_1-70b-8192/v6e-256": Recipe(
        "llama3-70b", "tpu-v6e", 256, 5, 8192, _LLAMA31_70B[0], "flash",
        (*_LLAMA31_70B[1], "use_iota_embed=True", *_SPLASH_2048),
        source=_V6E, maxtext_model="llama3.1-70b", libtpu_flags=_LLAMA31_FLAGS,
        settings=("train.loss_chunk=2048",)),
}
ALL = CONFIGS | RECIPES


def _attention(r: Recipe, overrides) -> str:
  return next((o.partition("=")[2] for o in overrides if o.startswith("model.attention=")),
              r.attention)


def run(name: str, per_chip: int | None = None, overrides=(), dump: Path | None = None) -> dict:
  r = ALL[name]
  per_chip = per_chip or r.per_chip
  # The recipe's attention unless --set names one, in the planner's figures too (the
  # presets' "auto" would take the splash kernel on a TPU where a row asks for plain).
  attention = _attention(r, overrides)
  model_cfg = dataclasses.replace(registry.load(r.model), attention=attention)
  req = plan.Request.of(model=model_cfg, precision="bf16", global_batch=r.chips * per_chip,
                        seq_len=r.seq_len, remat=r.remat, strategy="fsdp", devices=r.chips,
                        target=r.target)
  spec = plan_compile._spec(req)
  cfg = config.apply_overrides(plan_compile.run_config(req, spec),
                               [*r.settings, *overrides])
  acc = plan.hardware.get(r.target)
  # `--set model.*` and `train.*` (microbatches, remat, ...) reach the planner too.
  est = plan.estimate(dataclasses.replace(req, train=cfg.train), cfg.model, acc, spec)
  cpu0 = time.process_time()
  report = aot.compile_on_tpu(cfg, acc.topology, r.chips,
                              dump=dump / name.replace("/", "_") if dump else None,
                              options=dict(f.removeprefix("--").split("=", 1)
                                           for f in r.libtpu_flags))
  cpu_s = time.process_time() - cpu0
  cmp = plan_compile.compare(report, est)
  return {
      "config": name, "per_chip": per_chip, "seq_len": r.seq_len, "remat": r.remat,
      "attention": attention, "overrides": [*r.settings, *overrides],
      "where": report.where,
      "compiled_gib": report.total_bytes / GiB, "host_gib": report.host_bytes / GiB,
      "analytic_gib": est.memory.total / GiB, "analytic_host_gib": est.memory.host / GiB,
      "ratio_total": cmp["ratio"]["total"],
      "ratio_state": cmp["ratio"]["state"], "fits": report.total_bytes <= acc.usable_bytes,
      "usable_gib": acc.usable_bytes / GiB, "compile_s": report.compile_s,
      "compile_cpu_s": cpu_s, "reference_gib": r.reference_gib,
      "reference_compile_s": r.reference_s, "source": r.source,
      "collectives": report.kinds(), "analytic_collectives": est.collectives,
      "cycles": report.cycles, "compute_s": hlo_cycles.seconds(report.cycles, acc.topology),
  }


def maxtext_keys(name: str, per_chip: int | None, overrides) -> list[str]:
  """MaxText's config keys for `name` and the `--set` keys it has an equivalent of."""
  r = ALL[name]
  keys = [f"model_name={r.maxtext_model or r.model}",
          f"per_device_batch_size={per_chip or r.per_chip}",
          f"max_target_length={r.seq_len}", *r.maxtext]
  attention = _attention(r, overrides)
  keys.append(f"attention={'flash' if attention == 'flash' else 'dot_product'}")
  for item in overrides:
    key, _, value = item.partition("=")
    if key == "model.n_layers":
      keys += [f"base_num_decoder_layers={value}", "override_model_config=True"]
    elif key == "model.attention_scores":  # MaxText's default is "compute"
      flag = str(value == "fp32")
      keys += [f"float32_qk_product={flag}", f"float32_logits={flag}"]
  return keys


def with_maxtext(r: dict, name: str, per_chip: int | None, overrides) -> dict:
  """`r` with MaxText's compile of the same recipe, and shardlab's ratios to it."""
  import maxtext_tpu
  topology = name.partition("/")[2]
  theirs = maxtext_tpu.compile_recipe(topology, maxtext_keys(name, per_chip, overrides),
                                      ALL[name].libtpu_flags)
  chip = ALL[name].target.removeprefix("tpu-")
  r["maxtext"] = {**theirs, "gib": theirs["total_bytes"] / GiB,
                  "host_gib": theirs["host_bytes"] / GiB,
                  "compute_s": hlo_cycles.seconds(theirs["cycles"], chip)}
  r["memory_vs_maxtext"] = r["compiled_gib"] / r["maxtext"]["gib"]
  r["compute_vs_maxtext"] = r["cycles"] / theirs["cycles"] if theirs["cycles"] else None
  return r


def _compute(cycles: int, seconds: float | None) -> str:
  return f"{seconds:.3f} s" if seconds is not None else f"{cycles / 1e9:.2f} Gcycles"


def _line(name: str, r: dict, overrides) -> str:
  ref = (f"reference {r['reference_gib']:.2f}; " if r["reference_gib"] else "")
  ref_s = f"≈{r['reference_compile_s']} s" if r["reference_compile_s"] else "n/a"
  host = f" + {r['host_gib']:.2f} host" if r["host_gib"] else ""
  without = (" (of the config without --set)" if any(
      not o.startswith(("model.", "train.")) for o in overrides) else "")
  return (f"{name:20s} {r['where']:16s} compiled {r['compiled_gib']:6.2f} GiB per chip{host} "
          f"({ref}usable {r['usable_gib']:.2f}; "
          f"{'fits' if r['fits'] else 'DOES NOT FIT'})  analytic{without} "
          f"{r['analytic_gib']:6.2f} GiB "
          f"(ratio {r['ratio_total']:.3f}, state {r['ratio_state']:.3f})  compile "
          f"{r['compile_s']:.1f} s wall, {r['compile_cpu_s']:.1f} s CPU (reference {ref_s}); "
          f"compute estimate {_compute(r['cycles'], r['compute_s'])}")


def _maxtext_line(r: dict) -> str:
  m = r["maxtext"]
  vs = f" (x{r['compute_vs_maxtext']:.3f})" if r["compute_vs_maxtext"] else ""
  host = f" + {m['host_gib']:.2f} host" if m["host_gib"] else ""
  return (f"{'':20s} MaxText, same run: {m['gib']:6.2f} GiB per chip{host} (shardlab "
          f"x{r['memory_vs_maxtext']:.3f}), compute estimate "
          f"{_compute(m['cycles'], m['compute_s'])}{vs}, compile {m['compile_s']:.1f} s wall")


def recipes_table(results: list[dict]) -> str:
  """The --recipes table: each recipe's per-chip memory (device, and host where a policy
  offloads) and compute estimate on both sides."""
  rows = ["| MaxText recipe | chips | batch × seq a chip | shardlab's remat (and settings) | "
          "shardlab GiB | MaxText GiB | memory × MaxText | compute × MaxText |",
          "|" + "---|" * 8]
  for r in results:
    rec, m = ALL[r["config"]], r["maxtext"]
    host = lambda x: f" + {x:.2f} host" if x else ""  # noqa: E731
    vs = f"{r['compute_vs_maxtext']:.3f}" if r["compute_vs_maxtext"] else "n/a"
    rows.append(f"| {r['config']} | {rec.chips} | {r['per_chip']} × {rec.seq_len} | "
                f"{' '.join((rec.remat, *rec.settings))} | "
                f"{r['compiled_gib']:.2f}{host(r['host_gib'])} | "
                f"{m['gib']:.2f}{host(m['host_gib'])} | {r['memory_vs_maxtext']:.3f} | {vs} |")
  return "\n".join(rows)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", nargs="*", choices=list(ALL), help="configs or recipes to run")
  p.add_argument("--recipes", action="store_true",
                 help="MaxText's published recipes (RECIPES), compiled by both, as a table")
  p.add_argument("--per-chip", type=int, help="sequences per chip (default: the config's)")
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                 help="config overrides, e.g. model.attention=flash train.loss_chunk=1024")
  p.add_argument("--dump", type=Path, help="write XLA's dumps here, a folder per config")
  p.add_argument("--json", help="also write the results here")
  p.add_argument("--maxtext", action="store_true",
                 help="compile each recipe with MaxText too, alternating, and compare")
  args = p.parse_args()
  args.maxtext = args.maxtext or args.recipes
  if not aot.libtpu_available():
    print("libtpu is not installed: pip install 'jax[tpu]==0.10.2' (works without a TPU)")
    return 1
  if args.maxtext:
    import maxtext_tpu
    if not maxtext_tpu.maxtext_available():
      print("--maxtext: MaxText's venv is missing: bash ../shared/peers/maxtext/run.sh install")
      return 1
  results = []
  for name in args.only or (RECIPES if args.recipes else CONFIGS):
    r = run(name, args.per_chip, args.set, args.dump)
    print(_line(name, r, args.set), flush=True)
    if args.maxtext:
      print(f"{name}: compiling with MaxText ...", flush=True)
      r = with_maxtext(r, name, args.per_chip, args.set)
      print(_maxtext_line(r), flush=True)
    results.append(r)
  if args.recipes:
    print(recipes_table(results))
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f"peak resident memory of this process: {peak:.2f} GiB")
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=2))
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
