"""How many accelerators does the biggest Llama take — to train, and to serve? The tables in
docs/serving.md, from the planners (nothing is compiled; about half a minute on 2 cores).

  .venv/bin/python bench/seed_question.py          # prints the markdown tables

Training: AdamW, bf16 compute with fp32 master weights and moments, full remat, 1024
sequences of 4096 tokens per step; the fewest devices at any microbatch count
(`shardlab plan`'s any-microbatch answer). Serving (`shardlab plan serve`): an 8192-token
context, or the model's max_seq_len where that is shorter (llama2-70b: 4096; `plan serve`
refuses more), batch 1 and 32, bf16 and int8 weights, bf16 KV cache, one sequence
prefilled at a time; the fewest devices over tensor × stage × data layouts and the roofline
decode speed there. tests/test_seed_question.py checks that docs/serving.md holds this output.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.models import registry  # noqa: E402
from shardlab.plan.serving import terms as inf  # noqa: E402
from shardlab.plan.serving import planner as inference_plan  # noqa: E402
from shardlab.plan.training import planner  # noqa: E402
from shardlab.runtime import hardware  # noqa: E402

MODELS = ("llama2-70b", "llama3-70b", "llama3-405b")
TARGETS = ("a100-80g", "h100-80g", "tpu-v5e", "tpu-v5p")
SERVING = (("bf16", 1), ("bf16", 32), ("int8", 1), ("int8", 32))
CONTEXT = 8192
TRAIN_BATCH, TRAIN_SEQ = 1024, 4096


def training_cell(model: str, target: str) -> str:
  req = planner.Request.of(model=model, target=target, optimizer="adamw", precision="bf16",
                           global_batch=TRAIN_BATCH, seq_len=TRAIN_SEQ, remat="full",
                           devices=8)
  mins, _ = planner.min_devices(req, registry.load(model), hardware.get(target))
  best = mins["any_microbatches"]
  if best is None:
    return "does not fit"
  # The sequence split (context parallelism), if it is: "context=4" or "context=1×2dcn".
  context = re.search(r"context=(\S+)", best["mesh"])
  degree = math.prod(int(n) for n in re.findall(r"\d+", context.group(1))) if context else 1
  return (f"**{best['devices']}** ({best['strategy']}"
          f"{f', context {degree}' if degree > 1 else ''}, {best['microbatches']} "
          f"microbatch{'es' if best['microbatches'] > 1 else ''}, {best['step_s']:.0f} s/step)")


def context(model: str) -> int:
  return min(CONTEXT, registry.load(model).max_seq_len)


def serving_cell(model: str, target: str, weights: str, batch: int) -> str:
  req = inf.Request(model=model, target=target, batch=batch, context=context(model),
                    weights=weights)
  best = inference_plan.plan(req).min_devices["overall"]
  layout = f"t{best['tensor']}" + (f"×s{best['stage']}" if best["stage"] > 1 else "") + \
      (f"×d{best['data']}" if best["data"] > 1 else "")
  return (f"**{best['devices']}** ({layout}, "
          f"{best['decode_tokens_per_s_per_seq']:,.0f} tok/s/seq)")


def markdown() -> str:
  head = ("| model | target | train | " +
          " | ".join(f"serve {w} b{b}" for w, b in SERVING) + " |")
  lines = [head, "|" + "---|" * (3 + len(SERVING))]
  for model in MODELS:
    for target in TARGETS:
      cells = [training_cell(model, target)] + [serving_cell(model, target, w, b)
                                                for w, b in SERVING]
      lines.append(f"| {model} | {target} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(markdown())
