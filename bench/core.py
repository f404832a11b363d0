"""Core throughput figures on 8 simulated CPU devices.

  .venv/bin/python bench/core.py [--steps N] [--warmup N] [--only strategies flops peer]
                                 [--json PATH]

strategies  tokens/s and median step time per strategy on 8 devices, against the same model
            and global batch on 1 device (tiny preset, 16 × 128 tokens by default);
flops       achieved model FLOP/s of 1-device steps (tiny fp32, 125m bf16) against a jitted
            matmul of the same precision;
peer        the peer-reference config (llama-style, 4 × d256, vocab 32k, seq 256, batch 8,
            AdamW, bf16, fsdp:8) at remat full and none, alternating with MaxText when its
            venv exists (bench/peer.py), with compiled memory per device.
Every timed step runs after compilation (AOT) and `--warmup` untimed steps, and each is
waited for with block_until_ready. The last line printed is the results as JSON.
"""


import os

from shardlab.runtime import devices, host_memory  # noqa: E402  (starts no backend)

N_DEVICES = 8
# bench/gpu_checks.py runs the peer config on a GPU: "native" keeps JAX's own devices.
if os.environ.get("SHARDLAB_BENCH_DEVICES") != "native":
  devices.simulate(N_DEVICES)  # as train.py does: one thread per simulated device

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardlab import config  # noqa: E402
from shardlab.models import registry  # noqa: E402
from shardlab.parallel import dot  # noqa: E402
from shardlab.models.llama_config import LlamaConfig  # noqa: E402
from shardlab.sharding import mesh  # noqa: E402
from shardlab.training import run as run_lib  # noqa: E402
from shardlab.training import state as state_lib  # noqa: E402

PEER_MODEL = LlamaConfig(name="peer", vocab_size=32000, d_model=256, n_layers=4,
                         n_heads=4, n_kv_heads=4, head_dim=64, mlp_dim=1024)
MiB = 2**20


def tp_mesh(m: LlamaConfig) -> str:
  """The widest tensor axis (8, 4, 2) that divides every tensor-sharded dim; data takes the rest."""
  for t in (8, 4, 2):
    if all(d % t == 0 for d in (m.n_heads, m.n_kv_heads, m.mlp_dim, m.vocab_size)):
      return f"tensor:{t}" if t == N_DEVICES else f"data:{N_DEVICES // t},tensor:{t}"
  return f"data:{N_DEVICES}"


def memory(compiled) -> dict:
  """Per-device bytes from XLA's compiled memory analysis."""
  ma = compiled.memory_analysis()
  parts = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias",
                                                                 "temp")}
  parts["total"] = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
  return parts


def run_train(model_cfg, mesh_text: str, strategy: str, batch: int, seq: int, precision: str,
              steps: int, warmup: int, devices=None, loss_chunk: int = 0,
              remat: str = "none", offload: str = "none", scan_unroll: int = 1,
              lora: config.LoraConfig = config.LoraConfig()) -> dict:
  """Compiles one train step, runs `warmup` untimed steps, then times `steps` steps."""
  train = config.TrainConfig(global_batch=batch, seq_len=seq, precision=precision,
                             steps=warmup + steps + 1, loss_chunk=loss_chunk,
                             remat=remat, offload=offload, scan_unroll=scan_unroll)
  cfg = config.Config(model=model_cfg, mesh=mesh_text, strategy=strategy, train=train,
                      lora=lora)
  the_mesh = mesh.build(mesh.parse_inline(mesh_text), devices=devices)
  abstract = run_lib.abstract_state(cfg)
  sh = run_lib.shardings(cfg, abstract, the_mesh, offload=True)
  t_state = time.perf_counter()  # time to the first step counts from making the state
  state = state_lib.init_state(abstract, sh)
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch, seq + 1),
                                             dtype=np.int32)
  tokens = jax.device_put(tokens, sh.batch)

  t0 = time.perf_counter()
  compiled = run_lib.make_steps(cfg, abstract, sh)[0].lower(state, tokens).compile()
  compile_s = time.perf_counter() - t0

  times, cpu_times = [], []
  for i in range(warmup + steps):
    t0, c0 = time.perf_counter(), time.process_time()
    state, metrics = compiled(state, tokens)
    jax.block_until_ready((state, metrics))
    if i == 0:
      first_step_s = time.perf_counter() - t_state
    if i >= warmup:
      times.append(time.perf_counter() - t0)
      cpu_times.append(time.process_time() - c0)
  step_s = statistics.median(times)
  return {"mesh": mesh_text, "strategy": strategy, "precision": precision,
          "devices": the_mesh.devices.size, "batch": batch, "seq": seq,
          "step_s": step_s, "cpu_s": statistics.median(cpu_times), "tokens_per_s": batch * seq / step_s, "compile_s": compile_s,
          "first_step_s": first_step_s,
          "timed_steps": f"{warmup + 1}-{warmup + steps}", "loss": float(metrics["loss"]),
          "memory": memory(compiled)}


