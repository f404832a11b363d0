"""LoRA for any module (shardlab.parallel.add_lora): a module written here, with plain 2-D
weights and a stacked weight run by scan_layers, plus examples/mixer.py's Mixer. The
adapters change nothing at init, only they train, fsdp_tp matches one device step for step,
A and B shard like their weight, and merging gives the base tree computing the same.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import helpers as H
import shardlab as sl
from shardlab import parallel as slp
from shardlab.errors import ConfigError

IN, D, HIDDEN, CLASSES, LAYERS, BATCH = 12, 16, 32, 4, 2, 16
RANK, ALPHA = 4, 8.0
TARGETS = ("stem", r"layers/w[12]")  # the head stays a plain (frozen) Param
ADAPTED = (("stem",), ("layers", "w1"), ("layers", "w2"))
STEPS = 3
ONE, SHARDED = ("data:1", "dp"), ("data:2,fsdp:2,tensor:2", "fsdp_tp")
FP32_ADAM = dict(rtol=1e-5, scaled_atol=3e-5)  # see tests/test_parity.py


class Layers(nnx.Module):
  """A stack of residual MLP layers: each weight leads with the `layers` dim."""

  def __init__(self, rngs: nnx.Rngs, n: int, cheap: bool):
    self.w1 = slp.stacked_param(rngs, (D, HIDDEN), ("embed", "mlp"), D, jnp.float32, (n,))
    self.w2 = slp.stacked_param(rngs, (HIDDEN, D), ("mlp", "embed"), HIDDEN, jnp.float32, (n,))
    self.cheap = cheap  # project with slp.lora_einsum instead of reading the weight

  def project(self, spec, x, weight):
    return slp.lora_einsum(spec, x, weight) if self.cheap else jnp.einsum(spec, x, weight[...])

  def __call__(self, h_BxD):
    y = jax.nn.gelu(self.project("bd,df->bf", h_BxD, self.w1))
    return h_BxD + self.project("bf,fd->bd", y, self.w2)


class Net(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cheap: bool = False):
    self.stem = sl.param(jax.random.normal(rngs.params(), (IN, D)) * IN**-0.5, (None, "embed"))
    self.layers = Layers(rngs, LAYERS, cheap)
    self.head = sl.param(jax.random.normal(rngs.params(), (D, CLASSES)) * D**-0.5,
                         ("embed", None))

  def __call__(self, x_BxI):
    h = x_BxI @ self.stem  # a Param read as an operand, not only by [...]
    h = slp.scan_layers(self.layers, h)
    return jnp.einsum("bd,dk->bk", h, self.head[...])


def adapted_net(cheap: bool = False) -> nnx.Module:
  rngs = nnx.Rngs(0)
  return slp.add_lora(Net(rngs, cheap), RANK, ALPHA, TARGETS, rngs=rngs)


def loss_fn(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def make_batch() -> dict:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, IN)).astype(np.float32)
  label = (x @ rng.normal(size=(IN, CLASSES))).argmax(-1).astype(np.int32)
  return {"x": x, "label": label}


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


@functools.cache
def trained(mesh_text: str, strategy: str, cheap: bool = False):
  """(abstract, init, final state (sharded), per-step metrics): STEPS AdamW steps on one
  batch, so a model that trains must lower its loss. `cheap`: the layers project with
  slp.lora_einsum."""
  devices = jax.devices()[:1] if mesh_text == "data:1" else None
  abstract = sl.abstract_state(lambda: adapted_net(cheap), optax.adamw(1e-2), "fp32",
                               frozen=slp.lora_frozen)
  shardings = sl.shardings(abstract, sl.strategy(strategy), sl.mesh(mesh_text, devices))
  state = sl.init(abstract, shardings)
  init = to_numpy(state)
  step = sl.train_step(loss_fn, abstract, shardings)
  batch = jax.device_put(make_batch(), shardings.batch)
  history = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  return abstract, init, state, history


def at(tree, path):
  """The node at `path` in a params dict or, by attribute, in a module."""
  for key in path:
    tree = tree[key] if isinstance(tree, dict) else getattr(tree, key)
  return tree


mixer = H.mixer()
MIXER_TARGETS = ("stem", r"blocks/\d+/(tok|ch)[12]")


def plain_mixer():
  # Its LayerNorms take names by nnx.with_partitioning, which Flax would apply eagerly as
  # mesh axes outside shardlab (built by sl.abstract_state, it needs no such guard).
  with nnx.use_eager_sharding(False):
    return mixer.Mixer(nnx.Rngs(0))


def params_of(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_adapted_model_computes_the_base_at_init():
  """Built and run in one jit (eager ops would compile one by one)."""

  @jax.jit
  def outputs(x, patches):
    base, adapted = Net(nnx.Rngs(0)), adapted_net()
    plain = plain_mixer()
    with_lora = slp.add_lora(plain, RANK, ALPHA, MIXER_TARGETS)
    assert isinstance(with_lora.blocks[1].ch2, slp.LoraWeight)
    assert not isinstance(plain.blocks[1].ch2, slp.LoraWeight)  # the input is not modified
    return ((base(x), adapted(x)), (plain(patches), with_lora(patches)),
            params_of(base), params_of(adapted))

  net, mixed, base, adapted = outputs(make_batch()["x"], mixer.make_batch(0, 4)["patches"])
  np.testing.assert_array_equal(*net)
  np.testing.assert_array_equal(*mixed)
  # The base params are the ones built without adapters: their stream is left alone.
  for path in ADAPTED:
    np.testing.assert_array_equal(at(adapted, path)["base"], at(base, path))
    assert np.abs(at(adapted, path)["lora_a"]).max() > 0
    assert not np.any(at(adapted, path)["lora_b"])


def test_merged_weight_is_base_plus_scaled_product():
  """A stacked weight with two input dims: W + (alpha/rank)·A·B over (in dims) × (out dims),
  stacked dims kept, in fp32."""
  rngs = nnx.Rngs(1)
  holder = nnx.Dict(w=slp.stacked_param(rngs, (3, 4, 5), ("embed", "heads", None), 12,
                                        jnp.float32, (2,)))
  adapted = slp.add_lora(holder, 2, 3.0, "w", in_dims=2)
  weight = adapted["w"]
  assert weight.lora_a.shape == (2, 3, 4, 2) and weight.lora_b.shape == (2, 2, 5)
  weight.lora_b[...] = jax.random.normal(jax.random.key(2), (2, 2, 5))
  a, b, w = (np.asarray(v[...], np.float64) for v in (weight.lora_a, weight.lora_b, weight.base))
  want = w + 1.5 * (a.reshape(2, 12, 2) @ b).reshape(w.shape)
  fp32 = dict(rtol=1e-6, atol=1e-6 * np.abs(want).max())  # fp32 rounding of W + update
  np.testing.assert_allclose(weight[...], want, **fp32)
  np.testing.assert_allclose(jnp.asarray(weight), want, **fp32)
  assert weight.shape == w.shape and weight.ndim == 4 and weight.dtype == jnp.float32


def _weight_sized_dots(jaxpr, shape) -> int:
  """How many matmuls in `jaxpr` (nested ones included) produce an array of `shape`."""
  found = 0
  for eqn in jaxpr.eqns:
    found += eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape == shape
    found += sum(_weight_sized_dots(sub, shape)
                 for sub in jax.extend.core.jaxprs_in_params(eqn.params))
  return found


def test_lora_einsum_matches_the_merged_read_without_forming_the_weight():
  """x·W + scale·(x·A)·B: the values and the adapters' gradients of reading the merged
  weight, but no weight-sized matmul forward or backward (shapes all distinct here)."""
  holder = nnx.Dict(w=sl.param(jax.random.normal(jax.random.key(0), (6, 7)), ("embed", "mlp")))
  weight = slp.add_lora(holder, 2, 4.0, "w")["w"]
  weight.lora_b[...] = jax.random.normal(jax.random.key(1), (2, 7))
  x = jax.random.normal(jax.random.key(2), (5, 6))
  ab = (weight.lora_a[...], weight.lora_b[...])

  graphdef, base = nnx.split(weight)[0], weight.base[...]

  def loss(read, ab):
    w = nnx.merge(graphdef, {"base": base, "lora_a": ab[0], "lora_b": ab[1]})
    return jnp.sum(jnp.sin(read(x, w)))

  cheap = lambda ab: loss(lambda x, w: slp.lora_einsum("bd,df->bf", x, w), ab)
  merged = lambda ab: loss(lambda x, w: jnp.einsum("bd,df->bf", x, w[...]), ab)
  H.assert_trees_close(jax.value_and_grad(cheap)(ab), jax.value_and_grad(merged)(ab),
                       rtol=1e-5, scaled_atol=1e-6, what="lora_einsum vs merged read")
  dots = lambda fn: _weight_sized_dots(jax.make_jaxpr(jax.grad(fn))(ab).jaxpr, (6, 7))
  assert dots(merged) > 0  # the check sees them
  assert dots(cheap) == 0
  plain = jax.random.normal(jax.random.key(3), (6, 7))  # on a plain weight: a plain einsum
  np.testing.assert_allclose(slp.lora_einsum("bd,df->bf", x, plain), x @ plain, rtol=1e-6)


def test_only_the_adapters_train():
  abstract, init, final, history = trained(*ONE)
  final = to_numpy(final)
  mu = final.opt_state[0].mu
  moments = {H.dict_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0]}
  assert moments == {p + (ab,) for p in ADAPTED for ab in ("lora_a", "lora_b")}
  # The frozen base and head are bit-identical; every adapter moved.
  H.assert_trees_equal(final.params["head"], init.params["head"], "head")
  for path in ADAPTED:
    got, start = at(final.params, path), at(init.params, path)
    H.assert_trees_equal(got["base"], start["base"], "/".join(path))
    assert np.abs(got["lora_b"]).max() > 0, path  # zero unless gradients reach B
    assert not np.array_equal(got["lora_a"], start["lora_a"]), path
  assert history[-1]["loss"] < history[0]["loss"]
  # Under bf16 the frozen base is stored in the compute dtype, the adapters as fp32 masters.
  bf16 = sl.abstract_state(adapted_net, optax.adamw(1e-2), "bf16", frozen=slp.lora_frozen)
  assert bf16.state.params["stem"]["base"].dtype == jnp.bfloat16
  assert bf16.state.params["stem"]["lora_a"].dtype == jnp.float32


@pytest.mark.parametrize("cheap", [False, True], ids=["weight-read", "lora_einsum"])
def test_fsdp_tp_matches_one_device(cheap):
  """Also: the layers projecting with lora_einsum under fsdp_tp train as the one-device
  model reading the adapted weights does."""
  _, _, want, want_history = trained(*ONE)
  _, _, got, history = trained(*SHARDED, cheap)
  assert want_history[-1]["loss"] < want_history[0]["loss"]  # it learns: no tautology
  for step, (g, w) in enumerate(zip(history, want_history)):
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(g[key], w[key], rtol=1e-5, err_msg=f"step {step} {key}")
  H.assert_trees_close(to_numpy(got.params), to_numpy(want.params), **FP32_ADAM,
                       what="params after 3 steps")


def test_adapters_shard_like_their_weight():
  _, _, state, _ = trained(*SHARDED)
  spec = lambda leaf: H.normalized(leaf.sharding.spec, leaf.ndim)
  w1 = state.params["layers"]["w1"]  # (layers, embed, mlp)
  assert spec(w1["base"]) == (None, "fsdp", "tensor")
  assert spec(w1["lora_a"]) == (None, "fsdp", None)  # (layers, embed, lora_rank)
  assert spec(w1["lora_b"]) == (None, None, "tensor")  # (layers, lora_rank, mlp)
  w2 = state.params["layers"]["w2"]
  assert spec(w2["lora_a"]) == (None, "tensor", None)
  assert spec(w2["lora_b"]) == (None, None, "fsdp")
  assert spec(state.opt_state[0].mu["layers"]["w1"]["lora_a"]) == (None, "fsdp", None)


def test_merge_gives_the_base_tree_computing_the_same():
  abstract, _, state, _ = trained(*ONE)
  adapted = sl.model(abstract, to_numpy(state.params))
  merged = slp.merge_lora(adapted)
  shapes = lambda m: jax.tree.map(jnp.shape, params_of(m))
  assert shapes(merged) == shapes(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
  assert isinstance(adapted.stem, slp.LoraWeight)  # merging copies: the input keeps adapters
  x = jnp.asarray(make_batch()["x"])
  want = np.asarray(adapted(x))
  np.testing.assert_allclose(merged(x), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # The trained update is in the merged weight: it is no longer the base.
  assert not np.allclose(merged.stem[...], adapted.stem.base[...])


def test_bad_requests_are_refused_clearly():
  net = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))  # refused before any value is read
  with pytest.raises(ConfigError, match=r"'w3' matches no param path.*layers/w1"):
    slp.add_lora(net, RANK, ALPHA, ["stem", "w3"])
  with pytest.raises(ConfigError, match="rank must be an integer >= 1, got 0"):
    slp.add_lora(net, 0, ALPHA, TARGETS)
  with pytest.raises(ConfigError, match=r"stem of shape \(12, 16\).*in_dims 2"):
    slp.add_lora(net, RANK, ALPHA, "stem", in_dims=2)
  with pytest.raises(ConfigError, match=r"blocks/0/norm1/scale of shape \(64,\)"):
    slp.add_lora(nnx.eval_shape(plain_mixer), RANK, ALPHA, r"blocks/0/.*")
  with pytest.raises(ConfigError, match="no LoRA adapters"):
    slp.merge_lora(net)
