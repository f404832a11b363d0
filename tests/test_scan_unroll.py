"""train.scan_unroll (given to the model when it is built, with train.remat: the layer scan's
settings) changes how a step loops over the layers, not what it computes: unrolled
train steps (llama, and a mixture of experts, whose scan also carries the router statistics)
end in the params, optimizer state and metrics of the scanned steps, the eval loss is the
same, and neither compiled program keeps a layer loop."""

import dataclasses
import re

import numpy as np
import pytest

import helpers as H
from shardlab.plan.compiled import aot
from shardlab.training import run as run_lib
from test_early_grads import FP32_ADAM
from test_moe_parallel import TOL as MOE_TOL
from test_moe_parallel import model as moe_model

STEPS = 3


def loops(compiled) -> int:
  """The program's while loops, less those XLA:CPU's older emitters expand a scatter into
  (the embedding's gradient, under the suite's shardlab_fast_compile)."""
  return sum(1 for line in compiled.as_text().splitlines()
             if re.search(r"\bwhile\(", line) and "scatter" not in line)


def eval_step(run):
  step = run_lib.make_steps(run.cfg, run.abstract, run.sh)[1]
  return step.lower(run.init.params, run.batch()).compile()


@pytest.mark.parametrize("model, mesh, tol", [(H.MICRO, None, FP32_ADAM),
                                              (moe_model("dropless"), "fsdp:-1", MOE_TOL)],
                         ids=["llama", "moe"])
def test_unrolled_steps_compute_what_the_scanned_steps_do(model, mesh, tol):
  scanned = H.run("fsdp", mesh, model=model)
  unrolled = H.run("fsdp", mesh, model=model, scan_unroll=model.n_layers)
  assert unrolled.cfg.train.scan_unroll == model.n_layers == 2
  assert loops(scanned.compiled_step) >= 2 and loops(unrolled.compiled_step) == 0
  (a, ha), (b, hb) = (r.train(r.fresh_state(like=scanned.init), STEPS)
                      for r in (scanned, unrolled))
  H.assert_trees_close(b.params, a.params, **tol, what="params")
  H.assert_trees_close(b.opt_state, a.opt_state, **tol, what="opt_state")
  assert ha[0].keys() == hb[0].keys()
  for key in ha[0]:
    np.testing.assert_allclose([h[key] for h in hb], [h[key] for h in ha], rtol=1e-5,
                               err_msg=key)

  evals = [eval_step(r) for r in (scanned, unrolled)]
  assert loops(evals[0]) >= 1 and loops(evals[1]) == 0
  losses = [float(e(scanned.init.params, scanned.batch())) for e in evals]
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


@pytest.mark.parametrize("layers", [2, 1], ids=["unrolled", "one-layer"])
def test_a_stack_without_a_loop_still_recomputes_its_layers(layers):
  """Unrolled whole, or one layer (whose loop XLA removes), the stack is straight-line code,
  where CSE would merge the backward's recomputed forward with the forward and silently undo
  the remat (shardlab/parallel/scan.py keeps them apart there). Under full remat the step
  runs each layer's forward matmuls and attention einsums again: all but the down
  projection's, whose output only feeds the residual sum the backward does not read."""
  model = dataclasses.replace(H.MICRO, n_layers=layers)
  flops = {}
  for remat in ("none", "full"):
    cfg = H.make_config("dp", "data:1", model, remat=remat, scan_unroll=layers,
                        global_batch=4, seq_len=64)
    flops[remat] = aot.compile_on_cpu(cfg, 1).flops
  m, tokens = model, 4 * 64
  weights = 2 * (m.n_layer_params - m.n_layers * m.d_model * m.mlp_dim)
  attention = 4 * m.n_layers * m.n_heads * m.head_dim * 64
  # The norms' few multiplies by their scales count among the FLOPs too (1% here).
  assert flops["full"] - flops["none"] == pytest.approx((weights + attention) * tokens,
                                                        rel=0.02), flops
