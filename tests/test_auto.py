"""`--strategy auto --mesh auto`: the layout a run picks fits, is the best by the compiled
programs, is deterministic, trains like one device, and is kept on resume.

The micro model (tests/helpers.py) on a test-only target with 4 MiB per device
(tests/data/small-gpu.toml): replicated it does not fit, sharded it does.
"""

import json
import os

import jax
import pytest

import helpers as H
from shardlab.cli.train import train_main
from shardlab.errors import ConfigError
from shardlab.plan.compiled import aot
from shardlab.plan.auto import layout as auto_layout
from shardlab.plan.training import step_time
from shardlab.plan.training.estimate import Request
from shardlab.runtime import hardware

SMALL = os.path.join(os.path.dirname(__file__), "data", "small-gpu.toml")
quiet = lambda text: None


@pytest.fixture(scope="module")
def searches():
  """The default search (top 4) and an exhaustive one (every candidate compiled)."""
  cfg = H.make_config("auto", "auto")
  default = auto_layout.auto_layout(cfg, target=SMALL, say=quiet)
  every = auto_layout.auto_layout(cfg, target=SMALL, top_k=1000, say=quiet)
  return default, every


@pytest.mark.slow
def test_choice_fits_and_is_the_best_of_every_compiled_candidate(searches):
  default, every = searches
  usable = hardware.get(SMALL).usable_bytes
  assert all(c.report is not None for c in every.candidates)  # the exhaustive one compiled all
  assert default.winner.fits and default.winner.report.total_bytes <= usable
  # Replicated state does not fit 4 MiB: dp is not even a candidate by formula.
  assert "dp" not in {c.option.strategy for c in every.candidates}
  rejected = [c for c in every.candidates if c.report.total_bytes > usable]
  assert all(not c.fits for c in rejected)
  best = min(c.predicted_s for c in every.candidates if c.fits)
  assert default.winner.predicted_s == pytest.approx(best, rel=1e-9)
  assert every.winner.predicted_s == pytest.approx(best, rel=1e-9)
  assert sum(c.report is not None for c in default.candidates) < len(every.candidates)


def test_search_is_deterministic(searches):
  again = auto_layout.auto_layout(H.make_config("auto", "auto"), target=SMALL, say=quiet)
  first = searches[0]
  assert [c.option for c in again.candidates] == [c.option for c in first.candidates]
  assert again.winner.option == first.winner.option
  assert [c.predicted_s for c in again.candidates] == [c.predicted_s for c in first.candidates]


def test_prediction_reads_the_compiled_program(searches):
  w = searches[0].winner
  acc = hardware.get(SMALL)
  # its matmul FLOPs are the model's (to the few percent remat does not repeat) ...
  assert w.report.flops == pytest.approx(w.estimate.flops_per_device, rel=0.06)
  # ... and the predicted step is the step-time model's on it (auto/predict.py): at least its
  # matmuls at the model's matmul rate, and the HBM floor, named.
  terms = {"compute": w.report.flops / (acc.peak_flops * step_time.matmul_efficiency(acc)),
           "memory": w.estimate.memory_s}
  assert w.predicted_s >= max(terms.values()) * (1 - 1e-12)
  assert w.binding in ("compute", "memory", "communication", "host transfers")


def test_auto_choice_trains_like_one_device(searches):
  o = searches[0].winner.option
  sharded, ref = H.run(o.strategy, o.mesh), H.reference()
  state, history = sharded.train(sharded.fresh_state(), 3)
  ref_state, ref_history = ref.train(ref.fresh_state(), 3)
  for got, want in zip(history, ref_history):
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
  H.assert_trees_close(state.params, ref_state.params,
                       rtol=1e-5, scaled_atol=3e-5)


def test_fixed_strategy_searches_only_meshes():
  cfg = H.make_config("fsdp", "auto")
  choice = auto_layout.auto_layout(cfg, target=SMALL, top_k=1, say=quiet)
  assert {c.option.strategy for c in choice.candidates} == {"fsdp"}
  assert choice.winner.fits


def test_memory_options_search_remat_and_microbatches():
  choice = auto_layout.auto_layout(H.make_config("fsdp", "fsdp:8"), target=SMALL, top_k=1,
                                   memory_options=True, say=quiet)
  options = {(c.option.remat, c.option.microbatches) for c in choice.candidates}
  assert {r for r, _ in options} == set(H.MICRO.remat_policies)
  assert {m for _, m in options} == {1, 2, 4}  # the powers of two that split 32 over 8
  assert choice.winner.fits


