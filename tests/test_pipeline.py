"""Pipeline parallelism (shardlab/parallel/pipeline.py) computes what one device computes: loss,
gradients and AdamW steps for GPipe and circular schedules over 2, 4 and 8 stages, combined
with fsdp, tensor and data parallelism inside a stage, and under full remat; its compiled
step moves activations with collective-permutes and never gathers another stage's layer
weights; the eval step runs the run's schedule; a checkpoint moves between stage counts; a bad
layer count gets a clear error.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import helpers as H
from shardlab import config
from shardlab.errors import ConfigError
from shardlab.parallel import pipeline
from shardlab.observe import hlo, hlo_groups
from shardlab.sharding.activations import activation_rules
from shardlab.training import checkpoint, step as step_lib
from shardlab.training import run as run_lib

STEPS = 3
# After AdamW steps an element whose gradient is near zero carries its rounding difference
# into a step of full size (tests/test_parity.py); with 16 layers there are 8× the elements
# of its model (seen: 1 of 524288 elements of mlp down_FxD 3.6e-5 of the leaf's scale off
# under stage 4 × tensor 2; 1 of 131072 of k_DxKxE 5.7e-5 under stage 2 × tensor 4, and
# 5.5e-5 absolute, 1.4e-4 of the leaf's 0.396 scale, on an AVX512-BF16 Xeon). A wrong update
# would be off by about lr (1e-2) per step, 2.5e-2 of that scale: 80× more than this
# allows. Loss, grad norm and gradients hold to 1e-5.
FP32_ADAM = dict(rtol=1e-5, scaled_atol=3e-4)
FP32 = dict(rtol=1e-5, scaled_atol=1e-5)
# 16 layers: 8 stages × 2 repeats of one layer each; the micro model's widths otherwise.
MODEL = dataclasses.replace(H.MICRO, n_layers=16)

# (strategy, mesh, microbatches, repeats): GPipe (repeats 1) and circular.
CASES = {
    "gpipe-stage2-fsdp4": ("fsdp", "stage:2,fsdp:4", 4, 1),
    "gpipe-stage4-tensor2": ("tp", "stage:4,tensor:2", 8, 1),
    "gpipe-stage8": ("dp", "stage:8", 8, 1),
    "circular-stage4-fsdp2": ("fsdp", "stage:4,fsdp:2", 4, 2),
    "circular-stage2-tensor4": ("tp", "stage:2,tensor:4", 8, 4),
    "circular-stage8": ("dp", "stage:8", 8, 2),
    "circular-stage4-fsdp2-remat": ("fsdp", "stage:4,fsdp:2", 8, 2),
}
REMAT = {"circular-stage4-fsdp2-remat": "full"}
SLOW = ("circular-stage2-tensor4", "gpipe-stage4-tensor2", "circular-stage4-fsdp2-remat")


def run(case: str) -> H.Run:
  strategy, mesh, microbatches, repeats = CASES[case]
  return H.run(strategy, mesh, model=MODEL, microbatches=microbatches,
               pipeline_repeats=repeats, remat=REMAT.get(case, "none"))


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


@functools.cache
def reference(model=MODEL):
  """(init, per-step metrics, final state) of `model` on one device, whole batch."""
  r = H.run("dp", "data:1", model=model)
  init = to_numpy(r.init)
  final, history = r.train(r.fresh_state(like=init), STEPS)
  return init, history, to_numpy(final)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW
                                  else c for c in CASES])
def test_pipeline_steps_match_one_device(case):
  init, want_history, want = reference()
  r = run(case)
  final, history = r.train(r.fresh_state(like=init), STEPS)
  for i, (got, exp) in enumerate(zip(history, want_history)):
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[key], exp[key], rtol=1e-5, err_msg=f"{case} {i} {key}")
  H.assert_trees_close(to_numpy(final.params), want.params, what=f"{case} params",
                       **FP32_ADAM)


def grads(r: H.Run, schedule=(1, 1)):
  loss = step_lib.model_loss(run_lib.loss_fn(r.cfg), r.abstract)

  def loss_and_grads(params, batch):
    with activation_rules(r.mesh, r.rules, schedule):
      return jax.value_and_grad(lambda p: loss(p, batch)[0])(params)

  params = r.fresh_state(like=reference()[0]).params
  return to_numpy(jax.jit(loss_and_grads)(params, r.batch(0)))


@pytest.mark.parametrize("case", ["gpipe-stage2-fsdp4", "circular-stage4-fsdp2"])
def test_pipeline_gradients_match_one_device(case):
  want_loss, want = grads(H.run("dp", "data:1", model=MODEL))
  _, _, microbatches, repeats = CASES[case]
  loss, got = grads(run(case), (microbatches, repeats))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  H.assert_trees_close(got, want, what=f"{case} grads", **FP32)


def scan_lengths(jaxpr) -> list[int]:
  """The length of every lax.scan in a jaxpr, nested ones (shard_map, jit, scan bodies)
  included."""
  out = []
  for eqn in getattr(jaxpr, "eqns", None) or jaxpr.jaxpr.eqns:
    if eqn.primitive.name == "scan":
      out.append(eqn.params["length"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          out += scan_lengths(sub)
  return out


def test_eval_step_runs_the_runs_schedule_and_matches_one_device():
  """Held-out loss under a circular pipeline: the train step's microbatches and repeats (its
  loop is R·M + S − 1 long, not the S of a one-microbatch GPipe), and one device's loss."""
  case = "circular-stage4-fsdp2"
  _, _, microbatches, repeats = CASES[case]
  r, one = run(case), H.run("dp", "data:1", model=MODEL)
  init = reference()[0]
  got_step = run_lib.make_steps(r.cfg, r.abstract, r.sh)[1]
  want_step = run_lib.make_steps(one.cfg, one.abstract, one.sh)[1]
  params = r.fresh_state(like=init).params
  traced = got_step.trace(params, r.batch(0)).jaxpr
  assert pipeline.iterations(4, microbatches, repeats) in scan_lengths(traced)
  got = got_step(params, r.batch(0))
  want = want_step(one.fresh_state(like=init).params, one.batch(0))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def layer_weight_bytes(r: H.Run) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(
      r.abstract.state.params["blocks"]))


