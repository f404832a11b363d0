"""Bring your own module: the public API trains a non-decoder NNX module (examples/mixer.py)
sharded like one device, places it by its logical names, checkpoints and reshards it, and
refuses logical names and state it cannot handle."""

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import helpers as H
import shardlab as sl

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


mixer = H.mixer()


@functools.cache
def trained(mesh: str, strategy: str):
  devices = jax.devices()[:1] if mesh == "data:1" else None
  history, abstract, state, shardings = mixer.train(mesh, strategy, STEPS, devices=devices)
  return history, abstract, state, shardings


def test_public_api_is_small_and_lazy():
  # 19: the run API (fit: train.py's loop for any module), plus plan_module (the planner for
  # any module); the building blocks live in their own namespace, shardlab.parallel.
  assert len(sl.__all__) <= 19
  code = "import shardlab, sys; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"  # importing shardlab starts nothing


@pytest.mark.parametrize("mesh,strategy", [("data:2,fsdp:2,tensor:2", "fsdp_tp"),
                                           ("fsdp:8", "fsdp"), ("data:8", "zero2")])
def test_own_module_matches_one_device(mesh, strategy):
  want_history, _, want, _ = trained("data:1", "dp")
  history, _, state, _ = trained(mesh, strategy)
  assert want_history[-1]["loss"] < want_history[0]["loss"]  # it learns, so this is no tautology
  for got, expected in zip(history, want_history):
    for key in ("loss", "accuracy", "grad_norm"):
      np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
  H.assert_trees_close(jax.tree.map(np.asarray, state.params),
                       jax.tree.map(np.asarray, want.params), rtol=1e-5, scaled_atol=1e-5)


def test_own_module_is_placed_by_its_logical_names():
  _, _, state, shardings = trained("data:2,fsdp:2,tensor:2", "fsdp_tp")
  params = state.params
  spec = lambda leaf: H.normalized(leaf.sharding.spec, leaf.ndim)
  assert spec(params["stem"]) == (None, "fsdp")
  assert spec(params["head"]) == ("fsdp", None)  # "classes": registered, no rule: replicated
  block = params["blocks"][0]
  assert spec(block["tok1"]) == (None, "tensor")  # patches, mlp
  assert spec(block["ch1"]) == ("fsdp", "tensor")
  assert spec(block["ch2"]) == ("tensor", "fsdp")
  assert spec(block["norm1"]["scale"]) == ("fsdp",)  # nnx.with_partitioning works too
  assert shardings.batch.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  mu = state.opt_state[0].mu["blocks"][0]["ch1"]  # optimizer state follows its param
  assert spec(mu) == ("fsdp", "tensor")
  assert mu.addressable_shards[0].data.shape == (64 // 2, 128 // 2)


def test_own_module_checkpoint_restores_onto_another_mesh(tmp_path):
  _, abstract, state, _ = trained("data:2,fsdp:2,tensor:2", "fsdp_tp")
  ckpt = sl.Checkpointer(str(tmp_path))
  ckpt.save(state, force=True)
  ckpt.wait()
  other = sl.shardings(abstract, sl.strategy("tp"), sl.mesh("data:4,tensor:2"))
  restored, progress = ckpt.restore(abstract, other)
  ckpt.close()
  assert progress["step"] == STEPS
  H.assert_trees_equal(jax.tree.map(np.asarray, restored.params),
                       jax.tree.map(np.asarray, state.params))
  assert restored.params["blocks"][0]["ch1"].sharding.spec == jax.sharding.PartitionSpec(
      None, "tensor")


class Tiny(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, names=("embed", "mlp"), keep_rngs: bool = False):
    self.w = sl.param(jax.random.normal(rngs.params(), (8, 16)), names)
    if keep_rngs:
      self.rngs = rngs


def test_a_misspelled_logical_name_is_refused():
  abstract = sl.abstract_state(lambda: Tiny(nnx.Rngs(0), ("embed", "mpl")), optax.sgd(0.1))
  with pytest.raises(sl.ConfigError, match=r"param w.*'mpl'.*did you mean: mlp"):
    sl.shardings(abstract, sl.strategy("fsdp_tp"), sl.mesh("fsdp:4,tensor:2"))


def test_registered_names_can_be_mapped_by_a_rule_override():
  sl.register_axes("experts_hidden")
  abstract = sl.abstract_state(lambda: Tiny(nnx.Rngs(0), ("embed", "experts_hidden")),
                               optax.sgd(0.1))
  rules = sl.strategy("fsdp", {"params": {"experts_hidden": "tensor"}})
  shardings = sl.shardings(abstract, rules, sl.mesh("fsdp:4,tensor:2"))
  assert shardings.state.params["w"].spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def test_state_other_than_params_is_refused():
  with pytest.raises(sl.ConfigError, match="other than nnx.Param.*RngKey|RngCount"):
    sl.abstract_state(lambda: Tiny(nnx.Rngs(0), keep_rngs=True), optax.sgd(0.1))


def test_microbatches_of_a_dict_batch_equal_the_whole_batch():
  abstract = sl.abstract_state(lambda: mixer.Mixer(nnx.Rngs(0)), optax.sgd(0.1), "fp32")
  shardings = sl.shardings(abstract, sl.strategy("fsdp"), sl.mesh("fsdp:8"))
  batch = jax.device_put(mixer.make_batch(0, 32), shardings.batch)
  results = []
  for microbatches in (1, 4):
    step = sl.train_step(mixer.loss_fn, abstract, shardings, microbatches=microbatches)
    state, metrics = step(sl.init(abstract, shardings), batch)
    results.append((metrics, state.params))
  (m1, p1), (m4, p4) = results
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
  np.testing.assert_allclose(m4["accuracy"], m1["accuracy"], rtol=1e-6)
  H.assert_trees_close(jax.tree.map(np.asarray, p4), jax.tree.map(np.asarray, p1),
                       rtol=1e-5, scaled_atol=1e-6)


def test_a_batch_that_does_not_split_over_the_batch_axes_is_refused():
  abstract = sl.abstract_state(lambda: mixer.Mixer(nnx.Rngs(0)), optax.sgd(0.1))
  shardings = sl.shardings(abstract, sl.strategy("fsdp"), sl.mesh("fsdp:8"))
  step = sl.train_step(mixer.loss_fn, abstract, shardings)
  batch = mixer.make_batch(0, 12)
  with pytest.raises(sl.ConfigError, match=r"the batch's leading dim \(12\) is not divisible.*fsdp \(8 shards\)"):
    step.lower(abstract.state, jax.tree.map(jnp.asarray, batch))


def batch_shapes(size: int = 64):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mixer.make_batch(0, size))


