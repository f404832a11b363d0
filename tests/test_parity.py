"""Every strategy computes what one device computes: the sharded init, loss and gradients,
optimizer steps (AdamW and Adafactor), gradient accumulation, and the bf16 compute policy.

Across meshes the reduction order differs, so fp32 results agree to ~1e-5 relative, not
bitwise; the sharded init is the exception and must be bitwise identical.

Compiling dominates the run time on CPU (a few seconds per program, executing is ~0.1 s),
so each strategy compiles two train steps: AdamW on the whole batch, and Adafactor with
4 microbatches under full remat (each layer's gradient is then added into the accumulator
inside the layer scan's backward pass: shardlab/parallel/accumulate.py). Each is compared
with the one-device whole-batch run of its optimizer, and one device checks separately that
4 microbatches equal the whole batch for both optimizers (without remat: the accumulator
takes each microbatch's whole gradient), so a failure points at sharding, at accumulation
or at the optimizer.
"""

import functools
from unittest import mock

import jax
import numpy as np
import pytest

import helpers as H
from shardlab.parallel import accumulate

STEPS = 3
# fp32: 1e-5 relative, plus 1e-5 of the leaf's largest magnitude for elements near zero
# (a different summation order moves a small element by a fraction of the leaf's scale).
FP32 = dict(rtol=1e-5, scaled_atol=1e-5)
# After AdamW steps: the update m/sqrt(v) divides by the gradient's own size, so an element
# whose gradient is near zero carries its rounding difference into a step of full size
# (seen: 1 of 32768 elements of o_HxExD 1.4e-5 of the leaf's scale off under fsdp_tp).
FP32_ADAM = dict(rtol=1e-5, scaled_atol=3e-5)
# bf16 keeps 8 mantissa bits (a relative step of 2**-8 ~ 4e-3), and sums of bf16 products
# drift by a few of those; compare at a few percent of each leaf's scale.
BF16 = dict(rtol=3e-2, scaled_atol=3e-2)


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


@functools.cache
def initial(optimizer: str = "adamw"):
  """The one-device init for `optimizer`, on the host."""
  return to_numpy(H.reference(optimizer=optimizer).init)


@functools.cache
def reference_grads(precision: str = "fp32"):
  r = H.reference(precision=precision)
  params = r.fresh_state(like=initial()).params
  loss, grads = r.value_and_grad(params, r.batch(0))
  return float(loss), to_numpy(grads)


@functools.cache
def reference_steps(optimizer: str = "adamw", microbatches: int = 1,
                    precision: str = "fp32"):
  """(final state, per-step metrics) of STEPS steps on one device."""
  r = H.reference(optimizer=optimizer, microbatches=microbatches, precision=precision)
  final, history = r.train(r.fresh_state(like=initial(optimizer)), STEPS)
  return to_numpy(final), history


def assert_history_close(history, expected, rtol, what=""):
  assert len(history) == len(expected)
  for i, (got, want) in enumerate(zip(history, expected)):
    for key in ("loss", "grad_norm", "lr"):
      np.testing.assert_allclose(got[key], want[key], rtol=rtol,
                                 err_msg=f"{what} step {i} metric {key}")


def assert_state_close(final, want, what, tol):
  assert int(final.step) == int(want.step) == STEPS
  H.assert_trees_close(to_numpy(final.params), want.params, what=f"{what} params", **tol)
  H.assert_trees_close(to_numpy(final.opt_state), want.opt_state,
                       what=f"{what} opt_state", **tol)


def test_reference_steps_move_every_param():
  """Guards the comparisons below against being vacuous (the warmup schedule starts at
  lr 0, so the first of the STEPS steps leaves the params where they were)."""
  for optimizer in ("adamw", "adafactor"):
    final, history = reference_steps(optimizer)
    assert history[-1]["lr"] > 0
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), final.params,
                         initial(optimizer).params)
    assert min(jax.tree.leaves(moved)) > 1e-4, (optimizer, moved)
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_init_is_identical_to_one_device(strategy):
  init = H.run(strategy).init
  H.assert_trees_equal(to_numpy(init), initial(), f"{strategy} init")


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_loss_and_grads_match_one_device(strategy):
  r = H.run(strategy)
  params = r.fresh_state(like=initial()).params
  loss, grads = r.value_and_grad(params, r.batch(0))
  want_loss, want_grads = reference_grads()
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  H.assert_trees_close(to_numpy(grads), want_grads, what=f"{strategy} grads", **FP32)


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_adamw_steps_match_one_device(strategy):
  r = H.run(strategy)
  final, history = r.train(r.fresh_state(like=initial()), STEPS)
  want, want_history = reference_steps("adamw")
  assert_history_close(history, want_history, rtol=1e-5, what=strategy)
  assert_state_close(final, want, f"{strategy}/adamw", FP32_ADAM)


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_adafactor_with_microbatches_matches_one_device_whole_batch(strategy):
  r = H.run(strategy, optimizer="adafactor", microbatches=4, remat="full")
  with mock.patch.object(accumulate, "run", wraps=accumulate.run) as into_accumulator:
    r.train_step.jitted.trace(*r.abstract_args)  # the layer stack accumulates in place
  assert into_accumulator.call_count == 1
  final, history = r.train(r.fresh_state(like=initial("adafactor")), STEPS)
  want, want_history = reference_steps("adafactor", microbatches=1)
  assert_history_close(history, want_history, rtol=1e-5, what=strategy)
  assert_state_close(final, want, f"{strategy}/adafactor/4 microbatches", FP32)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_microbatches_match_whole_batch_on_one_device(optimizer):
  final, history = reference_steps(optimizer, microbatches=4)
  want, want_history = reference_steps(optimizer, microbatches=1)
  assert_history_close(history, want_history, rtol=1e-5, what=optimizer)
  assert_state_close(final, want, f"one device/{optimizer}/4 microbatches", FP32)


