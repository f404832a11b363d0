"""The inference plan: the estimate for the requested (or the smallest fitting) layout and
the fewest devices per layout — tensor parallelism within the fast domain, pipeline stages
or data-parallel replicas across it.

    from shardlab.plan.serving import planner as inference_plan
    p = inference_plan.plan(inference.Request(model="llama3-70b", target="h100-80g",
                                              batch=32, context=8192))
    p.estimate.memory.total, p.estimate.decode.tokens_per_s, p.min_devices["overall"]
"""

import dataclasses
from typing import Any

from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.plan.serving import terms as inf
from shardlab.plan.serving import estimate as inf_estimate
from shardlab.plan.training.estimate import MAX_DEVICES
from shardlab.runtime import hardware
from shardlab.runtime.units import gib

LAYOUTS = ("tensor", "tensor+stage", "tensor+data", "overall")


@dataclasses.dataclass(frozen=True)
class Plan:
  request: inf.Request
  model: Any
  target: hardware.Accelerator
  estimate: inf.Estimate
  min_devices: dict  # layout kind -> {"devices", "layout", ...} or None (nothing fits)
  warnings: tuple[str, ...] = ()
  compiled: list | None = None

  @property
  def fits(self) -> bool:
    return self.estimate.fits


def tensor_degrees(model, acc: hardware.Accelerator) -> list[int]:
  """Tensor-parallel degrees the `tp` rules can shard this model over (every head, kv head,
  MLP and vocabulary dimension divides) within the target's fast domain."""
  out = []
  for t in range(1, min(acc.ici_domain, model.n_heads) + 1):
    try:
      inf.weight_split(model, t)
      inf.kv_bytes(model, inf.Layout(tensor=t), 1, 1, "bf16")
    except ConfigError:
      continue
    out.append(t)
  return out


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _summary(e: inf.Estimate) -> dict:
  return {"devices": e.layout.n_devices, "layout": e.layout.describe(),
          "tensor": e.layout.tensor, "stage": e.layout.stage, "data": e.layout.data,
          "memory_per_device": e.memory.total,
          "decode_tokens_per_s": e.decode.tokens_per_s,
          "decode_tokens_per_s_per_seq": e.decode.tokens_per_s_per_seq}


def _better(a: inf.Estimate | None, b: inf.Estimate) -> inf.Estimate:
  """Fewer devices first, then faster decode."""
  if a is None:
    return b
  return min(a, b, key=lambda e: (e.layout.n_devices, -e.decode.tokens_per_s))


def min_devices(req: inf.Request, model, acc) -> tuple[dict, inf.Estimate | None]:
  """The fewest devices that fit, per layout kind, and the estimate that needs the least
  memory (for the error when nothing fits). For each tensor degree and replica count, the
  fewest stages that fit (memory only falls as stages are added)."""
  best = dict.fromkeys(LAYOUTS)
  least = None
  for t in tensor_degrees(model, acc):
    for d in _divisors(req.batch):
      for s in range(1, model.n_layers + 1):
        if t * s * d > MAX_DEVICES:
          break
        if model.n_layers % s:  # a pipeline's stages hold equal shares of the layers
          continue
        e = inf_estimate.estimate(req, model, acc, inf.Layout(t, s, d))
        if least is None or e.memory.total < least.memory.total:
          least = e
        if not e.fits:
          continue
        kinds = ["overall"] + (["tensor"] if s == d == 1 else []) + \
            (["tensor+stage"] if d == 1 else []) + (["tensor+data"] if s == 1 else [])
        for kind in kinds:
          best[kind] = _better(best[kind], e)
        break
  return {k: (_summary(e) if e else None) for k, e in best.items()}, least


def at_devices(req: inf.Request, model, acc, n: int) -> inf.Estimate:
  """The fastest fitting layout on exactly n devices (else the one needing least memory)."""
  found = [inf_estimate.estimate(req, model, acc, inf.Layout(t, s, n // (t * s)))
           for t in tensor_degrees(model, acc) if n % t == 0
           for s in _divisors(n // t)
           if model.n_layers % s == 0 and req.batch % (n // (t * s)) == 0]
  if not found:
    raise ConfigError(f"no layout of {n} devices holds {model.name} with batch {req.batch}: "
                      f"tensor degrees {tensor_degrees(model, acc)}, the data axis must "
                      f"divide the batch and the stages must divide its {model.n_layers} "
                      f"layers (equal shares per stage)")
  fitting = [e for e in found if e.fits]
  if fitting:
    return max(fitting, key=lambda e: (e.decode.tokens_per_s, -e.layout.stage))
  return min(found, key=lambda e: e.memory.total)


def warnings(req: inf.Request, model) -> list[str]:
  out = []
  if req.context > model.max_seq_len:
    out.append(f"--context {req.context} exceeds {model.name}'s trained context "
               f"(max_seq_len {model.max_seq_len}); generate refuses it")
  if req.weights not in inf.EXECUTABLE or req.kv_dtype not in inf.EXECUTABLE:
    out.append(f"{req.weights} weights / {req.kv_dtype} KV cache are planned by formula "
               f"only: shardlab generate and --compile run {' and '.join(inf.EXECUTABLE)}")
  return out


def plan(req: inf.Request) -> Plan:
  model = registry.load(req.model)
  acc = hardware.get(req.target)
  mins, least = min_devices(req, model, acc)
  if req.mesh is not None:
    layout = inf.layout_from_mesh(req.mesh)
    if model.n_layers % layout.stage:
      raise ConfigError(f"mesh {req.mesh!r}: stage {layout.stage} does not divide "
                        f"{model.name}'s {model.n_layers} layers (a pipeline's stages hold "
                        f"equal shares); use a stage size that divides {model.n_layers}")
    if req.devices is not None and req.devices != layout.n_devices:
      raise ConfigError(f"mesh {req.mesh!r} has {layout.n_devices} devices, --devices says "
                        f"{req.devices}")
    est = inf_estimate.estimate(req, model, acc, layout)
  elif req.devices is not None:
    est = at_devices(req, model, acc, req.devices)
  elif mins["overall"] is not None:
    o = mins["overall"]
    est = inf_estimate.estimate(req, model, acc, inf.Layout(o["tensor"], o["stage"], o["data"]))
  else:
    need = f"; the least is {gib(least.memory.total, digits=1)} ({least.layout.describe()})" \
        if least else ""
    raise ConfigError(f"{model.name} with batch {req.batch} × context {req.context} "
                      f"({req.weights} weights, {req.kv_dtype} KV) fits no layout on "
                      f"{acc.name} ({gib(acc.usable_bytes)} usable){need}")
  return Plan(req, model, acc, est, mins, tuple(warnings(req, model)))
