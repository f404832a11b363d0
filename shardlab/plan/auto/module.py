"""`sl.auto_layout(model_factory, ...)`: the layout search for ANY nnx.Module.

    choice = sl.auto_layout(lambda: Mixer(nnx.Rngs(0)), optimizer=optax.adamw(1e-3),
                            batch=batch_shapes, loss_fn=loss_fn)
    print(choice.render())
    shardings = sl.shardings(abstract, sl.strategy(choice.strategy), sl.mesh(choice.mesh))

A bundled model's search (auto.choice) ranks by the planner's formula, which needs the
model's config; a module of the user's has none, so here:
1. Candidates: each strategy × each data·fsdp·tensor factorisation of the device count
   (`search.factorizations`), one per distinct placement (`search.placer`, with the
   module's own logical names and sizes). One whose rules cannot shard the params (a dim
   not divisible by its mesh axes) is kept in the table as skipped, with the reason.
2. Estimate: `plan_module` per candidate (traced, never compiled); those over the target's
   usable memory per device are dropped, the rest ranked by estimated bytes, least first.
3. Compile the best `top_k` (the real `sl.train_step`, abstract inputs, nothing allocated)
   and score each by a roofline on its compiled program: the largest of its matmul FLOPs at
   the rate the planner's step-time model gives weight matmuls
   (`step_time.matmul_efficiency`), its collective bytes over the link, and its buffers read
   once at memory bandwidth. The winner: the lowest score; ties go to less compiled memory,
   then to the estimate's order.
"""

import dataclasses
from typing import Callable

import jax

from shardlab.errors import ConfigError
from shardlab.observe.step_report import StepReport
from shardlab.observe import xla_log
from shardlab.plan.compiled import aot
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.training import search
from shardlab.plan.training import step_time as plan_time
from shardlab.plan.auto.choice import seconds_text
from shardlab.plan.module.planner import ModulePlan, plan_module
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.training import state as state_lib
from shardlab.training import step as step_lib
from shardlab.runtime import units

STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp")


@dataclasses.dataclass
class ModuleCandidate:
  strategy: str
  mesh: str  # inline, as sl.mesh takes it
  plan: ModulePlan | None = None  # plan_module's estimate; None when skipped
  report: StepReport | None = None
  score_s: float | None = None  # roofline on the compiled program
  bound: str = ""
  verdict: str = "not compiled"

  @property
  def fits(self) -> bool:
    return self.verdict == "fits"


@dataclasses.dataclass(frozen=True)
class ModuleChoice:
  strategy: str
  mesh: str
  candidates: tuple[ModuleCandidate, ...]  # estimate order; skipped ones last
  target: hardware.Accelerator
  n_devices: int
  duplicates: int = 0  # candidates folded into an identical placement before them

  @property
  def winner(self) -> ModuleCandidate:
    return next(c for c in self.candidates
                if c.strategy == self.strategy and c.mesh == self.mesh)

  def render(self) -> str:
    n_compiled = sum(c.report is not None for c in self.candidates)
    lines = [f"auto layout of a module on {self.n_devices} × {self.target.name} "
             f"({units.size(self.target.usable_bytes)} usable): {len(self.candidates)} "
             f"placements ({self.duplicates} duplicates folded), {n_compiled} compiled "
             f"(estimate: plan_module per device; score: roofline on the compiled program)",
             f"  {'strategy':8s} {'mesh':22s} {'estimate':>10s} {'compiled':>10s} "
             f"{'score':>10s}  verdict"]
    for c in self.candidates:
      est = "-" if c.plan is None else units.size(c.plan.total)
      compiled = "-" if c.report is None else units.size(c.report.total_bytes)
      score = "-" if c.score_s is None else seconds_text(c.score_s)
      mark = "  <- chosen" if c is self.winner else ""
      bound = f" ({c.bound})" if c.bound else ""
      lines.append(f"  {c.strategy:8s} {c.mesh:22s} {est:>10s} {compiled:>10s} {score:>10s}"
                   f"  {c.verdict}{bound}{mark}")
    lines.append(f"chosen: {self.strategy} on {self.mesh}")
    return "\n".join(lines)


