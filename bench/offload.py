"""Host offload and LoRA: what they cost in step time and save in memory.

  .venv/bin/python bench/offload.py [--only cpu lora tpu] [--steps N] [--json PATH]

cpu   tiny and 125m on 8 simulated CPU devices (fsdp:8, bf16, 8 × 128 tokens): step time
      and XLA's compiled memory per device with the optimizer state in host memory
      (train.offload=opt_state) or the layer inputs kept there (train.remat=offload), against
      neither. XLA:CPU reports no host/device split (its "host" is the same RAM), so only the
      TPU rows show what moves.
lora  LoRA (rank 16 on q,k,v,o,gate,up,down) against a full fine-tune, same models and mesh:
      step time, trained parameters and compiled memory per device.
tpu   the real TPU compiler for v5e-256 (libtpu, no TPU): llama2-7b at 1 × 2048 tokens per
      chip and llama2-70b at 2 (a batch the reference trainer cannot fit), fsdp, bf16, plain
      XLA attention (the presets' `auto` would take the splash kernel), per option: device
      and host GiB per chip beside the planner's. Minutes per compile on two
      cores.
Every timed step runs after compilation and warmup steps, each waited for. The last line is
the results as JSON.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import core  # noqa: E402  (simulates the CPU devices before JAX starts)

from shardlab import config  # noqa: E402
from shardlab.models import registry  # noqa: E402

GiB = 2**30
BATCH, SEQ = 8, 128  # the CPU rows' tokens per step: 125m takes ~10 s a step on 2 cores
LORA = config.LoraConfig(rank=16, alpha=32.0)
CPU_OPTIONS = {"none": {}, "offload opt_state": dict(offload="opt_state"),
               "remat offload": dict(remat="offload"), "remat full": dict(remat="full")}
TPU_CASES = [  # (model, sequences per chip, option name, overrides)
    ("llama2-7b", 1, "none", []),
    ("llama2-7b", 1, "offload opt_state", ["train.offload=opt_state"]),
    ("llama2-7b", 1, "remat offload", ["train.remat=offload"]),
    ("llama2-70b", 2, "remat offload", ["train.remat=offload"]),
    ("llama2-70b", 2, "remat offload + offload opt_state",
     ["train.remat=offload", "train.offload=opt_state"]),
]


def cpu_rows(args, options: dict) -> list[dict]:
  rows = []
  for model in args.models:
    cfg = registry.load(model)
    for name, kw in options.items():
      r = core.run_train(cfg, "fsdp:8", "fsdp", BATCH, SEQ, "bf16", args.steps, 1, **kw)
      r.update(model=model, option=name, trained=_trained(cfg, kw.get("lora")))
      rows.append(r)
      print(f"{model:5s} {name:18s} {r['step_s'] * 1e3:8.1f} ms/step  "
            f"{r['memory']['total'] / 2**20:8.1f} MiB/device  trained "
            f"{r['trained'] / 1e6:7.2f}M params", flush=True)
  return rows


def _trained(cfg, lora) -> int:
  return cfg.n_lora_params(lora) if lora else cfg.n_params


def tpu_rows() -> list[dict]:
  from shardlab.plan.compiled import aot
  from shardlab.plan.compiled import train_step as plan_compile
  from shardlab.plan.training import planner as plan
  rows = []
  for model, per_chip, name, overrides in TPU_CASES:
    req = plan.Request.of(model=model, precision="bf16", global_batch=256 * per_chip,
                          seq_len=2048, remat="full", strategy="fsdp", devices=256,
                          target="tpu-v5e")
    cfg = config.apply_overrides(plan_compile.run_config(req, plan_compile._spec(req)),
                                 ["model.attention=xla", *overrides])
    report = aot.compile_on_tpu(cfg, "v5e", 256)
    req = req.with_train(remat=cfg.train.remat, offload=cfg.train.offload)
    est = plan.estimate(req, cfg.model, plan.hardware.get("tpu-v5e"), plan_compile._spec(req))
    row = {"model": model, "per_chip": per_chip, "option": name,
           "device_gib": report.total_bytes / GiB, "host_gib": report.host_bytes / GiB,
           "planned_device_gib": est.memory.total / GiB, "planned_host_gib": est.memory.host / GiB,
           "fits": report.total_bytes <= est.usable_bytes, "compile_s": report.compile_s}
    rows.append(row)
    print(f"{model:10s} {per_chip}/chip {name:34s} device {row['device_gib']:6.2f} GiB "
          f"(planned {row['planned_device_gib']:6.2f}), host {row['host_gib']:5.2f} GiB "
          f"(planned {row['planned_host_gib']:5.2f}); {'fits' if row['fits'] else 'does not fit'} "
          f"15.75 GiB; compiled in {row['compile_s']:.0f} s", flush=True)
  return rows


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", nargs="*", choices=("cpu", "lora", "tpu"), default=["cpu", "lora"])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--models", nargs="*", default=["tiny", "125m"], help="CPU rows' presets")
  p.add_argument("--json", help="also write the results here")
  args = p.parse_args()
  out = {}
  if "cpu" in args.only:
    out["cpu"] = cpu_rows(args, CPU_OPTIONS)
  if "lora" in args.only:
    out["lora"] = cpu_rows(args, {"full fine-tune": {}, "LoRA rank 16": dict(lora=LORA)})
  if "tpu" in args.only:
    out["tpu"] = tpu_rows()
  text = json.dumps(out)
  if args.json:
    Path(args.json).write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
