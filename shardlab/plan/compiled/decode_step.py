"""`plan serve --compile`: XLA's memory for the real decode step beside the formula.

The step is `shardlab generate`'s own (the caller lowers it: `Generator.lower_decode`),
compiled for simulated CPU devices or a TPU topology with abstract inputs. Only what the
step executes can be compiled: fp32 or bf16 weights, the cache in the same dtype, no
pipeline stages (they are planned by formula only).
"""

import dataclasses
import time

from shardlab import config as config_lib
from shardlab.errors import ConfigError
from shardlab.observe import step_report
from shardlab.observe.step_report import StepReport
from shardlab.plan.serving import terms as inf
from shardlab.runtime import compile_only
from shardlab.runtime.units import MiB, gib

PRECISION = {"fp32": "fp32", "bf16": "bf16-params"}  # weights dtype -> precision policy


def decode_config(req: inf.Request, model, layout: inf.Layout) -> config_lib.Config:
  """The run config whose decode step `--compile` lowers: the `tp` rules on
  data × tensor, weights stored (and computed) in the requested dtype."""
  if req.weights not in PRECISION:
    raise ConfigError(f"--compile runs the decode step shardlab executes: --weights "
                      f"{' or '.join(PRECISION)}, got {req.weights!r} (int8/int4 are planned "
                      f"by formula only)")
  if req.kv_dtype != req.weights:
    raise ConfigError(f"--compile keeps the KV cache in the weights' dtype, as generate "
                      f"does: --kv-dtype {req.weights}, got {req.kv_dtype!r}")
  if layout.stage > 1:
    raise ConfigError(f"--compile needs stage=1 ({layout.describe()}): pipeline stages are "
                      f"planned by formula only")
  if req.context > model.max_seq_len:
    model = dataclasses.replace(model, max_seq_len=req.context)
  train = config_lib.TrainConfig(precision=PRECISION[req.weights], optimizer="sgd")
  return config_lib.Config(model=model, mesh=layout.mesh(), strategy="tp", train=train)


def compile_lowered(lowered, mesh, where: str, platform: str) -> StepReport:
  """Compiles a lowered step (generate's decode) over `mesh`: the report of every compile."""
  start = time.perf_counter()
  compiled = compile_only.compile_lowered(lowered, platform)
  return step_report.report(compiled, mesh, where, time.perf_counter() - start)


def compare(report: StepReport, est: inf.Estimate) -> dict:
  """ratio = analytic / compiled. The arguments are the weights and the cache; the total is
  arguments + outputs not aliased + temporaries, against weights + cache + decode temps."""
  m = est.memory
  analytic = {"state_bytes": m.weights + m.kv_cache,
              "total_bytes": m.weights + m.kv_cache + m.decode_temp,
              "temp_bytes": m.decode_temp}
  temp = report.total_bytes - report.argument_bytes
  ratio = {"state": analytic["state_bytes"] / max(report.argument_bytes, 1),
           "total": analytic["total_bytes"] / max(report.total_bytes, 1),
           "temp": m.decode_temp / max(temp, 1)}
  return {"report": report.as_dict(), "analytic": analytic, "ratio": ratio,
          "fits": report.total_bytes <= est.usable_bytes, "usable_bytes": est.usable_bytes}


def render(compiled: list[dict]) -> list[str]:
  lines = ["compiled decode step (XLA memory analysis per device; ratio = analytic/compiled)"]
  for c in compiled:
    r, a, q = c["report"], c["analytic"], c["ratio"]
    temp = r["total_bytes"] - r["argument_bytes"]
    lines += [
        f"  {r['where']}: compiled in {r['compile_s']:.1f} s",
        f"    weights + KV (arguments)   {gib(r['argument_bytes'], 9, 3)}   analytic "
        f"{gib(a['state_bytes'], 9, 3)}   ratio {q['state']:.3f}",
        f"    step temporaries           {gib(temp, 9, 3)}   analytic "
        f"{gib(a['temp_bytes'], 9, 3)}   ratio {q['temp']:.3f}",
        f"    total (arg+out-alias+temp) {gib(r['total_bytes'], 9, 3)}   analytic "
        f"{gib(a['total_bytes'], 9, 3)}   ratio {q['total']:.3f}   "
        f"{'fits' if c['fits'] else 'DOES NOT FIT'} in {gib(c['usable_bytes'])}"]
    for kind, s in r["kinds"].items():
      if s["ops"]:
        lines.append(f"    {kind:18s} {s['count']:5d} runs ({s['ops']:3d} ops) "
                     f"{s['bytes'] / MiB:9.3f} MiB")
  return lines
