"""Settings compared on the peer config in one process, their steps alternating.

  .venv/bin/python bench/variants.py [--rounds N] [--steps N] VARIANT [VARIANT ...]

A VARIANT is space-free `--set` overrides joined by commas, e.g. `train.remat=none` against
`train.remat=none,train.scan_unroll=4` ("" is the defaults). The config is bench/peer.py's
(fsdp:8, bf16, 8 × 256 tokens). Every variant is compiled first; then each round runs
--steps steps of each, in turn, forwards and backwards on alternate rounds, so that a
machine busy with something else slows all of them alike. Between separate runs the same
step differed by 5% on a shared 2-core host; two identical variants here came out at 0.99
of each other (median of 8 rounds; single rounds 0.96-1.02). Prints per variant the
median ms/step, the compiled memory per device, the first step's loss, and the speed
against the first variant (the median of the rounds' ratios and their range).
"""

import argparse
import statistics
import time

import core  # bench/core.py: starts 8 simulated devices on import

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardlab import config  # noqa: E402
from shardlab.runtime import host_memory  # noqa: E402
from shardlab.sharding import mesh  # noqa: E402
from shardlab.training import run as run_lib  # noqa: E402
from shardlab.training import state as state_lib  # noqa: E402

MESH = "fsdp:8"


class Variant:
  """One compiled setting, its state and the step times of each round."""

  def __init__(self, overrides: str, the_mesh):
    self.name = overrides or "(defaults)"
    train = config.TrainConfig(global_batch=8, seq_len=256, precision="bf16", steps=10**6)
    cfg = config.Config(model=core.PEER_MODEL, mesh=MESH, strategy="fsdp", train=train)
    cfg = config.apply_overrides(cfg, [o for o in overrides.split(",") if o])
    abstract = run_lib.abstract_state(cfg)
    sh = run_lib.shardings(cfg, abstract, the_mesh, offload=True)
    self.state = state_lib.init_state(abstract, sh)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                               (8, cfg.train.seq_len + 1), dtype=np.int32)
    self.tokens = jax.device_put(tokens, sh.batch)
    self.step = run_lib.make_steps(cfg, abstract, sh)[0].lower(self.state, self.tokens).compile()
    self.mib = core.memory(self.step)["total"] / core.MiB
    self.loss = float(self.run(1)["loss"])
    self.times = []

  def run(self, steps: int):
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.tokens)
    jax.block_until_ready((self.state, metrics))
    return metrics


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("variants", nargs="+")
  p.add_argument("--rounds", type=int, default=8)
  p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
  args = p.parse_args()
  host_memory.reexec_with_huge_pages()  # as train.py does
  print(host_memory.describe())
  the_mesh = mesh.build(mesh.parse_inline(MESH))
  variants = []
  for overrides in args.variants:
    variants.append(Variant(overrides, the_mesh))
    print(f"compiled {variants[-1].name}", flush=True)
  for i in range(args.rounds):
    for v in variants if i % 2 == 0 else variants[::-1]:
      t0 = time.perf_counter()
      v.run(args.steps)
      v.times.append((time.perf_counter() - t0) / args.steps)
  first = variants[0].times
  for v in variants:
    ratios = [a / b for a, b in zip(first, v.times)]
    print(f"{v.name:40s} {statistics.median(v.times) * 1e3:7.1f} ms/step  {v.mib:6.1f} MiB  "
          f"loss {v.loss:.4f}  speed × first {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}]")


if __name__ == "__main__":
  main()