def test_own_module_inspect_and_compile_on_simulated_devices():
  from shardlab.plan.compiled import aot
  from shardlab.plan.training import layout as inspect
  _, abstract, _, shardings = trained("data:2,fsdp:2,tensor:2", "fsdp_tp")
  layout = inspect.state_layout(abstract, shardings)
  row = next(r for r in layout.params if r.path == "blocks.0.ch1")
  assert row.names == ("embed", "mlp") and row.local_shape == (32, 64)
  assert "blocks.0.ch1" in inspect.render_state(layout, shardings, "mixer")
  step = sl.train_step(mixer.loss_fn, abstract, shardings)
  report = aot.compile_train_step(step, abstract, shardings, batch_shapes())
  batch_bytes = sum(x.size * x.dtype.itemsize for x in mixer.make_batch(0, 64).values()) // 4
  assert report.argument_bytes == layout.bytes_per_device()["state"] + batch_bytes
  assert report.kinds()["all-gather"]["count"] > 0  # fsdp gathers the weights


@pytest.mark.skipif(not importlib.util.find_spec("libtpu"), reason="needs libtpu (the tpu extra)")
def test_own_module_compiles_for_a_tpu_topology():
  from shardlab.plan.compiled import aot
  devices, _ = aot.tpu_devices("v5e", 4)
  abstract = sl.abstract_state(lambda: mixer.Mixer(nnx.Rngs(0)), optax.adamw(1e-3), "bf16")
  shardings = sl.shardings(abstract, sl.strategy("fsdp"), sl.mesh("fsdp:4", devices))
  step = sl.train_step(mixer.loss_fn, abstract, shardings)
  report = aot.compile_train_step(step, abstract, shardings, batch_shapes())
  assert report.where == "tpu x4"
  assert report.kinds()["reduce-scatter"]["count"] > 0  # gradients, on a real TPU compile


def test_your_model_doc_runs_as_written(capsys):
  text = (ROOT / "docs" / "your-model.md").read_text()
  code = text.split("This runs as written (the test suite runs it):\n\n```python\n")[1]
  exec(compile(code.split("```")[0], "docs/your-model.md", "exec"), {})
  loss_line, spec_line = capsys.readouterr().out.strip().splitlines()[-2:]
  assert float(loss_line.split()[1]) < 0.1
  assert spec_line == "P('fsdp', 'tensor')"
