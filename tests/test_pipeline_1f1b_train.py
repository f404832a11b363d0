"""train.pipeline_schedule=1f1b runs a bundled decoder's train step by the 1F1B schedule
(shardlab/parallel/stack_1f1b.py over schedule_1f1b.py): AdamW steps of a small Llama under
stage 2 × fsdp 4 equal one device's and GPipe's; packed documents (positions and segment ids
per microbatch, counted targets) give one device's loss and gradients; the compiled step holds
less temp memory than GPipe's at the same microbatch count; eval runs GPipe forward; what
cannot run is refused when the run is set up, naming the field or member.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from shardlab import config
from shardlab.errors import ConfigError
from shardlab.models import llama, protocol
from shardlab.models.llama_config import LlamaConfig
from shardlab.sharding.activations import activation_rules
from shardlab.training import checks, run as run_lib, step as step_lib
from test_moe_parallel import model as moe_model
import test_pipeline as pipeline_tests
from test_pipeline import FP32, FP32_ADAM, STEPS, scan_lengths, to_numpy

MODEL = dataclasses.replace(H.MICRO, n_layers=4)  # 2 stages × 2 layers
MESH, M = "stage:2,fsdp:4", 8  # batch 32: 8 microbatches of 4 rows, one a device


def run(schedule: str) -> H.Run:
  return H.run("fsdp", MESH, model=MODEL, microbatches=M, pipeline_schedule=schedule)


def reference():
  """(init, per-step metrics, final state) on one device, whole batch."""
  return pipeline_tests.reference(MODEL)


@functools.cache
def trained(schedule: str):
  r = run(schedule)
  final, history = r.train(r.fresh_state(like=reference()[0]), STEPS)
  return history, to_numpy(final)


def test_1f1b_steps_match_one_device_and_gpipe():
  _, want_history, want = reference()
  history, final = trained("1f1b")
  gpipe_history, gpipe = trained("gpipe")
  for i, (got, exp, gp) in enumerate(zip(history, want_history, gpipe_history)):
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[key], exp[key], rtol=1e-5, err_msg=f"{i} {key}")
      np.testing.assert_allclose(got[key], gp[key], rtol=1e-5, err_msg=f"gpipe {i} {key}")
  H.assert_trees_close(final.params, want.params, what="1f1b params", **FP32_ADAM)
  H.assert_trees_close(final.params, gpipe.params, what="1f1b vs gpipe params", **FP32_ADAM)


def test_1f1b_holds_less_temp_memory_than_gpipe():
  """At M = 8 GPipe keeps every layer's saved tensors for all 8 microbatches; 1F1B one stage
  input per microbatch in flight, at most S = 2 (seen: 2,340,776 against 7,442,144 bytes)."""
  temp = {s: run(s).compiled_step.memory_analysis().temp_size_in_bytes
          for s in ("1f1b", "gpipe")}
  assert temp["1f1b"] < 0.5 * temp["gpipe"], temp


def packed(r: H.Run, seed: int = 0) -> dict:
  """Tokens with 1–4 documents a row and padding (segment 0) at some rows' ends: counted
  targets differ between microbatches."""
  tokens = H.tokens(r.cfg, seed)
  rng = np.random.default_rng(seed)
  segments = np.sort(rng.integers(1, 5, size=tokens.shape), axis=1).astype(np.int32)
  segments[::3, -5:] = 0
  batch = {"tokens": tokens, "segment_ids": segments}
  return jax.device_put(batch, {k: r.sh.batch for k in batch})


def test_1f1b_carries_packed_documents():
  """Positions and segment ids travel per microbatch; the loss over counted targets is the
  whole batch's (each microbatch weighted by its count), as are the gradients."""
  init = reference()[0]

  def loss_and_grads(r, schedule, kind):
    loss = step_lib.model_loss(run_lib.loss_fn(r.cfg), r.abstract)

    def f(params, batch):
      with activation_rules(r.mesh, r.rules, schedule, schedule=kind):
        return jax.value_and_grad(lambda p: loss(p, batch)[0])(params)

    return to_numpy(jax.jit(f)(r.fresh_state(like=init).params, packed(r)))

  one = H.run("dp", "data:1", model=MODEL)
  want_loss, want = loss_and_grads(one, (1, 1), "gpipe")
  loss, got = loss_and_grads(run("1f1b"), (M, 1), "1f1b")
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  H.assert_trees_close(got, want, what="packed 1f1b grads", **FP32)