def auto_layout_module(model_factory: Callable, target: hardware.Accelerator, devices, *,
                       optimizer, precision: str = "fp32", batch, loss_fn: Callable,
                       strategies: tuple[str, ...] = STRATEGIES, top_k: int = 4,
                       microbatches: int = 1,
                       say: Callable[[str], None] = lambda text: None) -> ModuleChoice:
  """The fastest layout that fits for `model_factory`'s train step with `loss_fn` on
  `batch` (a tree of global ShapeDtypeStructs), on `devices` (jax devices), taken to be
  `target` (`auto_layout.attached_target`). Nothing is allocated: the estimates are traced,
  the top `top_k` compiled."""
  if not callable(model_factory):
    raise ConfigError(f"auto_layout: the first argument must be a run Config or a module "
                      f"factory (lambda: MyModule(...)), got {type(model_factory).__name__}")
  if top_k < 1:
    raise ConfigError(f"auto_layout: top_k must be >= 1, got {top_k}")
  for s in strategies:
    if s not in STRATEGIES:
      raise ConfigError(f"auto_layout: strategy {s!r} is not searched for a module; valid: "
                        f"{', '.join(STRATEGIES)}")
  devices, acc = list(devices), target
  abstract = state_lib.abstract_state(model_factory, optimizer, precision)
  cands, duplicates = _candidates(abstract, batch, loss_fn, strategies, devices,
                                  microbatches, say)
  for c, _ in cands:
    if c.plan is not None and c.plan.total > acc.usable_bytes:
      c.verdict = (f"does not fit by estimate: {units.size(c.plan.total)} > "
                   f"{units.size(acc.usable_bytes)}")
  ranked = sorted((cm for cm in cands if cm[0].verdict == "not compiled"),
                  key=lambda cm: cm[0].plan.total)
  dropped = [c for c, _ in cands if c.verdict != "not compiled"]  # skipped or too big
  for c, mesh in ranked[:top_k]:
    say(f"compiling {c.strategy} on {c.mesh}")
    with xla_log.quiet_remat(f"{c.strategy} on {c.mesh}", None, say):  # one line, not HLO
      _compile(c, abstract, mesh, batch, loss_fn, microbatches, acc)
  for c, _ in ranked[top_k:]:
    c.verdict = f"not compiled: outside the top {top_k} by estimate"
  table = tuple(c for c, _ in ranked) + tuple(dropped)
  fit = [c for c in table if c.fits]
  if not fit:
    raise ConfigError("auto layout: no candidate fits this module on "
                      f"{len(devices)} {acc.name} devices:\n" +
                      "\n".join(f"  {c.strategy} on {c.mesh}: {c.verdict}" for c in table))
  best = min(fit, key=lambda c: (round(c.score_s, 12), c.report.total_bytes))
  return ModuleChoice(best.strategy, best.mesh, table, acc, len(devices), duplicates)


def _candidates(abstract, batch, loss_fn, strategies, devices, microbatches: int, say):
  """(candidate, jax Mesh) per distinct placement, each with its estimate or why it was
  skipped; and how many candidates repeated a placement already listed."""
  dims = _dims(abstract, batch, microbatches)
  seen, out, duplicates = set(), [], 0
  for name in strategies:
    rules = rules_lib.strategy(name)
    place = search.placer(rules, dims)
    for shape in search.factorizations(len(devices)):
      spec = mesh_lib.MeshSpec(ici=shape, dcn={})
      key = place(spec)
      if key is None:  # an axis that shards nothing would only replicate work
        continue
      if key in seen:
        duplicates += 1
        continue
      seen.add(key)
      mesh = mesh_lib.build(spec, devices)
      c = ModuleCandidate(name, plan_compile.inline_mesh(spec))
      try:
        c.plan = plan_module(abstract, strategy=rules, mesh=mesh, batch=batch,
                             loss_fn=loss_fn, microbatches=microbatches)
      except ConfigError as e:
        c.verdict = f"skipped: {e}"
      say(f"estimated {c.strategy} on {c.mesh}: {c.verdict if c.plan is None else 'ok'}")
      out.append((c, mesh))
  return out, duplicates


def _dims(abstract: state_lib.Abstract, batch, microbatches: int) -> dict[str, int]:
  """Each logical name's size in this module's params, and the (micro)batch: what
  `search.placer` needs to tell placements apart and find idle axes."""
  dims = {}
  names = jax.tree.leaves(abstract.names, is_leaf=lambda x: isinstance(x, tuple))
  for n, leaf in zip(names, jax.tree.leaves(abstract.state.params)):
    for name, size in zip(n, leaf.shape):
      if name is not None:
        dims[name] = size
  leaves = jax.tree.leaves(batch)
  if leaves and getattr(leaves[0], "shape", ()):
    dims["batch"] = leaves[0].shape[0] // microbatches
  return dims


def _compile(c: ModuleCandidate, abstract, mesh, batch, loss_fn, microbatches: int,
             acc: hardware.Accelerator) -> None:
  """The real sharded step, compiled with abstract inputs (as plan_module's compiled=True)."""
  sh = state_lib.shardings(abstract, rules_lib.strategy(c.strategy), mesh)
  step = step_lib.make_train_step(loss_fn, abstract, sh, microbatches=microbatches)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  try:
    c.report = aot.compile_train_step(step, abstract, sh, shapes)
  except ConfigError as e:
    c.verdict = f"refused: {e}"
    return
  if c.report.total_bytes > acc.usable_bytes:
    c.verdict = (f"does not fit when compiled: {units.size(c.report.total_bytes)} > "
                 f"{units.size(acc.usable_bytes)}")
    return
  c.score_s, c.bound = roofline(c.report, acc)
  c.verdict = "fits"


def roofline(report: StepReport, acc: hardware.Accelerator) -> tuple[float, str]:
  """(step seconds, what bounds it) from a compiled program alone: there is no formula for
  an unknown module, so memory traffic is its buffers touched once (a lower bound), and
  collectives cross the fast link unless the devices span more than one fast domain."""
  link = acc.ici_bw if report.n_devices <= acc.ici_domain else acc.dcn_bw
  buffers = report.argument_bytes + report.output_bytes + report.temp_bytes
  # Its matmuls at the rate the planner's step-time model runs weight matmuls at.
  terms = {"compute": report.flops / (acc.peak_flops * plan_time.matmul_efficiency(acc)),
           "communication": sum(k["bytes"] for k in report.kinds().values()) / link,
           "memory": buffers / acc.hbm_bw}
  bound = max(terms, key=terms.get)
  return terms[bound], bound
