"""What a pipeline (`layers` split over `stage`) cannot combine with is refused when the run is
set up — before the abstract state is built or anything is traced — with an error naming the
fields: remat offload, optimizer-state offload, a mixture of experts, context parallelism, a
layer count the stages × repeats do not divide, a circular schedule short of microbatches,
microbatches the batch axes do not split. The traced layer scan refuses the same with the
same message for a step built by hand (shardlab/parallel/pipeline.py `check_combination`).

Pipeline × context parallelism was tried on the micro llama (stage:2,context:2,fsdp:2, 2
microbatches, seq 64) before it was refused: attention's shard_map over `context` nested in
the pipeline's over `stage` fails to lower ("The context mesh AbstractMesh(... 'stage': 2
... Manual ...) should match the mesh passed to shard_map Mesh(...)"; given the stage-manual
mesh, Shardy rejects it: "operand sharding ... must have all manual axes come before free
axes ... Saw manual axis "fsdp" after free axis "stage"").
"""

import dataclasses

import jax
import numpy as np
import pytest

import helpers as H
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.parallel import pipeline
from shardlab.training import run as run_lib
from shardlab.training import step as step_lib

MODEL = dataclasses.replace(H.MICRO, n_layers=4)
MOE = registry.load("moe-tiny")  # 4 layers, 8 experts
PIPE = ("fsdp", "stage:2,fsdp:4")

# name: (strategy, mesh, model, train overrides, what the error must say)
REFUSED = {
    "remat-offload": (*PIPE, MODEL, dict(microbatches=4, remat="offload"),
                      r"train.remat=offload does not run in a pipeline \(stage 2.*"
                      r"use train.remat=full"),
    "opt-state-offload": (*PIPE, MODEL, dict(microbatches=4, offload="opt_state"),
                          r"train.offload=opt_state does not run with a pipeline "
                          r"\(stage 2.*use train.offload=none"),
    "moe": (*PIPE, MOE, dict(microbatches=4),
            r"model 'moe-tiny' is a mixture of experts \(model.n_experts=8\): its layers "
            r"return statistics .* pipeline \(stage 2.*rules.params.layers=none"),
    "context": ("fsdp", "stage:2,context:2,fsdp:2", MODEL, dict(microbatches=2, seq_len=64),
                r"a pipeline \(stage 2: .*\) does not run with context parallelism "
                r"\(context 2: .*use one or the other: set the mesh's `stage` or `context`"),
    "layers": ("fsdp", "stage:4,fsdp:2", dataclasses.replace(MODEL, n_layers=6),
               dict(microbatches=4),
               r"model.n_layers \(6\) must be divisible by the pipeline stages × "
               r"train.pipeline_repeats \(4 × 1 = 4\)"),
    "circular-microbatches": (*PIPE, MODEL, dict(microbatches=1, pipeline_repeats=2),
                              r"train.pipeline_repeats=2\) needs train.microbatches >= the "
                              r"stages \(2\), got 1; raise train.microbatches to 2"),
    "microbatch-batch-axes": (*PIPE, MODEL, dict(microbatches=16),
                              r"the microbatch \(train.global_batch 32 / 16 microbatches = 2\)"
                              r" is not divisible by the batch-sharding mesh axes data×fsdp "
                              r"\(4 shards\)"),
}
# Refused by the layout check alone, before even the abstract state; the batch-axes rule
# needs the shardings (make_steps, still before any trace).
BEFORE_STATE = set(REFUSED) - {"microbatch-batch-axes"}


def config(case: str):
  strategy, mesh, model, train, _ = REFUSED[case]
  return H.make_config(strategy, mesh, model, **train)


@pytest.fixture
def untraceable(monkeypatch):
  """Tracing the pipeline fails the test outright: a refusal must come before it."""
  def traced(*args, **kwargs):
    raise AssertionError("the pipeline was traced")

  monkeypatch.setattr(pipeline, "run", traced)
  return monkeypatch


@pytest.mark.parametrize("case", REFUSED)
def test_setup_refuses_what_a_pipeline_cannot_run(case, untraceable):
  if case in BEFORE_STATE:
    def built(*args, **kwargs):
      raise AssertionError("the abstract state was built")
    untraceable.setattr(run_lib, "abstract_state", built)
  with pytest.raises(ConfigError, match=REFUSED[case][-1]):
    run_lib.setup(config(case), with_data=False)


@pytest.mark.parametrize("case", ["remat-offload", "moe"])
def test_the_same_refusals_without_a_pipeline_are_no_refusals(case):
  """The rules are about pipelines: on a mesh without `stage` these settings set up."""
  cfg = dataclasses.replace(config(case), mesh="fsdp:8")
  run_lib.setup(cfg, with_data=False)


def test_global_batch_must_divide_into_microbatches_at_config_time():
  with pytest.raises(ConfigError, match=r"train.global_batch \(30\) must be divisible by "
                                        r"train.microbatches \(4\)"):
    H.make_config(*PIPE, MODEL, global_batch=30, microbatches=4)


def _hand_built_step(cfg):
  """A train step built through the generic API (no run setup, no config checks)."""
  r = H.Run(cfg, None)
  step = step_lib.make_train_step(run_lib.loss_fn(cfg), r.abstract, r.sh,
                                  microbatches=cfg.train.microbatches,
                                  pipeline_repeats=cfg.train.pipeline_repeats)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       r.abstract.state, r.sh.state)
  shape = (cfg.train.global_batch, cfg.train.seq_len + 1)
  return step, state, jax.ShapeDtypeStruct(shape, np.int32, sharding=r.sh.batch)


@pytest.mark.parametrize("case", ["remat-offload", "context", "moe"])
def test_a_hand_built_step_meets_the_same_rule_while_tracing(case):
  """The last line of defence: the traced layer scan asks the same function, so the message
  is setup's (the module is named generically: the scan cannot see a config)."""
  step, state, batch = _hand_built_step(config(case))
  with pytest.raises(ConfigError) as traced:
    step.lower(state, batch)
  with pytest.raises(ConfigError) as at_setup:
    run_lib.setup(config(case), with_data=False)
  if case == "moe":
    assert str(traced.value).startswith("this model's layers return statistics")
    assert str(at_setup.value).endswith(str(traced.value).removeprefix("this model's layers"))
  else:
    assert str(traced.value) == str(at_setup.value)