@pytest.mark.parametrize("case", ["gpipe-stage8", "circular-stage8"])
def test_compiled_step_permutes_over_stage_and_keeps_weights_local(case):
  r = run(case)
  ops = hlo.collective_ops(r.compiled_step.as_text(), 8)
  permutes = [c for c in ops if c.op == "collective-permute"]
  assert permutes and all(c.executions >= 1 for c in permutes)
  assert {a for c in permutes for a in hlo_groups.mesh_axes(c.groups, r.mesh)} <= {"stage"}
  # What the stage runs is the only layer weight it reads: no gathers of other stages'.
  gathered = sum(c.bytes * c.executions for c in ops if c.op == "all-gather")
  assert gathered < layer_weight_bytes(r) / 8 / 4, gathered


def test_checkpoint_moves_between_stage_counts(tmp_path):
  """Trained two steps (the first is warm-up's, at lr 0) on 4 stages and saved, params and
  Adam moments; restored on one device and on 8 stages: the trained params exactly, and the
  next step's update as on 4 stages (the moments came along: fresh ones would step
  differently)."""
  init, _, _ = reference()
  four = run("circular-stage4-fsdp2")
  trained, _ = four.train(four.fresh_state(like=init), 2)
  saver = checkpoint.Checkpointer(tmp_path / "ckpt")
  saver.save(trained, force=True)
  saver.wait()
  want = to_numpy(trained.params)
  assert not np.array_equal(want["embed_VxD"], init.params["embed_VxD"])  # it did train
  next_four, _ = four.train(trained, 1, first_seed=2)
  next_four = to_numpy(next_four.params)
  for target in (H.run("dp", "data:1", model=MODEL), run("gpipe-stage8")):
    state, _ = checkpoint.Checkpointer(tmp_path / "ckpt").restore(target.abstract, target.sh)
    assert int(state.step) == 2
    H.assert_trees_equal(to_numpy(state.params), want)
    for leaf, sharding in zip(jax.tree.leaves(state.params),
                              jax.tree.leaves(target.sh.state.params)):
      assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    after, _ = target.train(state, 1, first_seed=2)
    H.assert_trees_close(to_numpy(after.params), next_four, what="the step after restoring",
                         **FP32_ADAM)


def test_layers_must_divide_stages_times_repeats():
  with pytest.raises(ConfigError, match=r"n_layers \(16\) must be divisible by the pipeline "
                                        r"stages × train.pipeline_repeats \(8 × 3 = 24\)"):
    pipeline.check(16, 8, 3, 8, 32)
  with pytest.raises(ConfigError, match="circular pipeline.*microbatches"):
    pipeline.check(16, 4, 2, 2, 32)


def test_config_rejects_zero_repeats():
  with pytest.raises(ConfigError, match="pipeline_repeats"):
    config.TrainConfig(pipeline_repeats=0)


def test_bubble_and_layer_placement():
  assert pipeline.bubble(4, 4) == pytest.approx(3 / 7)
  assert pipeline.bubble(4, 4, repeats=2) == pytest.approx(3 / 11)
  assert pipeline.layers_per_stage(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert pipeline.layers_per_stage(8, 2, repeats=2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
