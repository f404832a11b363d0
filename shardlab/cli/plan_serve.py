"""`shardlab plan serve`: memory, fit, fewest devices and roofline speeds for serving a
model, and (--compile) XLA's memory for the real decode step beside them."""

import argparse
import dataclasses
import json
import sys

from shardlab import generate
from shardlab.cli.args import DefaultsHelp
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.plan.compiled import aot
from shardlab.plan.serving import terms as inf
from shardlab.plan.compiled import decode_step as inf_compile
from shardlab.plan.serving import planner as inference_plan
from shardlab.runtime import devices, hardware, jax_compat
from shardlab.runtime.units import gib, size
from shardlab.training import run as run_lib


def parser(prog: str = "shardlab plan serve") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, formatter_class=DefaultsHelp,
      description="Per-device memory (weights, KV cache, step temporaries), fit, the fewest "
                  "devices per layout and roofline prefill and decode speeds for serving a "
                  "model.",
      epilog="Example: shardlab plan serve --model llama3-70b --target h100-80g "
             "--batch 32 --context 8192 --weights int8")
  p.add_argument("--model", default="llama3-70b", help="preset name or TOML model file")
  p.add_argument("--target", default="h100-80g", help=" | ".join(hardware.names()))
  p.add_argument("--batch", type=inf.BOUNDS["batch"], default=1, help="sequences decoded together; %(type)s")
  p.add_argument("--context", type=inf.BOUNDS["context"],
                 help="tokens per sequence the cache holds (prompt + generated; %(type)s); "
                      "unset: the model's max_seq_len (llama3-70b: 8192), the most generate "
                      "runs, and so the most this takes")
  p.add_argument("--weights", default="bf16", help=" | ".join(inf.WEIGHT_BYTES))
  p.add_argument("--kv-dtype", default="bf16", help=" | ".join(inf.KV_BYTES))
  p.add_argument("--prefill-batch", type=inf.BOUNDS["prefill_batch"], default=1,
                 help="sequences prefilled at once per replica (%(type)s; generate prefills "
                      "all its prompts of one length at once)")
  p.add_argument("--prefill-chunk", type=inf.BOUNDS["prefill_chunk"], default=inf.PREFILL_CHUNK,
                 help="prompt tokens per prefill call (generate --prefill-chunk; %(type)s)")
  p.add_argument("--devices", type=inf.BOUNDS["devices"],
                 help="plan the fastest layout of this many devices (%(type)s)")
  p.add_argument("--mesh", help="a layout, e.g. 'tensor:8,stage:2' or 'data:2,tensor:4' "
                                "(unset: the fewest devices that fit)")
  p.add_argument("--compile", action="store_true",
                 help="compile the real decode step for the layout (simulated CPU devices, "
                      "or the TPU topology; see --compile-on); fp32/bf16 only")
  p.add_argument("--compile-on", default="auto", choices=("auto", "cpu", "tpu"),
                 help="auto: the TPU topology for a TPU target when libtpu is installed")
  p.add_argument("--json", action="store_true", help="print JSON instead of tables")
  return p


def context(model_name: str, asked: int | None) -> int:
  """--context, by default the model's max_seq_len. Generate refuses a prompt plus new
  tokens past max_seq_len (the model was not trained past it), so a plan for more is
  refused."""
  model = registry.load(model_name)
  if asked is None:
    return model.max_seq_len
  if asked > model.max_seq_len:
    raise ConfigError(f"--context {asked} exceeds model.max_seq_len ({model.max_seq_len}) of "
                      f"{model.name}: generate refuses a prompt plus new tokens past it; plan "
                      f"--context {model.max_seq_len} or less, or a model TOML whose "
                      f"max_seq_len is larger (model.rope_scaling stretches RoPE)")
  return asked


def request(args) -> inf.Request:
  return inf.Request(model=args.model, target=args.target, batch=args.batch,
                     context=context(args.model, args.context), weights=args.weights,
                     kv_dtype=args.kv_dtype,
                     prefill_batch=args.prefill_batch, prefill_chunk=args.prefill_chunk,
                     devices=args.devices, mesh=args.mesh)


def main(argv=None, prog: str = "shardlab plan serve") -> int:
  args = parser(prog).parse_args(argv)
  try:
    result = inference_plan.plan(request(args))
    if args.compile:
      result = dataclasses.replace(result, compiled=[compile_decode(result, args.compile_on)])
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(to_json(result), indent=2) if args.json else render(result))
  return 0


def compile_decode(result: inference_plan.Plan, on: str = "auto") -> dict:
  """Lowers generate's decode step for the planned layout and compiles it: on a TPU
  topology (a TPU target with libtpu), else on as many simulated CPU devices."""
  req, acc, layout = result.request, result.target, result.estimate.layout
  cfg = inf_compile.decode_config(req, result.model, layout)
  tpu = on == "tpu" or (on == "auto" and acc.kind == "tpu" and aot.libtpu_available())
  if tpu and acc.kind != "tpu":
    raise ConfigError(f"--compile-on tpu needs a TPU target, got {acc.name!r}")
  n = layout.n_devices
  if tpu:
    devs, name = aot.tpu_devices(acc.topology, n)
    where = f"tpu {name}"
  else:
    devs, where = _cpu_devices(n), f"cpu x{n}"
  p = run_lib.place(cfg, devs)
  gen = generate.Generator(cfg, p.abstract, p.shardings)
  report = inf_compile.compile_lowered(gen.lower_decode(req.batch, req.context), p.mesh,
                                       where, "tpu" if tpu else "cpu")
  return inf_compile.compare(report, result.estimate)


