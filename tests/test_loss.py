"""The chunked loss equals the whole-sequence loss, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from shardlab import config
from shardlab.models import lm
from shardlab.training import step
from shardlab.errors import ConfigError


def test_chunked_cross_entropy_matches_whole_sequence():
  r = H.reference()
  params, batch = r.init.params, r.batch(0)
  def grad(chunk):
    loss = step.model_loss(lambda m, b: lm.next_token_loss(m, b, chunk), r.abstract)
    return jax.jit(jax.value_and_grad(lambda p: loss(p, batch)[0]))(params)
  (whole, g_whole), (chunked, g_chunked) = grad(0), grad(4)  # seq 16: 4 chunks
  np.testing.assert_allclose(chunked, whole, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               g_chunked, g_whole)


def test_chunk_must_divide_the_sequence():
  with pytest.raises(ConfigError, match=r"train.loss_chunk \(48\) must be 0 \(off\) or divide "
                                        r"train.seq_len \(128\)"):
    config.TrainConfig(seq_len=128, loss_chunk=48)


def _reference_cross_entropy(x, head, targets):
  """The textbook loss, differentiated by autodiff, all in fp32."""
  logits = jnp.einsum("bld,dv->blv", x.astype(jnp.float32), head.astype(jnp.float32))
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk", [0, 4])
def test_fused_cross_entropy_gradient_matches_autodiff(dtype, tol, chunk):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 8, 16)), dtype)
  head = jnp.asarray(rng.standard_normal((16, 40)) / 4, dtype)
  targets = jnp.asarray(rng.integers(0, 40, (2, 8)), jnp.int32)
  ours = jax.value_and_grad(lambda x, h: lm.cross_entropy(x, h, targets, chunk), (0, 1))
  ref = jax.value_and_grad(lambda x, h: _reference_cross_entropy(x, h, targets), (0, 1))
  (loss, grads), (ref_loss, ref_grads) = ours(x, head), ref(x, head)
  np.testing.assert_allclose(loss, ref_loss, rtol=tol)
  for g, r_g in zip(grads, ref_grads):
    assert g.dtype == dtype  # gradients come back in the operands' dtype
    scale = float(jnp.max(jnp.abs(r_g)))
    np.testing.assert_allclose(np.asarray(g, np.float32), r_g, atol=tol * scale)
