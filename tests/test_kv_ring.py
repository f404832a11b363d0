"""Sliding-window layers cache a ring of `window` entries: attention over a ring fed in chunks
(longer than the window, single tokens, chunks across the wrap) equals attention over the
whole sequence; Mistral's and Gemma 2/3's caches are rings for their windowed layers only;
cached generation past the window draws the uncached tokens, on one device and sharded; the
serving planner counts exactly the bytes init_cache allocates."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from shardlab import generate
from shardlab.models import registry
from shardlab.parallel.attention import attend, attention, ring_positions
from shardlab.plan.serving import terms as inf

MODELS = ("mistral-tiny", "gemma2-tiny", "gemma3-tiny")  # windows of 4 keys
WINDOW = 4


def test_ring_positions():
  """Position p in slot p mod S, the newest S; negative: not written yet."""
  np.testing.assert_array_equal(ring_positions(4, 0), [-4, -3, -2, -1])
  np.testing.assert_array_equal(ring_positions(4, 3), [0, 1, 2, -1])
  np.testing.assert_array_equal(ring_positions(4, 6), [4, 5, 2, 3])


@pytest.mark.parametrize("slots, chunks", [
    (5, (9, 1, 1, 3, 1, 6)),  # a ring of the window: a prompt longer than it, decode
    #                          steps, a chunk shorter than it across the wrap, a longer one
    (24, (23, 1)),  # a buffer of the whole sequence (it never wraps)
])
def test_ring_attention_equals_attention_over_the_whole_sequence(slots, chunks):
  window, n = 5, sum(chunks)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, n, 4, 8)) * 2
  k, v = (jax.random.normal(key, (2, n, 2, 8)) * 2 for key in keys[1:])
  want = attention(q, k, v, impl="xla", window=window, softcap=3.0)

  @jax.jit
  def chunked(q, k, v):
    ring, out, i = (jnp.zeros((2, slots, 2, 8)), jnp.zeros((2, slots, 2, 8))), [], 0
    for c in chunks:
      o, ring = attend(q[:, i:i + c], k[:, i:i + c], v[:, i:i + c], None, ring, i,
                       window=window, softcap=3.0)
      out.append(o)
      i += c
    return jnp.concatenate(out, axis=1), ring

  out, ring = chunked(q, k, v)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  held = np.arange(n - min(slots, n), n)  # the last S positions, each in slot p mod S
  np.testing.assert_array_equal(ring[0][:, held % slots], k[:, held])
  assert np.abs(want - attention(q, k, v, impl="xla", softcap=3.0)).max() > 0.1


def buffer_lengths(cache) -> dict:
  """{"global" / "local": (layers, entries per layer)} of a cache (local: the rings)."""
  out = {"global": cache.k_NxBxSxKxE.shape[0:3:2]}
  if cache.local_k_NxBxWxKxE is not None:
    out["local"] = cache.local_k_NxBxWxKxE.shape[0:3:2]
  return out


def test_windowed_layers_cache_a_ring_of_the_window():
  shapes = lambda model, length: buffer_lengths(jax.eval_shape(
      lambda: model.init_cache(2, length, jnp.float32)))
  load = registry.load
  assert shapes(load("mistral-tiny"), 48) == {"global": (2, WINDOW)}  # every layer local
  assert shapes(load("gemma2-tiny"), 48) == {"global": (1, 48), "local": (2, WINDOW)}
  assert shapes(load("gemma3-tiny"), 48) == {"global": (1, 48), "local": (3, WINDOW)}
  # Shorter than the window: the whole sequence; no window: full buffers.
  assert shapes(load("gemma3-tiny"), 3) == {"global": (1, 3), "local": (3, 3)}
  no_window = dataclasses.replace(load("mistral-tiny"), sliding_window=0)
  assert shapes(no_window, 48) == {"global": (2, 48)}
  assert shapes(load("tiny"), 48) == {"global": (4, 48)}


def cache_bytes(model, batch: int, context: int) -> int:
  """The bytes of the K/V buffers init_cache allocates (abstract: nothing allocated)."""
  cache = jax.eval_shape(lambda: model.init_cache(batch, context, jnp.float32))
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache) if a.ndim == 5)


@pytest.mark.parametrize("name", MODELS + ("tiny",))
def test_the_planner_counts_the_bytes_init_cache_allocates(name):
  model = registry.load(name)
  for context in (48, 3):
    planned = inf.kv_bytes(model, inf.Layout(), 4, context, "fp32")
    assert planned == cache_bytes(model, 4, context), (name, context)
    # Rows over data, kv heads over tensor: a quarter on each device.
    assert inf.kv_bytes(model, inf.Layout(tensor=2, data=2), 4, context, "fp32") == planned / 4
  # By hand: K and V × 4 rows × the layers' entries × kv heads × head_dim × 4 bytes.
  entries = {"mistral-tiny": 2 * WINDOW, "gemma2-tiny": 48 + 2 * WINDOW,
             "gemma3-tiny": 48 + 3 * WINDOW, "tiny": 4 * 48}[name]
  assert sum(inf.cache_lengths(model, 48)) == entries
  assert inf.kv_bytes(model, inf.Layout(), 4, 48, "fp32") == \
      2 * 4 * entries * model.n_kv_heads * model.head_dim * 4


def test_stages_hold_consecutive_layers_and_the_fullest_one_counts():
  """gemma3-tiny's layers are local, local, local, global: on two stages the second holds
  a ring and the full buffer."""
  model = registry.load("gemma3-tiny")
  per_entry = 2 * 1 * model.n_kv_heads * model.head_dim * 2  # K and V, one row, bf16
  assert inf.kv_bytes(model, inf.Layout(stage=2), 1, 48, "bf16") == (WINDOW + 48) * per_entry


@functools.cache
def generator(name: str, strategy: str = "dp", mesh: str = "data:1"):
  """Prompts prefilled 5 tokens a call: a chunk longer than the window, then the rest."""
  run = helpers.run(strategy, mesh, model=registry.load(name), optimizer="sgd")
  return generate.Generator(run.cfg, run.abstract, run.sh, prefill_chunk=5), run


def sampling(prompt) -> generate.Sampling:
  """Tokens up to 19 in all (one cache length, so one set of compiled steps)."""
  return generate.Sampling(max_new_tokens=19 - len(prompt), temperature=1.0, top_k=20,
                           seed=3, num_samples=2, vocab=128)


PROMPTS = (np.array([5, 9, 2]), np.arange(7) * 11 % 128)  # shorter, longer than the window


# Gemma 2's rings: tests/test_hf_mistral_gemma.py (also Mistral's and Gemma 3's, under tp).
@pytest.mark.parametrize("name", ["mistral-tiny", "gemma3-tiny"])
def test_cached_generation_past_the_window_equals_uncached(name):
  """Prompts shorter than the window (3) and longer (7: a chunk of 5, then 2), then tokens
  decoded past it: the rings wrap several times. The run's cache is the rings."""
  gen, run = generator(name)
  for prompt in PROMPTS:
    cached, report = gen.generate(run.init.params, [prompt], sampling(prompt))
    assert cached[0].shape == (2, 19 - len(prompt))
    np.testing.assert_array_equal(cached[0], gen.tokens(run.init.params, prompt,
                                                        sampling(prompt), use_cache=False))
    assert report.kv_cache_bytes == inf.kv_bytes(
        run.cfg.model, inf.Layout(), 2, 19, "fp32") + 4  # and the index


def test_sharded_generation_with_rings_draws_what_one_device_draws():
  """gemma3-tiny's rings and global buffer split over fsdp (rows) and tensor (kv heads)."""
  one, run = generator("gemma3-tiny")
  sharded, _ = generator("gemma3-tiny", "fsdp_tp", "fsdp:4,tensor:2")
  params = jax.device_put(jax.tree.map(np.asarray, run.init.params),
                          sharded.sh.on_device.params)
  prompt = PROMPTS[1]
  np.testing.assert_array_equal(one.tokens(run.init.params, prompt, sampling(prompt)),
                                sharded.tokens(params, prompt, sampling(prompt)))
