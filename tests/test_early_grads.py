"""Early gradient reduction (shardlab/parallel/early_grads.py): the step computes what it
computes without it, the MLP's and the head's weight gradients are reduced to their shards
inside the optimization barriers that release the backward below them, a frozen weight
still gets no gradient matmul, and outside a train step nothing is tied."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

import helpers as H
from shardlab.models import llama
from shardlab.parallel import reduce_grads_early
from test_lora import lora_config

FP32_ADAM = dict(rtol=1e-5, scaled_atol=3e-5)  # tests/test_parity.py's


def test_is_the_identity_outside_a_train_step():
  mlp = llama.MLP(H.MICRO, jnp.float32, nnx.Rngs(0))
  x = jnp.ones((2, 4, H.MICRO.d_model))
  out_x, (gate, down) = reduce_grads_early(x, mlp.gate_DxF, mlp.down_FxD)
  assert out_x is x and gate is mlp.gate_DxF[...] and down is mlp.down_FxD[...]


def test_steps_match_the_step_without_it():
  early, late = H.run("fsdp"), H.run("fsdp", early_grad_reduce=False)
  assert early.cfg.train.early_grad_reduce and not late.cfg.train.early_grad_reduce
  (a, ha), (b, hb) = (r.train(r.fresh_state(like=H.reference().init), 3) for r in (early, late))
  H.assert_trees_close(a.params, b.params, **FP32_ADAM, what="params")
  np.testing.assert_allclose([h["loss"] for h in ha], [h["loss"] for h in hb], rtol=1e-6)


def barriers(lowered: str) -> list[list[str]]:
  """Per optimization barrier of a lowered step, what defines each operand: the sharding a
  constraint gives it ('tensor<128x256xf32> [{"fsdp"}, {}]'), else 'unconstrained'."""
  lines = lowered.splitlines()
  out = []
  for i, line in enumerate(lines):
    if "stablehlo.optimization_barrier" not in line:
      continue
    names = re.findall(r"%[\w#]+", line.split("optimization_barrier", 1)[1].split(":")[0])
    found = []
    for name in names:
      define = next(l for l in reversed(lines[:i]) if l.lstrip().startswith(f"{name} = "))
      m = re.search(r"sdy.sharding_constraint \S+ <@mesh, (\[.*\])> : (tensor<[^>]*>)", define)
      found.append(f"{m.group(2)} {m.group(1)}" if m else "unconstrained")
    out.append(found)
  return out


def test_the_barriers_release_the_input_gradient_with_the_reduced_shards():
  """fsdp:8 on the micro model (d_model 128, mlp 256, vocab 256): the MLP input's gradient is
  released with gate's and up's weight gradients constrained to their fsdp shards, the
  hidden activation's with down's, the final hidden state's with the head's; without early
  reduction there are no barriers."""
  rows, cols = 'tensor<128x256xf32> [{"fsdp"}, {}]', 'tensor<256x128xf32> [{}, {"fsdp"}]'
  want = [["unconstrained", rows, rows], ["unconstrained", cols], ["unconstrained", rows]]
  found = barriers(H.run("fsdp").lowered_step.as_text())
  assert sorted(map(sorted, found)) == sorted(map(sorted, want))
  assert barriers(H.run("fsdp", early_grad_reduce=False).lowered_step.as_text()) == []


def test_a_frozen_base_still_gets_no_weight_gradient_matmul():
  flops = {}
  for early in (True, False):
    cfg = lora_config("fsdp", "fsdp:-1")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                             early_grad_reduce=early))
    flops[early] = H.Run(cfg, None).compiled_step.cost_analysis()["flops"]
  assert flops[True] == flops[False], flops