def matmul_flops(dtype=np.float32, n: int = 2048, reps: int = 10) -> float:
  """FLOP/s of a jitted n×n @ n×n matmul on one device (median of `reps`). For bf16, the
  faster of a bf16 result and bf16 × bf16 → fp32 (which of the two is faster depends on the
  host's CPU: shardlab/parallel/dot.py), so the reference is the best bf16 matmul this host runs."""
  rng = np.random.default_rng(0)
  dev = jax.devices()[0]
  a, b = (jax.device_put(rng.standard_normal((n, n), np.float32).astype(dtype), dev)
          for _ in range(2))
  best = 0.0
  for out in {np.dtype(dtype), np.dtype(np.float32)}:
    f = jax.jit(lambda x, y: jax.numpy.matmul(x, y, preferred_element_type=out))
    f = f.lower(a, b).compile()
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(a, b))
      times.append(time.perf_counter() - t0)
    best = max(best, 2 * n**3 / statistics.median(times))
  return best


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
  """cols: (header, key, format spec)."""
  cells = [[h for h, _, _ in cols]] + [[format(r[k], f) for _, k, f in cols] for r in rows]
  widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
  return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def bench_strategies(args, one_device: dict) -> list[dict]:
  model_cfg = registry.load("tiny")
  layouts = [("dp", "data:8"), ("zero1", "data:8"), ("zero2", "data:8"), ("fsdp", "fsdp:8"),
             ("tp", tp_mesh(model_cfg)), ("fsdp_tp", "fsdp:4,tensor:2")]
  rows = [dict(one_device, ratio=1.0)]
  for strategy, mesh_text in layouts:
    r = run_train(model_cfg, mesh_text, strategy, args.batch, args.seq, "fp32", args.steps,
                  args.warmup)
    rows.append(dict(r, ratio=r["step_s"] / one_device["step_s"]))
  for r in rows:
    r["mem_mib"] = r["memory"]["total"] / MiB
    r["step_ms"] = r["step_s"] * 1e3
  print(f"\n== strategies: tiny, {args.batch}×{args.seq} tokens/step, fp32, "
        f"median of steps {rows[0]['timed_steps']} ==")
  print(table(rows, [("strategy", "strategy", "s"), ("mesh", "mesh", "s"),
                     ("step ms", "step_ms", ".1f"), ("tokens/s", "tokens_per_s", ",.0f"),
                     ("× 1-dev step", "ratio", ".2f"), ("compile s", "compile_s", ".1f"),
                     ("mem/dev MiB", "mem_mib", ".1f"), ("loss", "loss", ".3f")]))
  return rows


