"""LoRA on every registered architecture (tests/test_protocol.py's small model file of each),
on every target it offers, on one device: the abstract state holds exactly n_lora_params
adapter params, one adapter per target beside the weight lora_weights names; at init the
base params and the logits are the plain model's (B starts at zero); two steps on one batch
move only the adapters (the base stays bit-identical) and lower the loss; the trained
adapters merged into their weights (what `convert to-hf --merge-lora` does) give the adapted
logits in the plain model. And a GPT-2 LoRA checkpoint exports merged to a directory
transformers' GPT2LMHeadModel loads with the adapted model's logits.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import helpers as H
from shardlab import config
from shardlab.errors import ConfigError
from shardlab.parallel import lora
from shardlab.sharding.activations import activation_rules
from shardlab.training import checkpoint
from shardlab.training import run as run_lib
from shardlab.training import state as state_lib
from test_protocol import ARCHS, small

# Architectures that offer no LoRA target (lora.rank > 0 refused, naming none as valid). The
# Mixtral-style "moe" builds llama's attention without adapters (models/moe.py's MoEBlock).
WITHOUT_LORA = {"moe"}
LORA_ARCHS = [a for a in ARCHS if a not in WITHOUT_LORA]
TRAIN = dict(global_batch=4, seq_len=16, warmup_steps=0)  # lr 1e-2 from the first step
FP32 = dict(rtol=1e-5, scaled_atol=1e-5)


@pytest.fixture(autouse=True, scope="module")
def cheap_compiles():
  """XLA:CPU at its lowest optimisation level: a fifth of the compile time (which is all of
  this file's), and every check here compares programs compiled alike."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def lora_of(model) -> config.LoraConfig:
  return config.LoraConfig(rank=2, alpha=4.0, targets=",".join(model.lora_targets))


@functools.cache
def runs(arch: str) -> tuple[H.Run, H.Run]:
  """(plain, adapted) one-device runs of the architecture's small model."""
  plain = H.make_config(model=small(arch), **TRAIN)
  return H.Run(plain, 1), H.Run(dataclasses.replace(plain, lora=lora_of(plain.model)), 1)


@functools.cache
def _forward(r: H.Run):
  def logits(params, tokens):
    with activation_rules(r.mesh, r.rules):
      return state_lib.model(r.abstract, params)(tokens)
  return jax.jit(logits)


def logits(r: H.Run, params, tokens) -> np.ndarray:
  """The run's model's logits (compiled once a run: the inputs are placed alike)."""
  params = jax.device_put(params, r.sh.state.params)
  return np.asarray(_forward(r)(params, jax.device_put(tokens, r.sh.batch)))


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


def is_adapter(keypath) -> bool:
  return any(k.startswith(lora.PREFIX) for k in state_lib.path_of(keypath))


def without_adapters(tree):
  return {k: without_adapters(v) if isinstance(v, dict) else v for k, v in tree.items()
          if not k.startswith(lora.PREFIX)}


def adapters(tree, path=()) -> dict:
  """{(path to the module, target): the dict holding the adapter and its weight}."""
  out = {}
  for k, v in tree.items():
    if k.startswith(lora.PREFIX):
      out[path, k[len(lora.PREFIX):]] = tree
    elif isinstance(v, dict):
      out.update(adapters(v, path + (k,)))
  return out


@functools.cache
def trained(arch: str):
  """(initial params, params after two steps on one batch, the two losses) with LoRA."""
  r = runs(arch)[1]
  state, batch, losses = r.fresh_state(), r.batch(0), []
  for _ in range(2):
    state, metrics = r.compiled_step(state, batch)
    losses.append(float(metrics["loss"]))
  return to_numpy(r.init.params), to_numpy(state.params), losses


def test_every_architecture_but_the_listed_offers_lora_targets():
  offered = {a: small(a).lora_targets for a in ARCHS}
  assert {a for a, t in offered.items() if not t} == WITHOUT_LORA, offered
  for arch in WITHOUT_LORA:
    cfg = dataclasses.replace(H.make_config(model=small(arch)),
                              lora=config.LoraConfig(rank=2, targets="q"))
    with pytest.raises(ConfigError, match=r"valid: none \(no LoRA\)"):
      run_lib.abstract_state(cfg)


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_adapters_are_n_lora_params_one_per_offered_target(arch):
  plain, adapted = runs(arch)
  model, lora_cfg = adapted.cfg.model, adapted.cfg.lora
  assert set(model.lora_weights) == set(model.lora_targets)
  leaves = jax.tree_util.tree_flatten_with_path(adapted.abstract.state.params)[0]
  n_adapter = sum(a.size for p, a in leaves if is_adapter(p))
  assert n_adapter == model.n_lora_params(lora_cfg) > 0
  assert sum(a.size for p, a in leaves if not is_adapter(p)) == model.n_params
  # Each offered target once, beside the weight --merge-lora merges it into, of that shape.
  found = adapters(jax.tree.map(lambda a: a.shape, adapted.abstract.state.params))
  assert sorted(t for _, t in found) == sorted(model.lora_targets), found.keys()
  for (_, target), module in found.items():  # A (layers, *in, R), B (layers, R, *out)
    a, b = module[lora.PREFIX + target]["a"], module[lora.PREFIX + target]["b"]
    assert a[:-1] + b[2:] == module[model.lora_weights[target]], (target, a, b)
    assert a[0] == b[0] and a[-1] == b[1] == lora_cfg.rank
  assert without_adapters(adapted.abstract.state.params) == plain.abstract.state.params
  # A different subset of the targets is counted as exactly.
  some = dataclasses.replace(lora_cfg, rank=3, targets=",".join(model.lora_targets[::2]))
  subset = run_lib.abstract_state(dataclasses.replace(adapted.cfg, lora=some))
  assert sum(a.size for p, a in jax.tree_util.tree_flatten_with_path(
      subset.state.params)[0] if is_adapter(p)) == model.n_lora_params(some) > 0


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_at_init_the_adapted_model_is_the_plain_one(arch):
  plain, adapted = runs(arch)
  initial = trained(arch)[0]
  H.assert_trees_equal(without_adapters(initial), to_numpy(plain.init.params), "base")
  for module in adapters(initial).values():
    for key, value in module.items():
      if key.startswith(lora.PREFIX):
        assert not value["b"].any() and value["a"].std() > 0, key
  tokens = H.tokens(plain.cfg)[:, :-1]
  np.testing.assert_array_equal(logits(adapted, adapted.init.params, tokens),
                                logits(plain, plain.init.params, tokens))


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_steps_move_only_the_adapters_and_lower_the_loss(arch):
  initial, final, losses = trained(arch)
  assert losses[1] < losses[0], losses
  H.assert_trees_equal(without_adapters(final), without_adapters(initial), "base")
  moved = jax.tree_util.tree_map_with_path(
      lambda p, a, b: None if not is_adapter(p) else bool((a != b).any()), final, initial)
  assert set(jax.tree.leaves(moved)) == {True}


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_merged_adapters_give_the_adapted_logits_in_the_plain_model(arch):
  plain, adapted = runs(arch)
  final = trained(arch)[1]
  tokens = H.tokens(plain.cfg, seed=1)[:, :-1]
  want = logits(adapted, final, tokens)
  merged = lora.merge_params(final, adapted.cfg.model.lora_weights, adapted.cfg.lora.scale)
  got = logits(plain, merged, tokens)
  # The trained adapters move the logits by far more than the merge's tolerance (seen: 1.2).
  assert np.abs(want - logits(plain, without_adapters(final), tokens)).max() > 1e-2
  H.assert_trees_close(got, want, what=f"{arch} merged logits", **FP32)


def test_gpt2_lora_checkpoint_exports_merged_to_transformers(tmp_path, capsys):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from shardlab import cli
  plain, adapted = runs("gpt2")
  final = trained("gpt2")[1]
  ckpt = checkpoint.Checkpointer(config.CheckpointConfig(dir=str(tmp_path / "ckpt"),
                                                         async_save=False))
  state = adapted.fresh_state().replace(params=jax.device_put(final, adapted.sh.state.params))
  try:
    ckpt.save(state, config.to_dict(adapted.cfg), force=True)
    ckpt.wait()
  finally:
    ckpt.close()
  out = tmp_path / "hf"
  assert cli.main(["convert", "to-hf", str(tmp_path / "ckpt"), str(out)]) == 2
  assert "pass --merge-lora" in capsys.readouterr().err
  assert cli.main(["convert", "to-hf", str(tmp_path / "ckpt"), str(out), "--merge-lora"]) == 0
  tokens = H.tokens(adapted.cfg, seed=2)[:, :-1]
  want = logits(adapted, final, tokens)
  assert np.abs(want - logits(plain, without_adapters(final), tokens)).max() > 1e-2
  model = transformers.GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.float().numpy()
  np.testing.assert_allclose(theirs, want, rtol=0, atol=1e-4)
