"""`--strategy auto` / `--mesh auto`: a run picks its own layout, by formula and then by
compiling it.

1. Rank: every distinct placement (strategy × data·fsdp·tensor mesh, `search.search`) that
   fits by formula, fastest first; with memory options also every remat policy and
   microbatch count. A fixed strategy or mesh narrows the list.
2. Compile in that order, with abstract inputs (nothing is allocated), for the devices that
   will run the step or the target's TPU topology, until K candidates fit by XLA's memory
   analysis, the list ends, or the time budget is spent (at least one is compiled).
3. Predict each fitting candidate's step from its compiled program by the planner's
   step-time model (`auto.predict`): the formula's matmul and attention time scaled by the
   program's matmul FLOPs over the formula's (loops unrolled, `observe.hlo_flops`), its
   memory-bound work and bubble, the collectives' exposed part with their times scaled by
   compiled ÷ formula bytes, and the optimizer's update; or the HBM or host-transfer floor,
   where longer.
4. The winner: the fastest predicted step; ties go to less compiled memory, then to the
   formula's order. Everything here is deterministic but the budget's clock: several
   processes take process 0's choice.
"""

import dataclasses
import time
from collections.abc import Callable

from shardlab.bounds import Float, Int
from shardlab.errors import ConfigError
from shardlab.observe import xla_log
from shardlab.observe.step_report import StepReport
from shardlab.plan.auto.predict import predict
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.training.estimate import Estimate, Request, estimate, split_ici_dcn
from shardlab.plan.training.search import divisors, search
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.runtime.units import size

# choose()'s search bounds, which --auto-top and --auto-budget-s (and plan --compile-top,
# --compile-budget-s) parse with.
TOP_K, BUDGET_S = Int(min=1), Float(gt=0)
MAX_MICROBATCH_OPTIONS = 6  # 1, 2, 4, ... : more only lengthens the formula's list


@dataclasses.dataclass(frozen=True)
class Option:
  """What the search may choose: the layout, and (with memory options) remat and
  microbatches."""
  strategy: str
  mesh: str  # inline, as --mesh takes it
  remat: str
  microbatches: int

  def apply(self, cfg, precision: str | None = None):
    """A run Config (shardlab.config.Config) with this strategy, mesh, remat and microbatches
    (and `precision`, when given)."""
    train = dataclasses.replace(cfg.train, remat=self.remat, microbatches=self.microbatches,
                                **({"precision": precision} if precision else {}))
    return dataclasses.replace(cfg, strategy=self.strategy, mesh=self.mesh, train=train)


@dataclasses.dataclass
class Candidate:
  option: Option
  estimate: Estimate  # the formula's, for the target
  spec: mesh_lib.MeshSpec
  report: StepReport | None = None
  predicted_s: float | None = None  # from the compiled program
  binding: str = ""
  verdict: str = "not compiled"
  # False where the compiler's temporaries are not the target's (XLA:CPU for a bf16 run):
  # then only its state (arguments, exact) is judged, and ties do not go to its totals.
  memory_judged: bool = True

  @property
  def fits(self) -> bool:
    return self.verdict == "fits"


@dataclasses.dataclass(frozen=True)
class Choice:
  winner: Candidate
  candidates: tuple[Candidate, ...]  # the formula's order
  target: hardware.Accelerator
  n_devices: int
  compile_s: float

  def apply(self, cfg):
    """`cfg` with the winner's strategy, mesh, remat and microbatches."""
    return self.winner.option.apply(cfg)

  def as_dict(self) -> dict:
    rows = [_row(c) for c in self.candidates]
    return {"winner": _row(self.winner), "reason": self.reason(), "target": self.target.name,
            "n_devices": self.n_devices, "compile_s": self.compile_s, "candidates": rows}

  def reason(self) -> str:
    w = self.winner
    fit = [c for c in self.candidates if c.fits]
    runner = min((c for c in fit if c is not w), key=_order, default=None)
    rejected = sum(c.report is not None and not c.fits for c in self.candidates)
    text = (f"{w.option.strategy} on {w.option.mesh} has the fastest predicted step of the "
            f"{len(fit)} that fit when compiled ({seconds_text(w.predicted_s)}, bound by "
            f"{w.binding})")
    if runner is not None:
      ahead = runner.predicted_s / w.predicted_s - 1
      why = ("holds less memory" if w.memory_judged and
             w.report.total_bytes < runner.report.total_bytes else "ranked first by formula")
      other = f"{runner.option.strategy} on {runner.option.mesh}"
      text += (f", {ahead:.{0 if ahead >= 0.01 else 1}%} ahead of {other}" if ahead > 5e-4
               else f"; as fast as {other}, it {why}")
    if rejected:
      text += f"; {rejected} did not fit by XLA's memory analysis"
    return text