def test_nothing_fits_names_the_target_and_model(tmp_path):
  tiny = tmp_path / "tiny-target.toml"
  tiny.write_text('base = "a100-80g"\nhbm_bytes = 1000\nreserve_bytes = 0\n')
  with pytest.raises(ConfigError, match=r"nothing fits micro on 8 .*tiny-target\.toml"):
    auto_layout.auto_layout(H.make_config("auto", "auto"), target=str(tiny), say=quiet)


@pytest.mark.parametrize("text, match", [
    ('base = "a100-80g"\nhbm = 4\n', r"unknown field\(s\) hbm; valid: base,"),
    ('peak_flops = 1e12\n', r"lacks .*hbm_bytes"),
    ('base = "a100-80g"\nici_bw = 0\n', r"ici_bw = 0 is not valid; valid: a finite number >= 1"),
    ('base = "nosuch"\n', r"unknown target accelerator 'nosuch'"),
])
def test_target_file_errors_name_the_field(tmp_path, text, match):
  path = tmp_path / "t.toml"
  path.write_text(text)
  with pytest.raises(ConfigError, match=match):
    hardware.get(str(path))


def test_bad_search_bounds_are_refused():
  with pytest.raises(ConfigError, match=r"top K \(--auto-top\) must be >= 1, got 0"):
    auto_layout.auto_layout(H.make_config("auto", "auto"), target=SMALL, top_k=0, say=quiet)


@pytest.mark.slow
def test_train_cli_records_the_choice_and_keeps_it_on_resume(tmp_path, capsys):
  target = tmp_path / "gpu-64m.toml"
  target.write_text('base = "a100-80g"\nname = "gpu-64m"\nhbm_bytes = 67108864\n'
                    'reserve_bytes = 0\n')
  common = ["--model", "tiny", "--strategy", "auto", "--mesh", "auto", "--target", str(target),
            "--set", "train.global_batch=8", "--set", "train.seq_len=32", "--sample-tokens",
            "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"),
            "--auto-top", "1", "--set", "train.eval_batches=1"]
  assert train_main(common + ["--steps", "2"]) == 0
  err = capsys.readouterr().err
  record = json.loads((tmp_path / "run" / "layout.json").read_text())
  chosen = record["winner"]
  assert chosen["verdict"] == "fits" and "fastest predicted step" in record["reason"]
  assert "<- chosen" in err and "auto layout on 8 × gpu-64m" in err
  assert train_main(common + ["--steps", "3"]) == 0
  err = capsys.readouterr().err
  assert f"auto layout: kept {chosen['strategy']} on {chosen['mesh']}" in err


def test_hlo_flops_unrolls_loops_and_skips_padding_taps():
  import jax.numpy as jnp
  from jax import lax
  from shardlab.observe import hlo_flops

  def scanned(x, ws):  # 5 matmuls of 8×16 @ 16×16 inside a while loop
    return lax.scan(lambda c, w: (c @ w, None), x, ws)[0]

  x, ws = jnp.ones((8, 16)), jnp.ones((5, 16, 16))
  text = jax.jit(scanned).lower(x, ws).compile().as_text()
  assert hlo_flops.dot_flops(text) == 5 * 2 * 8 * 16 * 16
  # A 1-D convolution over 10 inputs with a 3-tap window padded by 2 on each side: 12
  # outputs, of whose 36 taps 30 land on real input; 4 input and 6 output features.
  lhs, rhs = jnp.ones((1, 4, 10)), jnp.ones((6, 4, 3))
  conv = lambda a, b: lax.conv_general_dilated(a, b, (1,), [(2, 2)])
  text = jax.jit(conv).lower(lhs, rhs).compile().as_text()
  assert hlo_flops.dot_flops(text) == 2 * 30 * 4 * 6


@pytest.mark.slow
@pytest.mark.skipif(not aot.libtpu_available(), reason="needs libtpu (CI installs it)")
def test_tpu_topology_choice_compiles_and_fits():
  """llama2-70b on a v5e-256: the choice is one the TPU compiler accepted and fits."""
  req = Request.of(model="llama2-70b", target="tpu-v5e", global_batch=256, seq_len=2048)
  choice = auto_layout.for_request(req, 256, "tpu", top_k=1, say=quiet)
  w = choice.winner
  assert w.fits and w.report.where.startswith("tpu v5e:16x16")
  assert w.report.total_bytes <= hardware.get("tpu-v5e").usable_bytes
  # The program's matmul FLOPs are the formula's: it counts a whole recomputed forward under
  # full remat, of which the TPU compiler skips some (0.93 of the formula here; 0.95 on CPU),
  # less attention, which the preset runs as the splash kernel (not among the dots).
  assert w.report.flops == pytest.approx(
      w.estimate.flops_per_device - w.estimate.kernel_flops, rel=0.1)
