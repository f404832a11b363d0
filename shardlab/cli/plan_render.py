"""`shardlab plan train`'s output: the plan as tables, or as JSON."""

import dataclasses

from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.training import experts as plan_experts
from shardlab.plan.training import pipeline as plan_pipeline
from shardlab.plan.training import planner as plan_lib
from shardlab.runtime.units import GiB, gib


def to_json(result, top: int) -> dict:
  e = result.estimate
  return {
      "request": dataclasses.asdict(result.request),
      "model": {"name": result.model.name, "params": result.model.n_params},
      "target": dataclasses.asdict(result.target),
      "estimate": _estimate_json(e),
      "min_devices": result.min_devices,
      "warnings": list(result.warnings),
      # each strategy on this device count with its usual mesh (what --plot draws)
      "strategies": {s: ({"error": e} if isinstance(e, str) else _estimate_json(e))
                     for s, e in result.strategies.items()},
      "thresholds": result.thresholds,
      "search": None if result.search is None else [_estimate_json(x) for x in
                                                    result.search[:top]],
      "search_fitting": None if result.search is None else len(result.search),
      "compiled": result.compiled,
  }


def fewest_line(row: dict, result) -> str:
  """The answer to "how many devices does it need" (no --devices or --mesh given)."""
  t = result.request.train
  return (f"devices   {row['devices']} {result.target.name}: the fewest on which it fits at "
          f"{t.microbatches} microbatch(es) ({row['strategy']}: {row['mesh']}); the plan "
          f"there follows (--devices N plans another count)")


def _estimate_json(e) -> dict:
  d = {k: v for k, v in dataclasses.asdict(e).items() if k != "memory"}
  d.update(memory=e.memory.as_dict(), fits=e.fits, headroom=e.headroom)
  return d


def render(result, top: int) -> str:
  lines = (_header(result) + [f"warning: {w}" for w in result.warnings] +
           ([""] if result.warnings else []) + _memory_lines(result) + _min_device_lines(result) +
           _time_lines(result) + _scaling_lines(result) + _search_lines(result, top))
  if result.compiled:
    lines += ["", *plan_compile.render(result.compiled)]
  return "\n".join(lines)


def _header(result) -> list[str]:
  e, m, r, acc = result.estimate, result.model, result.request, result.target
  t = r.train
  return [
      f"model     {m.name}: {m.n_params / 1e9:.2f}B params   optimizer {t.optimizer}   "
      f"precision {t.precision}   remat {t.remat}   offload {t.offload}" +
      (f"   LoRA rank {r.lora.rank} on {r.lora.targets} "
       f"({m.n_lora_params(r.lora) / 1e6:.1f}M trained)" if r.lora.rank else ""),
      f"batch     {t.global_batch} × {t.seq_len} tokens, {t.microbatches} microbatch(es)",
      f"target    {acc.name}: {acc.peak_flops / 1e12:.0f} TFLOP/s bf16, "
      f"{gib(acc.hbm_bytes, digits=1)} HBM ({acc.usable_bytes / GiB:.2f} usable), "
      f"{acc.hbm_bw / 1e12:.2f} TB/s",
      f"mesh      {e.mesh} ({e.n_devices} devices), strategy {e.strategy}", ""]


def _memory_lines(result) -> list[str]:
  e, mem = result.estimate, result.estimate.memory
  lines = ["memory per device (analytic)"]
  for key, label, value in (
      ("params", "params", mem.params), ("grads", "gradients", mem.grads),
      ("opt_state", "optimizer state", mem.opt_state),
      ("master", "master weights", mem.master), (None, "activations", mem.activations),
      (None, "gathered weights", mem.gathered), (None, "token batch", mem.batch)):
    how = e.accounting.get(key)
    note = "" if how is None else (
        f"   {round(how['bytes_per_param'], 4):g} B/param, " +
        ("whole on every device" if how["divided_by"] <= 1 else f"÷ {how['divided_by']:g}"))
    lines.append(f"  {label:18s}{gib(value, 9)}{note}")
  verdict = "fits" if e.fits else "DOES NOT FIT"
  lines.append(f"  {'total':18s}{gib(mem.total, 9)}   {verdict}, headroom "
               f"{gib(e.headroom)} of {gib(e.usable_bytes)} usable")
  if mem.host:
    lines.append(f"  {'host memory':18s}{gib(mem.host, 9)}   offloaded (not in the total); "
                 f"{gib(e.host_transfer_bytes)} host↔device per step")
  return lines + [""] + plan_experts.lines(plan_experts.for_plan(result))


