"""`sl.auto_layout` on a module shardlab does not know (examples/mixer.py's Mixer): candidates
estimated by plan_module, the best compiled, the fastest by roofline chosen and trained."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import helpers as H
import shardlab as sl
from shardlab.plan.auto import choice as auto
from shardlab.plan.auto import layout as auto_layout
from shardlab.plan.auto import module as auto_module

quiet = lambda text: None
mixer = H.mixer()
BATCH = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mixer.make_batch(0, 64))


def test_a_module_gets_a_layout_that_fits_and_trains():
  factory = lambda: mixer.Mixer(nnx.Rngs(0))
  choice = sl.auto_layout(factory, optimizer=optax.adamw(1e-3), batch=BATCH,
                          loss_fn=mixer.loss_fn, top_k=2, say=quiet)
  usable = choice.target.usable_bytes
  assert choice.target.name == "host-cpu" and choice.n_devices == 8
  rows = choice.candidates
  # Every strategy is listed, each row with its estimate; the two smallest compiled.
  assert {c.strategy for c in rows} == set(auto_module.STRATEGIES)
  assert all(c.plan is not None and c.plan.total > 0 for c in rows)
  assert [c.plan.total for c in rows] == sorted(c.plan.total for c in rows)
  compiled = [c for c in rows if c.report is not None]
  assert compiled == list(rows[:2])
  assert all(0 < c.report.total_bytes <= usable and c.score_s > 0 for c in compiled)
  assert all(c.verdict.startswith("not compiled: outside the top 2") for c in rows[2:])
  win = choice.winner
  assert win in compiled and win.fits
  assert win.score_s == min(c.score_s for c in compiled)
  text = choice.render()
  assert f"chosen: {choice.strategy} on {choice.mesh}" in text and "<- chosen" in text
  assert len(text.splitlines()) == len(rows) + 3
  # The chosen layout trains a step.
  abstract = sl.abstract_state(factory, optax.adamw(1e-3), "fp32")
  shardings = sl.shardings(abstract, sl.strategy(choice.strategy), sl.mesh(choice.mesh))
  step = sl.train_step(mixer.loss_fn, abstract, shardings)
  state, metrics = step(sl.init(abstract, shardings),
                        jax.device_put(mixer.make_batch(0, 64), shardings.batch))
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


def test_rules_that_cannot_shard_the_params_are_listed_as_skipped():
  # d=36: fsdp over 8 devices cannot split the `embed` dim; over 2 or 4 it can.
  choice = sl.auto_layout(lambda: mixer.Mixer(nnx.Rngs(0), d=36, depth=1),
                          optimizer=optax.sgd(0.1), batch=BATCH, loss_fn=mixer.loss_fn,
                          strategies=("fsdp",), top_k=1, say=quiet)
  by_mesh = {c.mesh: c for c in choice.candidates}
  skipped = by_mesh["data:1,fsdp:8,tensor:1"]
  assert skipped.plan is None and skipped.report is None
  assert skipped.verdict.startswith("skipped:") and "not divisible" in skipped.verdict
  assert "embed, size 36" in skipped.verdict and "skipped:" in choice.render()
  assert choice.mesh != "data:1,fsdp:8,tensor:1" and choice.winner.fits


def test_bad_module_arguments_are_refused():
  with pytest.raises(sl.ConfigError, match="a run Config or a module factory.*got str"):
    sl.auto_layout("mixer", optimizer=optax.sgd(0.1), batch=BATCH, loss_fn=mixer.loss_fn)
  with pytest.raises(sl.ConfigError, match=r"strategy 'tp_sp' is not searched.*valid: dp"):
    sl.auto_layout(lambda: mixer.Mixer(nnx.Rngs(0)), optimizer=optax.sgd(0.1), batch=BATCH,
                   loss_fn=mixer.loss_fn, strategies=("tp_sp",), say=quiet)
  with pytest.raises(sl.ConfigError, match="target= and n_devices= apply to a run Config"):
    sl.auto_layout(lambda: mixer.Mixer(nnx.Rngs(0)), target="tpu-v5e", n_devices=8,
                   optimizer=optax.sgd(0.1), batch=BATCH, loss_fn=mixer.loss_fn)
  with pytest.raises(sl.ConfigError, match=r"\['loss_fn'\] apply to a module factory"):
    sl.auto_layout(H.make_config("auto", "auto"), loss_fn=mixer.loss_fn)


def test_a_config_still_takes_the_bundled_search(monkeypatch):
  sentinel = object()
  seen = {}

  def choose(req, model, *args, **kwargs):
    seen["model"] = model.name
    return sentinel

  def module_search(*args, **kwargs):
    raise AssertionError("a Config went to the module search")

  monkeypatch.setattr(auto, "choose", choose)
  monkeypatch.setattr(auto_module, "auto_layout_module", module_search)
  cfg = H.make_config("auto", "auto")
  assert auto_layout.auto_layout(cfg, say=quiet) is sentinel
  assert seen["model"] == cfg.model.name