def _cpu_devices(n: int):
  import jax
  if not jax_compat.backends_are_initialized():
    devices.simulate(n)
  cpus = jax.devices("cpu")
  if len(cpus) < n:
    raise ConfigError(f"--compile needs {n} CPU devices and this process has {len(cpus)} "
                      f"(they are fixed once JAX starts): run the plan in a fresh process")
  return cpus[:n]


def to_json(result: inference_plan.Plan) -> dict:
  e = result.estimate
  return {
      "request": dataclasses.asdict(result.request),
      "model": {"name": result.model.name, "params": result.model.n_params,
                "active_params": inf.active_params(result.model)},
      "target": dataclasses.asdict(result.target),
      "layout": dataclasses.asdict(e.layout) | {"devices": e.layout.n_devices},
      "memory": e.memory.as_dict(), "usable_bytes": e.usable_bytes, "fits": e.fits,
      "bytes_per_decode_step": e.bytes_per_decode_step,
      "decode": dataclasses.asdict(e.decode), "prefill": dataclasses.asdict(e.prefill),
      "min_devices": result.min_devices, "warnings": list(result.warnings),
      "executable_dtypes": list(inf.EXECUTABLE), "compiled": result.compiled}


def _ms(x: float) -> str:
  return f"{x * 1e3:.2f} ms" if x >= 1e-4 else f"{x * 1e6:.2f} µs"


def _rate(x: float) -> str:
  return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def render(result: inference_plan.Plan) -> str:
  e, m, r, acc = result.estimate, result.model, result.request, result.target
  mem = e.memory
  lines = [
      f"model     {m.name}: {m.n_params / 1e9:.2f}B params ({inf.active_params(m) / 1e9:.2f}B "
      f"active per token)   weights {r.weights}   KV cache {r.kv_dtype}",
      f"serving   batch {r.batch} × context {r.context} tokens; prefill {r.prefill_batch} "
      f"sequence(s) at once, {r.prefill_chunk} tokens a call",
      f"target    {acc.name}: {acc.peak_flops / 1e12:.0f} TFLOP/s bf16, {acc.hbm_bw / 1e12:.2f} "
      f"TB/s HBM, {gib(acc.usable_bytes)} usable",
      f"layout    {e.layout.describe()} ({e.layout.n_devices} devices)", ""]
  lines += [f"warning: {w}" for w in result.warnings] + ([""] if result.warnings else [])
  verdict = "fits" if e.fits else "DOES NOT FIT"
  lines += ["memory per device (analytic)",
            f"  {'weights':28s}{size(mem.weights, 9)}",
            f"  {'KV cache':28s}{size(mem.kv_cache, 9)}",
            f"  {'decode step temporaries':28s}{size(mem.decode_temp, 9)}   (the scan's new "
            f"cache buffer, a layer's K/V and weights, logits)",
            f"  {'prefill temporaries':28s}{size(mem.prefill_temp, 9)}   (the same, with one "
            f"layer's scores of a chunk over the cache)",
            f"  {'total':28s}{size(mem.total, 9)}   {verdict} in {gib(e.usable_bytes)}", ""]
  lines += _min_lines(result) + [""] + _speed_lines(e)
  if result.compiled:
    lines += [""] + inf_compile.render(result.compiled)
  return "\n".join(lines)


def _min_lines(result) -> list[str]:
  lines = ["minimum devices (tensor parallel within the fast domain; stages or replicas "
           "across)"]
  for kind, s in result.min_devices.items():
    lines.append(f"  {kind:14s} " + ("does not fit at any size" if s is None else
                 f"{s['devices']:5d}   {s['layout']:30s} "
                 f"{_rate(s['decode_tokens_per_s'])} decode tokens/s"))
  return lines


def _speed_lines(e: inf.Estimate) -> list[str]:
  d, p = e.decode, e.prefill
  lines = ["predicted speed (roofline: every term at 100% of the datasheet)"]
  for name, ph, what in (("prefill", p, "prompt"), ("decode", d, "generated")):
    terms = "  ".join(f"{k} {_ms(v)}" for k, v in ph.terms.items())
    lines += [f"  {name:8s}{_rate(ph.tokens_per_s_per_seq):>12s} {what} tokens/s per sequence, "
              f"{_rate(ph.tokens_per_s)} in total; bound by {ph.bound}",
              f"           step {_ms(ph.step_s)}: {terms}"]
  lines.append(f"  a decode step reads {size(e.bytes_per_decode_step)} per device "
               f"(weights + the whole KV cache)")
  return lines