def _min_device_lines(result) -> list[str]:
  mins, m = result.min_devices, result.request.train.microbatches
  overall, any_m = mins["overall"], mins["any_microbatches"]
  lines = [f"minimum devices   {overall['devices']} at {m} microbatch(es) "
           f"({overall['strategy']}: {overall['mesh']})"]
  if any_m and (any_m["devices"], any_m["microbatches"]) != (overall["devices"], m):
    lines.append(f"                  {any_m['devices']} at any microbatch count: "
                 f"--microbatches {any_m['microbatches']} ({any_m['strategy']}: "
                 f"{any_m['mesh']}, {any_m['step_s']:.1f} s per step)")
  return lines + ["  " + "   ".join(f"{s} {v['devices'] if v else '-'}"
                                    for s, v in mins.items() if s in plan_lib.STRATEGIES),
                  "  " + plan_pipeline.MIN_DEVICES_NOTE]


def _time_lines(result) -> list[str]:
  e, acc = result.estimate, result.target
  lines = ["", "communication per device per step"]
  lines += [f"  {kind:18s}{gib(b, 9)}" for kind, b in e.collectives.items()]
  return lines + [
      "", "predicted step time (plan/training/step_time.py: compute + exposed collectives + "
      "optimizer update)",
      f"  compute {e.compute_s * 1e3:10.1f} ms   ({e.flops_per_device / 1e12:.1f} TFLOP per "
      f"device incl. remat; matmuls at {e.efficiency:.0%} of peak "
      f"{e.time.matmul_s * 1e3:.1f} ms, attention {e.time.attention_s * 1e3:.1f} ms, "
      f"memory-bound ops {e.time.elementwise_s * 1e3:.1f} ms)",
      f"  memory  {e.memory_s * 1e3:10.1f} ms   (HBM traffic)",
      f"  comm    {e.comm_s * 1e3:10.1f} ms   (ICI {acc.ici_bw / 1e9:.0f} GB/s, DCN "
      f"{acc.dcn_bw / 1e9:.1f} GB/s per device; {e.time.exposed_comm_s * 1e3:.1f} ms exposed)",
      *([f"  host    {e.host_s * 1e3:10.1f} ms   (offload traffic at "
         f"{acc.host_bw / 1e9:.0f} GB/s each way)"] if e.host_transfer_bytes else []),
      f"  update  {e.time.update_s * 1e3:10.1f} ms   (the optimizer's pass over this device's "
      f"weights, gradients and state)",
      f"  step    {e.step_s * 1e3:10.1f} ms   bound by {e.binding}; "
      f"{e.tokens_per_s:,.0f} tokens/s" + (f"; pipeline {e.pipeline.schedule}, bubble "
                                             f"{e.pipeline.bubble:.1%}" if e.pipeline else ""),
      f"  MFU     {e.mfu:10.1%} predicted (matmuls at {e.efficiency:.0%} of peak on "
      f"{acc.name}: {acc.efficiency:.0%} from {acc.efficiency_source}, × the step model's "
      f"matmul factor); roofline ceiling {e.mfu_ceiling:.1%}", ""]


def _scaling_lines(result) -> list[str]:
  e, r, t, acc = result.estimate, result.request, result.thresholds, result.target
  tokens_now = r.train.global_batch * r.train.seq_len / max(1, e.mesh_shape.get("data", 1) *
                                                e.mesh_shape.get("fsdp", 1))
  return [
      f"scaling on {acc.name}: data/FSDP parallelism stays compute-bound from "
      f"{t['fsdp_tokens_per_device_ici']:,.0f} tokens per device (FSDP over ICI; "
      f"{t['fsdp_tokens_per_device_dcn']:,.0f} over DCN; plain DP "
      f"{t['dp_tokens_per_device_ici']:,.0f} / {t['dp_tokens_per_device_dcn']:,.0f}); "
      f"tensor parallelism up to about {t['tp_max_degree_ici']:.0f}-way within ICI",
      f"  this mesh: {tokens_now:,.0f} tokens per device per step"]


def _search_lines(result, top: int) -> list[str]:
  if result.search is None:
    return []
  n = result.estimate.n_devices
  lines = ["", f"search: {len(result.search)} fitting (mesh, strategy) on {n} devices, "
               f"fastest first (one row per placement; no idle axes)",
           f"  {'strategy':8s} {'mesh':34s} {'memory':>9s} {'step':>10s} {'MFU':>6s} "
           f"{'ceiling':>7s}  bound"]
  if not result.search:
    lines.append(f"  nothing fits on {n} devices: use more devices (see minimum devices "
                 f"above), --microbatches, --remat full or a shorter sequence")
  for x in result.search[:top]:
    lines.append(f"  {x.strategy:8s} {x.mesh:34s} {x.memory.total / GiB:6.2f}GiB "
                 f"{x.step_s * 1e3:8.1f}ms {x.mfu:6.1%} {x.mfu_ceiling:7.1%}  {x.binding}")
  return lines + plan_pipeline.versus(result.search)
