"""Top-k routing for a mixture of experts, and the router's statistics.

The router's softmax over the experts, the top k kept and renormalised to sum to 1
(Mixtral's rule; `normalize=False` keeps the raw top-k probabilities). The statistics give
the load-balancing loss E · Σ_e f_e · P_e (f_e: the fraction of token-choices that picked
e, summed over the k choices; P_e: the mean router probability of e; k at perfect balance,
as Hugging Face's Mixtral computes it) and the router z-loss mean(logsumexp(logits)²)
(ST-MoE, Zoph et al. 2022). Both are global over the batch, so they are the same on every
mesh. They are returned, for the model to sum over its layers and add to its loss.
Shape suffixes: B batch, L length, E experts, K experts per token.
"""

import jax
import jax.numpy as jnp


def route(logits_BxLxE, k: int, normalize: bool = True):
  """(weights, expert ids), B×L×K each: the top k of the softmax, renormalised to sum to 1
  unless `normalize` is False."""
  probs = jax.nn.softmax(logits_BxLxE, axis=-1)
  top_p, top_e = jax.lax.top_k(probs, k)
  if normalize:
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  return top_p, top_e.astype(jnp.int32)


def router_stats(logits_BxLxE, experts_BxLxK) -> dict:
  """{load_balance, router_z} of one layer's routing (fp32 scalars)."""
  n_experts = logits_BxLxE.shape[-1]
  probs_E = jnp.mean(jax.nn.softmax(logits_BxLxE, axis=-1), axis=(0, 1))
  chosen = jax.nn.one_hot(experts_BxLxK, n_experts, dtype=jnp.float32)
  fraction_E = jnp.sum(jnp.mean(chosen, axis=(0, 1)), axis=0)
  z = jax.nn.logsumexp(logits_BxLxE, axis=-1)
  return {"load_balance": n_experts * jnp.sum(fraction_E * probs_E),
          "router_z": jnp.mean(z * z)}
