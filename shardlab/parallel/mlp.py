"""Gated MLP activations with their gradients written out."""

import jax
import jax.numpy as jnp


# silu(gate)·up with its gradient written out, so that only gate and up are kept for the
# backward (autodiff keeps silu's internals and silu(gate) too: four more B×L×F residuals,
# in fp32 where the backend computes bf16 elementwise in fp32).
@jax.custom_vjp
def swiglu(gate, up):
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_forward(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_backward(residuals, d_h):
  gate, up = residuals
  g, u, d = (t.astype(jnp.float32) for t in (gate, up, d_h))
  sig = jax.nn.sigmoid(g)
  d_gate = d * u * sig * (1 + g * (1 - sig))
  return d_gate.astype(gate.dtype), (d * g * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_forward, _swiglu_backward)
