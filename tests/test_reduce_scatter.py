"""The output head's gradient reduce-scattered in shard_map (shardlab/sharding/
reduce_scatter.py; on CPU under plain FSDP, where XLA would all-reduce it whole): steps with
the loss in chunks, each chunk's gradient reduced on its own, end where the whole loss's
do; outside a step it is the plain matmul. Parity with XLA's all-reduce is
test_early_grads' (early reduction on against off), the collectives test_compiled's."""

import jax.numpy as jnp
import numpy as np

import helpers as H
from shardlab.models import lm
from shardlab.models.decoder import ACTIVATIONS
from shardlab.sharding.reduce_scatter import weight_gradient
from test_early_grads import FP32_ADAM


def test_outside_a_step_it_is_the_fallback():
  x, d_logits = jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5))
  got = weight_gradient("bcd,bcv->dv", x, ACTIVATIONS["residual"], d_logits,
                        ACTIVATIONS["logits"], lm.HEAD, lambda: "fallback")
  assert got == "fallback"


def test_chunked_loss_steps_match_the_whole_loss():
  whole, chunked = H.run("fsdp"), H.run("fsdp", loss_chunk=8)
  scattered = [line for line in chunked.compiled_step.as_text().splitlines()
               if " reduce-scatter(" in line]
  assert len(scattered) == 1 and "f32[16,256]" in scattered[0]  # the head: 128 / 8 rows
  (a, ha), (b, hb) = (r.train(r.fresh_state(like=whole.init), 3) for r in (whole, chunked))
  H.assert_trees_close(b.params, a.params, **FP32_ADAM, what="params")
  np.testing.assert_allclose([h["loss"] for h in hb], [h["loss"] for h in ha], rtol=1e-6)
