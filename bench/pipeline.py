"""Pipeline step time against the predicted bubble, on 8 simulated CPU devices.

  .venv/bin/python bench/pipeline.py [--stages 1,2,4,8] [--microbatches 4,8,16]
                                     [--repeats 1,2] [--steps 3] [--json PATH]

For each stage count S (mesh stage:S,data:8/S, strategy dp), microbatch count M and schedule
(repeats R = 1 GPipe, R > 1 circular): the median of `--steps` train steps of a 16-layer
micro Llama (d_model 128, batch 128 × 16 tokens, fp32) after one warm-up step, beside
`bubble` = (S − 1)/(R·M + S − 1), the planner's figure, and `useful`: the fraction of
(stage, iteration) slots of the schedule that runs (shardlab/parallel/pipeline.occupancy, the index
arithmetic the loop itself uses) doing real work, which should equal 1 − bubble.

How to read it here: simulated devices share this machine's cores, so an idle stage frees
nothing; bubble iterations run their layers on zeros (parallel/pipeline.py), so a step costs
the work of T = R·M + S − 1 iterations on every stage, and `work/ideal` = T / (R·M) =
1 / (1 − bubble) is what the schedule itself predicts. `measured` is step time over the
S = 1 step time at the same M, which adds the schedule's own overheads (buffers, permutes).
On real devices the bubble is idle time instead, and the same ratio is the slowdown over a
bubble-free pipeline. The last line printed is JSON.
"""

import os

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={N_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardlab import config  # noqa: E402
from shardlab.parallel import pipeline  # noqa: E402
from shardlab.models.llama_config import LlamaConfig  # noqa: E402
from shardlab.sharding import mesh as mesh_lib  # noqa: E402
from shardlab.training import run as run_lib  # noqa: E402
from shardlab.training import state as state_lib  # noqa: E402

MODEL = LlamaConfig(name="bench-pp", vocab_size=256, d_model=128, n_layers=16, n_heads=8,
                    n_kv_heads=4, head_dim=16, mlp_dim=256, max_seq_len=16)
# 128 rows so 16 microbatches still split over data:8 at stage 1 (one row per device).
TRAIN = config.TrainConfig(steps=10, global_batch=128, seq_len=16, optimizer="adamw", lr=1e-3,
                           warmup_steps=1, precision="fp32", seed=0)


def step_time(stages: int, microbatches: int, repeats: int, steps: int) -> float:
  mesh_text = f"stage:{stages},data:{N_DEVICES // stages}"
  cfg = config.Config(model=MODEL, mesh=mesh_text, strategy="dp",
                      train=dataclasses.replace(TRAIN, microbatches=microbatches,
                                                pipeline_repeats=repeats))
  mesh = mesh_lib.make(mesh_text)
  abstract = run_lib.abstract_state(cfg)
  sh = run_lib.shardings(cfg, abstract, mesh)
  train_step = run_lib.make_steps(cfg, abstract, sh)[0]
  state = state_lib.init_state(abstract, sh)
  rng = np.random.default_rng(0)
  batch = jax.device_put(rng.integers(0, MODEL.vocab_size, (TRAIN.global_batch,
                                                            TRAIN.seq_len + 1), np.int32),
                         sh.batch)
  state, metrics = train_step(state, batch)  # compile and warm up
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ints = lambda text: [int(x) for x in text.split(",")]
  p.add_argument("--stages", type=ints, default=[1, 2, 4, 8])
  p.add_argument("--microbatches", type=ints, default=[4, 8, 16])
  p.add_argument("--repeats", type=ints, default=[1, 2])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--json", help="also write the rows here")
  args = p.parse_args()
  rows, base = [], {}
  print(f"{'stages':>6} {'micro':>5} {'schedule':>11} {'step ms':>8} {'bubble':>7} "
        f"{'useful':>7} {'work/ideal':>10} {'measured':>8}")
  for m in args.microbatches:
    for s in args.stages:
      for r in args.repeats:
        if (s == 1 and r > 1) or MODEL.n_layers % (s * r) or (r > 1 and m < s):
          continue
        t = step_time(s, m, r, args.steps)
        base.setdefault(m, t if s == 1 else None)
        bubble = pipeline.bubble(s, m, r)
        useful = float(pipeline.occupancy(s, m, r)[0].mean())  # structural: slots at work
        measured = t / base[m] if base.get(m) else float("nan")
        row = dict(stages=s, microbatches=m, repeats=r, step_s=t, bubble=bubble,
                   useful_slots=useful, work_over_ideal=1 / (1 - bubble),
                   measured_over_stage1=measured)
        rows.append(row)
        kind = "gpipe" if r == 1 else f"circular×{r}"
        print(f"{s:>6} {m:>5} {kind:>11} {t * 1e3:>8.1f} {bubble:>7.1%} {useful:>7.1%} "
              f"{1 / (1 - bubble):>10.2f} {measured:>8.2f}", flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=2))
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