def bench_flops(args, one_device: dict) -> list[dict]:
  """Model FLOP/s of 1-device steps against a matmul of the same precision: tiny in fp32
  (the strategies' model), and 125m in bf16 (matmul-bound: d_model 768, 12 layers)."""
  bf16 = run_train(registry.load("125m"), "data:1", "dp", 4, 256, "bf16", args.steps,
                   args.warmup, devices=jax.devices()[:1])
  rows = []
  for name, r, dtype in (("tiny", one_device, np.float32), ("125m", bf16, jax.numpy.bfloat16)):
    per_token = registry.load(name).flops_per_token(r["seq"])
    model, peak = per_token * r["tokens_per_s"], matmul_flops(dtype)
    rows.append({"model": name, "precision": r["precision"], "tokens": f"{r['batch']}×{r['seq']}",
                 "flops_per_token": per_token, "model_gflops": model / 1e9,
                 "matmul_gflops": peak / 1e9, "ratio": model / peak})
  print("\n== model FLOP/s of a 1-device step against a jitted 2048³ matmul of the same "
        "precision (6·N + 12·L·H·Q·T per token) ==")
  print(table(rows, [("model", "model", "s"), ("precision", "precision", "s"),
                     ("tokens/step", "tokens", "s"), ("model GFLOP/s", "model_gflops", ".1f"),
                     ("matmul GFLOP/s", "matmul_gflops", ".1f"), ("ratio", "ratio", ".3f")]))
  return rows


def bench_peer(args) -> list[dict]:
  import peer  # bench/peer.py

  print(f"\n== peer reference (bench/peer.py): shardlab vs MaxText, alternating, "
        f"{args.peer_rounds} round(s) ==\n" + peer.__doc__.split("\n\n")[1])
  rows = peer.compare(args.peer_rounds, list(peer.REMAT), args.steps, args.warmup)
  peer.print_table(rows)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=16, help="timed steps per config")
  parser.add_argument("--warmup", type=int, default=4, help="untimed steps after compiling")
  parser.add_argument("--batch", type=int, default=16, help="global batch (strategies, flops)")
  parser.add_argument("--seq", type=int, default=128, help="sequence length (strategies, flops)")
  parser.add_argument("--only", nargs="+", choices=("strategies", "flops", "peer"),
                      default=["strategies", "flops", "peer"])
  parser.add_argument("--peer-rounds", type=int, default=2,
                      help="alternating shardlab/MaxText rounds in the peer comparison")
  parser.add_argument("--json", type=Path, help="also write the results here")
  args = parser.parse_args()
  if args.steps < 1 or args.warmup < 0:
    parser.error("--steps must be >= 1 and --warmup >= 0")
  host_memory.reexec_with_huge_pages()  # as train.py does on a CPU host
  if jax.device_count() != N_DEVICES:
    sys.exit(f"expected {N_DEVICES} simulated devices, got {jax.devices()}; is XLA_FLAGS "
             f"setting another --xla_force_host_platform_device_count?")

  results = {"backend": jax.default_backend(), "devices": jax.device_count(),
             "steps": args.steps, "warmup": args.warmup, "cpu_dot": dot.cpu_result()}
  print(f"XLA:CPU dots asked for: {results['cpu_dot']} (shardlab/parallel/dot.py; "
        f"SHARDLAB_CPU_DOT overrides); {host_memory.describe()}")
  if {"strategies", "flops"} & set(args.only):
    one_device = run_train(registry.load("tiny"), "data:1", "dp", args.batch, args.seq,
                           "fp32", args.steps, args.warmup, devices=jax.devices()[:1])
    one_device["strategy"] = "1 device"
    results["one_device"] = one_device
  if "strategies" in args.only:
    results["strategies"] = bench_strategies(args, one_device)
  if "flops" in args.only:
    results["flops"] = bench_flops(args, one_device)
  if "peer" in args.only:
    results["peer"] = bench_peer(args)

  line = json.dumps(results)
  if args.json:
    args.json.write_text(line + "\n")
  print("\n" + line)


if __name__ == "__main__":
  main()