def _row(c: Candidate) -> dict:
  r = c.report
  return {**dataclasses.asdict(c.option), "formula_step_s": c.estimate.step_s,
          "formula_bytes": c.estimate.memory.total,
          "compiled_bytes": None if r is None else r.total_bytes,
          "predicted_step_s": c.predicted_s, "bound": c.binding, "verdict": c.verdict}


def _order(c: Candidate) -> tuple:
  """Fastest first; ties to less compiled memory where it is judged, else (min() keeps the
  first) to the formula's order."""
  return (round(c.predicted_s, 12), c.report.total_bytes if c.memory_judged else 0)


def options(req: Request, model, acc: hardware.Accelerator, n: int, strategy: str | None,
            mesh: str | None, memory_options: bool,
            vary_microbatches: bool = True, found: list | None = None) -> list[Candidate]:
  """The formula's candidates, fastest first (one per distinct placement and remat and
  microbatch count). `strategy` / `mesh` None: searched; else fixed. Memory options vary
  remat, and the microbatch count unless `vary_microbatches` is False (a resumed run must
  keep it). `found`: `search(req, ...)`'s list, where the caller has it already (the
  planner's --search), for that search itself."""
  remats = model.remat_policies if memory_options else (req.train.remat,)
  counts = ([m for m in divisors(req.train.global_batch) if m & (m - 1) == 0]
            [:MAX_MICROBATCH_OPTIONS] if memory_options and vary_microbatches
            else [req.train.microbatches])
  strategies = (strategy,) if strategy else tuple(rules_lib.STRATEGIES)
  out = []
  for remat in remats:
    for m in counts:
      r = req.with_train(remat=remat, microbatches=m)
      reuse = found is not None and r == req and strategy is None and mesh is None
      pairs = ([(e, split_ici_dcn(e.mesh_shape, acc.ici_domain)) for e in found] if reuse
               else _fitting(r, model, acc, n, strategies, mesh))
      for e, spec in pairs:
        out.append(Candidate(Option(e.strategy, plan_compile.inline_mesh(spec), remat, m), e,
                             spec))
  return sorted(out, key=lambda c: (round(c.estimate.step_s, 9), c.estimate.comm_s,
                                    c.estimate.memory.total))


def _fitting(req: Request, model, acc, n: int, strategies: tuple, mesh: str | None):
  """(estimate, mesh spec) of each candidate that fits by formula."""
  if mesh is None:
    return [(e, split_ici_dcn(e.mesh_shape, acc.ici_domain))
            for e in search(req, model, acc, n, strategies)]
  spec = mesh_lib.load(mesh).resolve(n)
  out = []
  for s in strategies:
    try:
      e = estimate(req, model, acc, spec, s)
    except ConfigError:
      continue
    if e.fits:
      out.append((e, spec))
  return out


def choose(req: Request, model, acc: hardware.Accelerator, n: int,
           compile_fn: Callable[[Option], StepReport], backend: str,
           strategy: str | None = None, mesh: str | None = None, memory_options: bool = False,
           vary_microbatches: bool = True, top_k: int = 4, budget_s: float = 600.0,
           say: Callable[[str], None] = lambda text: None,
           found: list | None = None) -> Choice:
  """Ranks by formula, compiles in that order (`compile_fn`), picks by the compiled
  programs. `backend` is where compile_fn compiles ("cpu", "tpu", "gpu")."""
  TOP_K.check(top_k, "auto layout: top K (--auto-top)")
  BUDGET_S.check(budget_s, "auto layout: the compile budget in seconds (--auto-budget-s)")
  cands = options(req, model, acc, n, strategy, mesh, memory_options, vary_microbatches,
                  found)
  if not cands:
    raise ConfigError(f"auto layout: nothing fits {model.name} on {n} {acc.name} devices "
                      f"by formula (global_batch {req.train.global_batch} × seq_len "
                      f"{req.train.seq_len}, remat {req.train.remat!r}); `shardlab plan` says "
                      f"how many devices it needs")
  start, fitting = time.perf_counter(), 0
  for i, c in enumerate(cands):
    spent = time.perf_counter() - start
    if fitting >= top_k or (i and spent > budget_s):
      c.verdict = (f"not compiled: {top_k} fit before it" if fitting >= top_k else
                   f"not compiled: the {budget_s:g} s budget was spent")
      continue
    say(f"compiling {i + 1}/{len(cands)}: {c.option.strategy} on {c.option.mesh} "
        f"(remat {c.option.remat}, {c.option.microbatches} microbatch(es))")
    c.memory_judged = judges_temporaries(req, acc, backend)
    _compile(c, req, model, acc, compile_fn, backend, say)
    fitting += c.fits
  fit = [c for c in cands if c.fits]
  seconds = time.perf_counter() - start
  if not fit:
    raise ConfigError("auto layout: no candidate fits by XLA's memory analysis:\n" +
                      "\n".join(table_lines(cands, None, acc)))
  return Choice(min(fit, key=_order), tuple(cands), acc, n, seconds)


