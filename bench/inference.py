"""Decode tokens/s of `generate` on 8 simulated CPU devices against the inference planner's
prediction for this machine's measured memory bandwidth (and matmul FLOP/s).

  .venv/bin/python bench/inference.py [--steps N] [--json PATH]

The machine is measured first, the way the 8 simulated devices share it: an elementwise
update of a 1 GiB fp32 array sharded over them (read + write) gives the bandwidth, a 1024²
fp32 matmul the FLOP/s; each simulated device gets an eighth of both. The planner then
predicts the decode step of each case (fp32 weights and cache, the `tp` rules on the
case's mesh) on that "accelerator", and generate runs it with random weights: one batch of
8 equal prompts, greedy, compile kept out. ratio = measured / predicted.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from shardlab import config as config_lib  # noqa: E402
from shardlab import generate  # noqa: E402
from shardlab.models import registry  # noqa: E402
from shardlab.observe import throughput  # noqa: E402
from shardlab.plan.serving import terms as inf  # noqa: E402
from shardlab.plan.serving import estimate as inf_estimate  # noqa: E402
from shardlab.runtime import hardware  # noqa: E402
from shardlab.sharding import mesh as mesh_lib  # noqa: E402
from shardlab.training import run as run_lib  # noqa: E402
from shardlab.training import state as state_lib  # noqa: E402

N = 8
# model, mesh (data × tensor), rows, prompt tokens, new tokens
CASES = (("tiny", "data:4,tensor:2", 8, 64, 192), ("125m", "data:2,tensor:4", 8, 64, 192))


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
  """Bytes/s the 8 simulated devices move together: x ← 1.0001·x, read and written."""
  mesh = jax.make_mesh((N,), ("x",), devices=jax.devices()[:N])
  sharding = NamedSharding(mesh, PartitionSpec("x"))
  n = int(gib * 2**30 / 4)
  x = jax.device_put(np.ones(n, np.float32), sharding)
  step = jax.jit(lambda a: a * 1.0001, in_shardings=sharding, out_shardings=sharding,
                 donate_argnums=0)
  x = jax.block_until_ready(step(x))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    x = jax.block_until_ready(step(x))
    best = min(best, time.perf_counter() - start)
  return 2 * n * 4 / best


def this_machine(bandwidth: float, flops: float) -> hardware.Accelerator:
  """One simulated device: an eighth of the host's bandwidth and matmul FLOP/s."""
  return hardware.Accelerator("this-cpu/8", flops / N, 64 * 2**30, bandwidth / N,
                              bandwidth / N, bandwidth / N, N, 0, "cpu")


def run_case(model_name: str, mesh: str, rows: int, prompt: int, new: int):
  model = registry.load(model_name)
  cfg = config_lib.Config(model=model, mesh=mesh, strategy="tp",
                          train=config_lib.TrainConfig(precision="fp32", optimizer="sgd"))
  device_mesh = mesh_lib.build(mesh_lib.load(mesh), jax.devices()[:N])
  abstract = run_lib.abstract_state(cfg)
  sh = run_lib.shardings(cfg, abstract, device_mesh)
  params = state_lib.init_state(abstract, sh).params
  gen = generate.Generator(cfg, abstract, sh)
  prompts = [np.arange(prompt, dtype=np.int32) % 256] * rows
  sampling = generate.Sampling(max_new_tokens=new, temperature=0.0, top_k=0)
  return gen.generate(params, prompts, sampling)[1]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="bench/inference.py")
  p.add_argument("--json", help="write the figures here too")
  args = p.parse_args(argv)
  bandwidth = measure_bandwidth()
  flops = throughput.measure_cpu_matmul()
  acc = this_machine(bandwidth, flops)
  print(f"this machine: {bandwidth / 1e9:.1f} GB/s (elementwise, 8 devices together), "
        f"{flops / 1e9:.1f} GFLOP/s (fp32 matmul); per simulated device an eighth")
  print(f"{'model':6s} {'mesh':16s} {'rows':>4s} {'context':>7s} {'measured':>10s} "
        f"{'predicted':>10s} {'ratio':>6s}  bound   (decode tokens/s, all rows)")
  out = []
  for model_name, mesh, rows, prompt, new in CASES:
    report = run_case(model_name, mesh, rows, prompt, new)
    req = inf.Request(model=model_name, batch=rows, context=prompt + new, weights="fp32",
                      kv_dtype="fp32", mesh=mesh)
    est = inf_estimate.estimate(req, registry.load(model_name), acc,
                                inf.layout_from_mesh(mesh))
    ratio = report.decode_tokens_per_s / est.decode.tokens_per_s
    print(f"{model_name:6s} {mesh:16s} {rows:4d} {prompt + new:7d} "
          f"{report.decode_tokens_per_s:10,.0f} {est.decode.tokens_per_s:10,.0f} "
          f"{ratio:6.3f}  {est.decode.bound}")
    out.append({"model": model_name, "mesh": mesh, "rows": rows, "context": prompt + new,
                "measured": report.as_dict(), "predicted": dataclasses.asdict(est.decode),
                "ratio": ratio})
  if args.json:
    Path(args.json).write_text(json.dumps({"bandwidth": bandwidth, "flops": flops,
                                           "cases": out}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
