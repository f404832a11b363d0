"""What gradient accumulation holds: the compiled step's bytes per device with 1 and 4
microbatches, and what accumulating inside the layer scan saves
(shardlab/parallel/accumulate.py).

  .venv/bin/python bench/accumulation.py [--model 125m] [--tpu-model llama2-7b] [--no-tpu]

FSDP over 4 devices, bf16 compute over fp32 weights, AdamW, full remat. Four compiles each:
  1 microbatch     the bf16 working copy of the weights is read through the step
  4, shipped       each layer's gradient added into the fp32 sum in the scan's backward;
                   each layer cast from the stored fp32 weights as it runs (no working copy)
  4, working copy  the scan reads the step's bf16 working copy of the stack instead
  4, sum after     in-scan accumulation off: each microbatch's whole gradient beside the sum
on 4 simulated CPU devices (--model, 4 sequences of 256 tokens a device) and, where libtpu
is installed (no TPU needed), for a v5p topology of 4 chips (--tpu-model, 4 sequences of
2048 a chip: bench/plan_tpu.py's llama2-7b/v5p-8 row). The last line is the results as JSON.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import core  # noqa: E402  (simulates the CPU devices before JAX starts)

import jax  # noqa: E402

from shardlab.models import registry  # noqa: E402
from shardlab.parallel import accumulate  # noqa: E402
from shardlab.plan.compiled import aot  # noqa: E402
from shardlab.plan.compiled import train_step as plan_compile  # noqa: E402
from shardlab.plan.training import planner as plan  # noqa: E402

GiB = 2 ** 30
DEVICES = 4
VARIANTS = {
    "1 microbatch": (1, contextlib.nullcontext),
    "4, shipped": (4, contextlib.nullcontext),
    "4, working copy": (4, accumulate.reading_the_working_copy),
    "4, sum after": (4, lambda: mock.patch.object(accumulate, "active", return_value=None)),
}


def request(model: str, microbatches: int, target: str, seq_len: int) -> plan.Request:
  return plan.Request.of(model=model, precision="bf16", global_batch=4 * DEVICES,
                         seq_len=seq_len, remat="full", strategy="fsdp", devices=DEVICES,
                         target=target, microbatches=microbatches)


def measure(model: str, where: str) -> dict:
  """{variant: compiled bytes per device}."""
  target, seq_len = ("tpu-v5p", 2048) if where == "tpu" else ("a100-80g", 256)
  out = {}
  for name, (m, switch) in VARIANTS.items():
    req = request(model, m, target, seq_len)
    cfg = plan_compile.run_config(req, plan_compile._spec(req))
    with switch():
      r = (aot.compile_on_tpu(cfg, "v5p", DEVICES) if where == "tpu"
           else aot.compile_on_cpu(cfg, DEVICES))
    out[name] = r.total_bytes
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="125m", help="the CPU compiles' model")
  p.add_argument("--tpu-model", default="llama2-7b", help="the TPU compiles' model")
  p.add_argument("--no-tpu", action="store_true", help="skip the TPU-topology compiles")
  args = p.parse_args()
  # Starts the CPU backend, so the compiles run in this process, where the switches apply
  # (aot.compile_on_cpu otherwise compiles in a subprocess).
  assert len(jax.devices("cpu")) >= DEVICES, "fewer devices than bench/core simulates"
  runs = [("cpu", args.model)]
  if not args.no_tpu and aot.libtpu_available():
    runs.append(("tpu", args.tpu_model))
  results = {}
  for where, model in runs:
    n = registry.load(model).n_params
    results[where] = measure(model, where)
    print(f"{where}: {model}, {n / 1e6:.1f}M params; per device: the bf16 working copy's "
          f"shard {n * 2 / DEVICES / GiB:.3f} GiB, an fp32 gradient shard "
          f"{n * 4 / DEVICES / GiB:.3f} GiB")
    for name, b in results[where].items():
      print(f"  {name:18s} {b / GiB:8.3f} GiB")
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