def judges_temporaries(req: Request, acc: hardware.Accelerator, backend: str) -> bool:
  """Whether the compiled program's total memory is the target's: XLA:CPU computes bf16 in
  fp32 buffers, so for a GPU or TPU target under a bf16 policy its temporaries are not what
  the target holds (docs/planning.md); its state (the arguments) is exact everywhere."""
  return not (backend == "cpu" and acc.kind != "cpu" and req.train.precision != "fp32")


def _compile(c: Candidate, req: Request, model, acc, compile_fn, backend: str,
             say: Callable[[str], None]) -> None:
  # XLA's involuntary-rematerialisation screenfuls: one line per candidate naming it.
  layout = f"{c.option.strategy} on {c.option.mesh} (remat {c.option.remat})"
  try:
    with xla_log.quiet_remat(layout, None, say):
      c.report = compile_fn(c.option)
  except ConfigError as e:
    c.verdict = f"refused: {e}"
    return
  judged = c.report.total_bytes if c.memory_judged else c.report.argument_bytes
  if judged > acc.usable_bytes:
    c.verdict = (f"does not fit: {'' if c.memory_judged else 'state '}{size(judged)} > "
                 f"{size(acc.usable_bytes)}")
    return
  r = req.with_train(remat=c.option.remat, microbatches=c.option.microbatches)
  as_compiled = estimate(r, model, acc, c.spec, c.option.strategy, backend=backend)
  c.predicted_s, c.binding = predict(c.report, c.estimate, as_compiled, acc, c.spec,
                                     model.n_layers)
  c.verdict = "fits"


def seconds_text(s: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3)):
    if s >= scale:
      return f"{s / scale:.3g} {unit}"
  return f"{s * 1e6:.3g} µs"


def table_lines(cands, winner: Candidate | None, acc) -> list[str]:
  w = max([26] + [len(c.option.mesh) for c in cands])  # a column as wide as its meshes
  lines = [f"  {'strategy':8s} {'mesh':{w}s} {'remat':8s} {'mb':>3s} {'formula':>10s} "
           f"{'memory':>10s} {'compiled':>10s} {'predicted':>10s}  verdict"]
  for c in cands:
    r, mark = c.report, "  <- chosen" if c is winner else ""
    compiled = "-" if r is None else size(r.total_bytes)
    predicted = "-" if c.predicted_s is None else seconds_text(c.predicted_s)
    verdict = c.verdict + (f" ({c.binding})" if c.binding else "")
    lines.append(f"  {c.option.strategy:8s} {c.option.mesh:{w}s} {c.option.remat:8s} "
                 f"{c.option.microbatches:3d} {seconds_text(c.estimate.step_s):>10s} "
                 f"{size(c.estimate.memory.total):>10s} {compiled:>10s} "
                 f"{predicted:>10s}  {verdict}{mark}")
  return lines


def render(choice: Choice) -> list[str]:
  n_compiled = sum(c.report is not None for c in choice.candidates)
  return [f"auto layout on {choice.n_devices} × {choice.target.name} "
          f"({size(choice.target.usable_bytes)} usable): {len(choice.candidates)} "
          f"fit by formula, {n_compiled} compiled in {choice.compile_s:.1f} s "
          f"(memory: formula per device; predicted: the step-time model on the compiled "
          f"program)",
          *table_lines(choice.candidates, choice.winner, choice.target),
          *([] if all(c.memory_judged for c in choice.candidates) else [
              "  (XLA:CPU computes bf16 in fp32 buffers: its compiled totals are shown, not "
              "judged; a fit is the formula's, with the compiled state within the target's "
              "memory)"]),
          f"chosen: {choice.reason()}"]