def test_bf16_compute_matches_one_device():
  """Loss and gradients under the bf16 policy (fp32 master weights, bf16 matmuls) on
  fsdp_tp, which exercises both weight gathers and tensor-parallel reductions. The
  optimizer update itself is precision-independent and covered in fp32 above."""
  strategy = "fsdp_tp"
  r = H.run(strategy, precision="bf16")
  params = r.fresh_state(like=initial()).params
  assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype(np.float32)}
  loss, grads = r.value_and_grad(params, r.batch(0))
  want_loss, want_grads = reference_grads("bf16")
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-2)
  H.assert_trees_close(to_numpy(grads), want_grads, what=f"{strategy} bf16 grads", **BF16)
  # Close to fp32 as well (the model still works in bf16), but not equal to it (the
  # policy really switched the matmuls to bf16).
  fp32_loss, fp32_grads = reference_grads("fp32")
  np.testing.assert_allclose(float(loss), fp32_loss, rtol=1e-2)
  assert float(loss) != fp32_loss
  H.assert_trees_close(to_numpy(grads), fp32_grads, what=f"{strategy} bf16 vs fp32 grads",
                       rtol=0.1, scaled_atol=0.1)


def test_bf16_layers_cast_one_at_a_time_train_as_the_working_copy_does():
  """Under the bf16 policy, accumulating microbatches under full remat, the layer scan reads
  the stored fp32 weights and casts each layer as it runs it, where it used to read the
  step's bf16 working copy of the whole stack (shardlab/parallel/accumulate.py): the same
  bf16 values, so the same training, bit for bit, on fsdp (the layers gathered from their
  fp32 shards)."""
  settings = dict(precision="bf16", optimizer="adafactor", microbatches=4, remat="full")
  r = H.run("fsdp", **settings)
  with mock.patch.object(accumulate, "run", wraps=accumulate.run) as into_accumulator:
    r.train_step.jitted.trace(*r.abstract_args)
  stored = into_accumulator.call_args.args[2]
  assert {x.dtype for x in stored} == {np.dtype(np.float32)}  # the cast happens per layer
  final, history = r.train(r.fresh_state(like=initial("adafactor")), STEPS)
  working = H.Run(r.cfg, None)
  with accumulate.reading_the_working_copy():
    working.compiled_step
  want, want_history = working.train(working.fresh_state(like=initial("adafactor")), STEPS)
  assert history == want_history
  H.assert_trees_equal(to_numpy(final.params), to_numpy(want.params), what="bf16 params")
  assert want_history[-1]["loss"] < want_history[0]["loss"]


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_with_16_bit_gradients_matches_one_device(strategy):
  """ZeRO-1/2 with the bf16 policy and bf16 gradients (Figure 1's configuration): the
  sharded fp32 master weights and momentum train as one device does, to bf16's tolerance.
  SGD with momentum, not Adam: Adam divides each gradient by its own size, which turns the
  bf16 rounding noise of near-zero gradients (rare tokens' embedding rows) into full steps."""
  settings = dict(precision="bf16", grad_dtype="bf16", optimizer="sgd", lr=0.3)
  ref = H.run("dp", "data:1", **settings)
  want, want_history = ref.train(ref.fresh_state(like=initial("sgd")), STEPS)
  r = H.run(strategy, **settings)
  final, history = r.train(r.fresh_state(like=initial("sgd")), STEPS)
  assert want_history[-1]["loss"] < want_history[0]["loss"]
  for got, expected in zip(history, want_history):
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-2)
  H.assert_trees_close(to_numpy(final.params), to_numpy(want.params),
                       what=f"{strategy} bf16-gradient params", **BF16)
  master = final.params["blocks"]["mlp"]["up_DxF"]
  assert master.dtype == np.float32 and master.addressable_shards[0].data.shape[1] == 128 // 8
