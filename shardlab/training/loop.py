"""A bundled model's run from a Config: set up, then trained by the one loop
(training/driver.py, which `sl.fit` runs too), checkpointed, its held-out loss reported."""

from typing import Callable

import jax

from shardlab import config as config_lib
from shardlab.config import Config
from shardlab.observe import goodput
from shardlab.observe.progress import Progress
from shardlab.sharding import idle
from shardlab.training import checkpoint, driver, schedule
from shardlab.training.nonfinite import NonFiniteGuard
from shardlab.training.run import Run, completed, init
from shardlab.training.run import resume_check, setup

# (run) -> params, for `checkpoint.init_from` values with a prefix (the CLI adds "hf:").
ParamSources = dict[str, Callable[[Run], object]]


def describe(run: Run) -> str:
  cfg, m = run.cfg, run.cfg.model
  shape = ", ".join(f"{k} {v}" for k, v in m.axis_sizes().items() if k != "vocab")
  return "\n".join([
      f"model    {m.name} ({m.arch}): {m.n_params / 1e6:,.2f}M params, {shape}",
      f"mesh     {cfg.mesh}: {run.placement.spec.describe()} on "
      f"{run.mesh.size} {jax.devices()[0].platform} device(s)" +
      (f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""),
      f"strategy {cfg.strategy}   precision {run.abstract.policy.name}   optimizer "
      f"{cfg.train.optimizer}   remat {cfg.train.remat}   offload {cfg.train.offload}" +
      (f"   scan unroll {cfg.train.scan_unroll}" if cfg.train.scan_unroll > 1 else "") +
      (f"   LoRA rank {cfg.lora.rank} on {cfg.lora.targets}" if cfg.lora.rank else ""),
      f"batch    {cfg.train.global_batch} × {cfg.train.seq_len} tokens, "
      f"{cfg.train.microbatches} microbatch(es), {cfg.train.steps} steps",
      *schedule.lines(m.n_layers, run.shardings.rules, run.mesh,
                      cfg.train.microbatches, cfg.train.pipeline_repeats,
                      cfg.train.pipeline_schedule),
      f"data     {run.feed.describe()}",
  ])


def _start_state(run: Run, ckpt, progress: Progress, sources: ParamSources,
                 allow_config_change: bool, clock: goodput.Clock):
  """(state, first step, skipped steps, saved progress or None): resumed from `ckpt`, or
  fresh (params from init_from if set)."""
  if ckpt is not None and ckpt.latest_step() is not None:
    with clock.phase("restore"):
      state, saved = ckpt.restore(run.abstract, run.shardings, warn=progress.message,
                                  check_config=resume_check(run.cfg, allow_config_change,
                                                            progress.message))
    progress.message(f"resuming from the checkpoint at step {saved['step']} in {ckpt.directory}")
    return state, int(saved["step"]), int(saved.get("skipped_steps", 0)), saved
  state = init(run)
  source = run.cfg.checkpoint.init_from
  if source:
    prefix, sep, rest = source.partition(":")
    if sep and prefix in sources:
      params, step = sources[prefix](run), 0
    else:
      strict = "checkpoint.strict" if run.cfg.checkpoint.strict else None
      with clock.phase("restore"):
        params, step = checkpoint.restore_params(source, run.abstract, run.shardings, strict,
                                                 progress.message)
    state = state.replace(params=completed(params, state.params, run.abstract, source))
    progress.message(f"initialised params from {source} (step {step}); fresh optimizer state")
  return state, 0, 0, None


class Bundled:
  """A bundled model's Run as a job of the one loop (training/driver.py)."""

  def __init__(self, run: Run, sources: ParamSources, allow_config_change: bool):
    self.run, self.cfg, self.sources, self.allow = run, run.cfg, sources, allow_config_change
    self.mesh, self.train_step, self.unit = run.mesh, run.train_step, run.feed.unit
    self.title = f"{run.cfg.model.name} {run.cfg.strategy} on {run.cfg.mesh}"

  def describe(self) -> str:
    warnings = idle.warnings(self.run.shardings.rules, dict(self.mesh.shape))
    return "\n".join([describe(self.run), *warnings])

  def start(self, ckpt, progress: Progress, clock: goodput.Clock):
    return _start_state(self.run, ckpt, progress, self.sources, self.allow, clock)

  def inputs(self, first_step: int, saved: dict | None):
    return self.run.inputs(first_step, saved)

  def flops_per_step(self) -> float:
    return self.run.flops_per_step()

  def tokens_per_step(self, batch) -> float:
    return self.cfg.train.global_batch * self.cfg.train.seq_len

  def held_out_loss(self, params) -> float:
    return self.run.held_out_loss(params)

  def baseline(self) -> dict:
    return {"unigram_loss": self.run.feed.unigram_loss()}

  def config_json(self) -> dict:
    return config_lib.to_dict(self.cfg)

  def progress(self, step: int, skipped: int = 0) -> dict:
    return _progress(self.run, step, skipped)

  def guard(self, first_step: int, skipped: int) -> NonFiniteGuard:
    return NonFiniteGuard(self.cfg.train, self.mesh, first_step, skipped)


def train(cfg: Config, quiet: bool = False, fresh: bool = False, overwrite: bool = False,
          stop_after: int | None = None, param_sources: ParamSources | None = None,
          on_finish: Callable[[Run, object, Progress], dict] | None = None,
          allow_config_change: bool = False) -> dict:
  """Runs `cfg` to its last step (or `stop_after` more steps, or a SIGTERM/SIGINT), saving
  and resuming checkpoints when `cfg.checkpoint.dir` is set; returns a summary. A finished
  run reports its held-out loss, then `on_finish(run, state, progress)` adds to it. A resume
  refuses changed settings (config.RESUME_FIELDS) unless `allow_config_change`; a
  non-finite step raises NonFiniteError (train.nonfinite). The loop is training/driver.py's,
  the one `sl.fit` runs too."""
  build = lambda: Bundled(setup(cfg), param_sources or {}, allow_config_change)
  finished = None if on_finish is None else (
      lambda job, state, progress: on_finish(job.run, state, progress))
  return driver.drive(cfg, build, quiet, fresh, overwrite, stop_after, finished)[2]


def _progress(run: Run, step: int, skipped: int = 0) -> dict:
  """What a resume needs besides the arrays: the step, the seed, and where the input stands
  (`data`: for packed documents, the rows consumed; data/feed.py)."""
  cfg = run.cfg
  progress = {"step": step, "seed": cfg.train.seed, "data_position": step,
              "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
              "data": run.feed.state(run.position(step))}
  if cfg.train.nonfinite == "skip":
    progress["skipped_steps"] = skipped
  return progress
