"""`sl.plan_module` on modules shardlab does not know (examples/mixer.py's Mixer and a small
transformer defined here), checked against the real train step compiled on the 8 simulated
CPU devices: the state bytes exactly, the total within 15%, activations that follow the
batch and the module's remat, and no compile needed."""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import helpers as H
import shardlab as sl

ROOT = Path(__file__).resolve().parents[1]
MESH = "data:2,fsdp:2,tensor:2"


mixer = H.mixer()
VOCAB, SEQ = 128, 32


class Block(nnx.Module):
  """Pre-norm attention and GELU MLP, logical names on every weight and key activation."""

  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    init, hd = nnx.initializers.lecun_normal(), d // heads
    norm = lambda: nnx.RMSNorm(d, rngs=rngs, scale_init=nnx.with_partitioning(
        nnx.initializers.ones, ("embed",)))
    qkv = lambda: sl.param(init(rngs.params(), (d, heads, hd)), ("embed", "heads", "head_dim"))
    self.norm1, self.norm2 = norm(), norm()
    self.wq, self.wk, self.wv = qkv(), qkv(), qkv()
    self.wo = sl.param(init(rngs.params(), (heads, hd, d)), ("heads", "head_dim", "embed"))
    self.w1 = sl.param(init(rngs.params(), (d, 4 * d)), ("embed", "mlp"))
    self.w2 = sl.param(init(rngs.params(), (4 * d, d)), ("mlp", "embed"))

  def __call__(self, x_BxLxD):
    y = self.norm1(x_BxLxD)
    names = ("batch", "length", "heads", None)
    q, k, v = (sl.constrain(jnp.einsum("bld,dhe->blhe", y, w[...]), names)
               for w in (self.wq, self.wk, self.wv))
    scores = jnp.einsum("blhe,bmhe->bhlm", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x_BxLxD + jnp.einsum("blhe,hed->bld", jnp.einsum("bhlm,bmhe->blhe", probs, v),
                             self.wo[...])
    h = sl.constrain(jax.nn.gelu(self.norm2(x) @ self.w1[...]), ("batch", "length", "mlp"))
    return x + h @ self.w2[...]


class Transformer(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, d: int = 64, heads: int = 4, layers: int = 2,
               remat: bool = False):
    init = nnx.initializers.lecun_normal()
    self.embed = sl.param(init(rngs.params(), (VOCAB, d)), ("vocab", "embed"))
    self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(d, rngs=rngs, scale_init=nnx.with_partitioning(
        nnx.initializers.ones, ("embed",)))
    self.head = sl.param(init(rngs.params(), (d, VOCAB)), ("embed", "vocab"))
    self.remat = remat

  def __call__(self, tokens_BxL):
    onehot = jax.nn.one_hot(tokens_BxL, VOCAB, dtype=self.embed.dtype)
    x = sl.constrain(onehot @ self.embed[...], ("batch", "length", "embed"))
    for block in self.blocks:
      x = nnx.remat(lambda b, x: b(x))(block, x) if self.remat else block(x)
    return sl.constrain(self.norm(x) @ self.head[...], ("batch", "length", "vocab"))


class ScannedStack(nnx.Module):
  """Residual MLP layers stacked on a `layers` dim and run by lax.scan, remat or not."""

  def __init__(self, rngs: nnx.Rngs, remat: bool, layers: int = 4, d: int = 64):
    init = nnx.initializers.lecun_normal()
    self.w1 = sl.param(init(rngs.params(), (layers, d, 4 * d)), ("layers", "embed", "mlp"))
    self.w2 = sl.param(init(rngs.params(), (layers, 4 * d, d)), ("layers", "mlp", "embed"))
    self.remat = remat

  def __call__(self, x_BxLxD):
    def layer(x, w):
      h = sl.constrain(jax.nn.gelu(x @ w[0]), ("batch", None, "mlp"))
      return x + h @ w[1], None

    x, _ = jax.lax.scan(jax.checkpoint(layer) if self.remat else layer, x_BxLxD,
                        (self.w1[...], self.w2[...]))
    return x


def lm_loss(model, batch):
  logits = model(batch["tokens"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def case(name: str, size: int):
  """(model factory, loss, batch shapes) for 'mixer', 'transformer', 'transformer-remat'."""
  if name == "mixer":
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          mixer.make_batch(0, size))
    return lambda: mixer.Mixer(nnx.Rngs(0)), mixer.loss_fn, shapes
  tokens = jax.ShapeDtypeStruct((size, SEQ), jnp.int32)
  return (lambda: Transformer(nnx.Rngs(0), remat=name.endswith("remat")), lm_loss,
          {"tokens": tokens, "targets": tokens})


@functools.cache
def planned(name: str, strategy: str, size: int, compiled: bool = False, microbatches=1):
  factory, loss, batch = case(name, size)
  return sl.plan_module(factory, optax.adamw(1e-3), "fp32", strategy, sl.mesh(MESH),
                        batch=batch, loss_fn=loss, microbatches=microbatches,
                        compiled=compiled)


SIZES = {"mixer": (64, 128), "transformer": (16, 32), "transformer-remat": (16, 32)}
CASES = [(name, strategy, size) for name in ("mixer", "transformer")
         for strategy in ("fsdp", "fsdp_tp") for size in SIZES[name]]
# Two of the four remat cases, for time (all four measured 0.78-0.79: docs/plan-any-module.md).
CASES += [("transformer-remat", "fsdp", 32), ("transformer-remat", "fsdp_tp", 16)]
# Measured estimate / compiled total beyond 15%, with the reason; the ratio must stay in the
# band. Under remat of unrolled blocks XLA:CPU hoists every block's recomputation ahead of the
# backward (the compiled temp bytes are those of the step without remat, within 5%), while
# the estimate rebuilds one block at a time where the backward reads it: 0.78-0.79.
KNOWN = {"transformer-remat": (0.70, 0.85)}


@pytest.mark.parametrize("name, strategy, size", CASES,
                         ids=[f"{n}-{s}-{b}" for n, s, b in CASES])
def test_estimate_matches_the_compiled_step(name, strategy, size):
  plan = planned(name, strategy, size, compiled=True)
  xla = plan.compiled
  # Params, optimizer state, the batch and the step counter: the step's arguments, exactly.
  assert plan.arguments == xla.argument_bytes
  low, high = KNOWN.get(name, (0.85, 1.15))
  assert low <= plan.total / xla.total_bytes <= high, (plan.total, xla.total_bytes)
  if name in KNOWN:  # the reason: XLA:CPU's remat step holds what the plain step holds
    plain = planned("transformer", strategy, size, compiled=True).compiled
    assert xla.temp_bytes == pytest.approx(plain.temp_bytes, rel=0.05)
  assert "ratio" in plan.render() and "GiB" in plan.render()


@pytest.mark.parametrize("remat", [False, True])
def test_a_layer_scan_with_and_without_remat(remat):
  """Inside a layer scan XLA:CPU rebuilds one layer at a time, as the plan does."""
  shape = jax.ShapeDtypeStruct((64, 32, 64), jnp.float32)
  plan = sl.plan_module(lambda: ScannedStack(nnx.Rngs(0), remat), optax.adamw(1e-3), "fp32",
                        "fsdp_tp", sl.mesh(MESH), batch={"x": shape, "y": shape},
                        loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                        compiled=True)
  assert plan.arguments == plan.compiled.argument_bytes
  assert 0.85 <= plan.total / plan.compiled.total_bytes <= 1.15
  # Remat saves each layer's input (4 x 16x32x64 fp32 here) and the loss's residual only.
  assert (plan.activations == 5 * 16 * 32 * 64 * 4) == remat


def test_state_bytes_are_exact_under_bf16():
  """bf16: fp32 master weights and optimizer state, bf16 working copy. (Only the arguments
  are compared: XLA:CPU holds bf16 activations in fp32 buffers, a TPU does not.)"""
  factory, loss, batch = case("transformer", 16)
  plan = sl.plan_module(factory, optax.adamw(1e-3), "bf16", "fsdp_tp", sl.mesh(MESH),
                        batch=batch, loss_fn=loss, compiled=True)
  assert plan.arguments == plan.compiled.argument_bytes
  assert plan.master == 2 * plan.params  # fp32 stored beside the bf16 copy forward reads


@pytest.mark.parametrize("name", list(SIZES))
def test_activations_follow_the_batch(name):
  small, large = (planned(name, "fsdp_tp", size) for size in SIZES[name])
  assert large.activations / small.activations == pytest.approx(2, rel=0.05)
  assert large.params == small.params and large.opt_state == small.opt_state
  # Two microbatches of the large batch hold what the small batch holds at once.
  split = planned(name, "fsdp_tp", SIZES[name][1], microbatches=2)
  assert split.activations == small.activations


def test_activations_follow_the_modules_remat_and_the_rules():
  plain = planned("transformer", "fsdp", 32)
  remat = planned("transformer-remat", "fsdp", 32)
  # Remat keeps each block's input only: 2 blocks of 32x32x64 fp32 inputs over 4 batch shards
  # plus the loss's residuals, instead of every block's internals.
  assert remat.activations < plain.activations / 4
  # ... and rebuilds a block in the backward, which the temporaries count.
  assert remat.temporaries > plain.temporaries
  # The tensor axis splits the attention heads and MLP hidden of the saved activations.
  assert planned("transformer", "fsdp_tp", 32).activations < 0.8 * plain.activations


def test_plans_without_compiling(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("plan_module compiled")

  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
  factory, loss, batch = case("mixer", 64)
  plan = sl.plan_module(factory, optax.adamw(1e-3), "fp32", sl.strategy("fsdp_tp"),
                        sl.mesh(MESH), batch=batch, loss_fn=loss)
  assert plan.activations > 0 and plan.total > plan.arguments
  with pytest.raises(AssertionError, match="compiled"):  # the patch does catch a compile
    sl.plan_module(factory, optax.adamw(1e-3), "fp32", "fsdp_tp", sl.mesh(MESH),
                   batch=batch, loss_fn=loss, compiled=True)


def test_frozen_offload_and_an_abstract_state():
  factory, loss, batch = case("mixer", 64)
  mesh = sl.mesh(MESH)
  full = planned("mixer", "fsdp", 64)
  head_only = sl.plan_module(factory, optax.adamw(1e-3), "fp32", "fsdp", mesh, batch=batch,
                             loss_fn=loss, frozen=lambda path: path[0] != "head")
  assert head_only.grads < full.grads / 50 and head_only.opt_state < full.opt_state / 50
  offloaded = sl.plan_module(factory, optax.adamw(1e-3), "fp32", "fsdp", mesh, batch=batch,
                             loss_fn=loss, offload="opt_state")
  assert offloaded.opt_state == 0 and offloaded.host == full.stored + full.opt_state
  abstract = sl.abstract_state(factory, optax.adamw(1e-3), "fp32")
  assert sl.plan_module(abstract, strategy="fsdp", mesh=mesh, batch=batch,
                        loss_fn=loss).total == full.total


def test_refuses_what_it_cannot_plan():
  factory, loss, batch = case("mixer", 10)
  with pytest.raises(sl.ConfigError, match=r"leading dim \(10\) is not divisible.*4 shards"):
    sl.plan_module(factory, optax.adamw(1e-3), "fp32", "fsdp", sl.mesh(MESH), batch=batch,
                   loss_fn=loss)
  with pytest.raises(sl.ConfigError, match="optimizer is required"):
    sl.plan_module(factory, mesh=sl.mesh(MESH), batch=batch, loss_fn=loss)
  with pytest.raises(sl.ConfigError, match="tree of jax.ShapeDtypeStruct"):
    sl.plan_module(factory, optax.adamw(1e-3), mesh=sl.mesh(MESH), batch={"x": 3},
                   loss_fn=loss)


def test_the_doc_runs_as_written(capsys):
  text = (ROOT / "docs" / "plan-any-module.md").read_text()
  namespace: dict = {"__name__": "docs_plan_any_module"}
  for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
    exec(compile(block, f"docs/plan-any-module.md (snippet {i + 1})", "exec"), namespace)
  out = capsys.readouterr().out
  assert "activations (saved)" in out and "split [dataxfsdp,-,tensor]" in out
  # Measured 0.85: XLA:CPU adds a transposed copy for the weight-gradient matmul (the doc).
  assert 0.8 <= float(out.split("estimate / XLA: ")[1].split()[0]) <= 1.15