def test_eval_runs_gpipe_forward_over_the_runs_microbatches():
  r, one = run("1f1b"), H.run("dp", "data:1", model=MODEL)
  init = reference()[0]
  got_step = run_lib.make_steps(r.cfg, r.abstract, r.sh)[1]
  params = r.fresh_state(like=init).params
  # GPipe's loop (M + S − 1 iterations), not 1F1B's 2(M + S − 1) ticks.
  lengths = scan_lengths(got_step.trace(params, r.batch(0)).jaxpr)
  assert M + 1 in lengths and 2 * (M + 1) not in lengths, lengths
  want = run_lib.make_steps(one.cfg, one.abstract, one.sh)[1](
      one.fresh_state(like=init).params, one.batch(0))
  np.testing.assert_allclose(got_step(params, r.batch(0)), want, rtol=1e-5)


# ---- what cannot run is refused at setup ------------------------------------------------

def setup_checks(model=MODEL, mesh=MESH, **train):
  cfg = H.make_config("fsdp", mesh, model, pipeline_schedule="1f1b", microbatches=M, **train)
  r = H.Run(cfg, None)
  checks.check_pipeline(cfg, r.rules, r.mesh)
  checks.check_pipeline_parts(cfg, r.abstract, r.rules, r.mesh)


def test_config_refuses_an_unknown_schedule():
  with pytest.raises(ConfigError, match=r"unknown train.pipeline_schedule '1f2b'.*valid: 1f1b, gpipe"):
    config.TrainConfig(pipeline_schedule="1f2b")


def test_1f1b_refuses_a_circular_schedule():
  with pytest.raises(ConfigError, match=r"pipeline_schedule=1f1b runs one layer group per "
                                        r"stage; train.pipeline_repeats=2"):
    setup_checks(pipeline_repeats=2)
  with pytest.raises(ConfigError, match=r"pipeline_repeats=2"):  # with no stage axis too
    setup_checks(mesh="fsdp:8", pipeline_repeats=2)


def test_1f1b_refuses_what_gpipe_refuses():
  with pytest.raises(ConfigError, match=r"mixture of experts.*return statistics .* does "
                                        r"not carry"):
    setup_checks(model=moe_model("dropless"))
  with pytest.raises(ConfigError, match=r"does not run with context parallelism"):
    setup_checks(mesh="stage:2,context:2,fsdp:2")
  with pytest.raises(ConfigError, match=r"train.remat=offload does not run in a pipeline"):
    setup_checks(remat="offload")


class NoPartsLlama(llama.Llama):
  pipeline_parts = None  # as a module without the member


@dataclasses.dataclass(frozen=True)
class NoPartsConfig(LlamaConfig):
  def make(self, rngs, param_dtype, remat="none", lora=None, unroll=1):
    return NoPartsLlama(self, rngs, param_dtype, remat, None, unroll)


def test_1f1b_refuses_a_model_without_pipeline_parts():
  model = NoPartsConfig(**{f.name: getattr(MODEL, f.name) for f in dataclasses.fields(MODEL)})
  assert not protocol.module_has(NoPartsLlama, "pipeline_parts")
  with pytest.raises(ConfigError, match=r"train.pipeline_schedule=1f1b \(model 'micro'\) "
                                        r"needs the model's module to give pipeline_parts "
                                        r"\(.*\); NoPartsLlama does not"):
    setup_checks(model=model)
  setup_checks(model=model, mesh="fsdp:8")  # no stage axis: nothing to run, nothing refused


def test_a_loss_that_bypasses_the_parts_is_refused_while_tracing():
  r = run("1f1b")
  hidden = lambda model, tokens: jnp.mean(model.hidden(tokens[:, :-1]))
  step = step_lib.make_train_step(hidden, r.abstract, r.sh, microbatches=M,
                                  pipeline_schedule="1f1b")
  with pytest.raises(ConfigError, match=r"reached the pipeline by itself.*"
                                        r"pipeline_1f1b_loss"):
    step.lower(r.fresh_state(), r.batch(0))


def test_without_a_stage_axis_1f1b_is_the_plain_step():
  r = H.run("fsdp", "fsdp:8", model=MODEL, microbatches=2, pipeline_schedule="1f1b")
  assert step_lib.pipeline_split(r.sh, 2, 1, "1f1b") == (2, (1, 1), "gpipe")
