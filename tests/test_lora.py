"""LoRA fine-tuning: the adapters change nothing at step 0, only they train (the base stays
bit-identical and has no gradient or optimizer state), every strategy computes what one
device does, and a LoRA checkpoint exports merged (transformers loads it), imports its base
from Hugging Face and generates with its adapters.
"""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

import helpers as H
from shardlab import cli, config
from shardlab.cli import generate as generate_cli
from shardlab.errors import ConfigError
from shardlab.parallel import lora
from shardlab.models.gpt2_config import GPT2Config
from shardlab.sharding.activations import activation_rules
from shardlab.data import corpus as data
from shardlab.training import run as run_lib
from shardlab.training import state as state_lib

STEPS = 3
LORA = config.LoraConfig(rank=4, alpha=8.0)  # every target, scale 2
FP32 = dict(rtol=1e-5, scaled_atol=1e-5)
FP32_ADAM = dict(rtol=1e-5, scaled_atol=3e-5)  # see tests/test_parity.py


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


def lora_config(strategy: str = H.REFERENCE[0], mesh: str = H.REFERENCE[1], lora_cfg=LORA,
                **train) -> config.Config:
  return dataclasses.replace(H.make_config(strategy, mesh, **train), lora=lora_cfg)


@functools.cache
def lora_run(strategy: str = H.REFERENCE[0], mesh: str = H.REFERENCE[1]) -> H.Run:
  return H.Run(lora_config(strategy, mesh), 1 if mesh == "data:1" else None)


@functools.cache
def initial():
  return to_numpy(lora_run().init)


@functools.cache
def trained(strategy: str = H.REFERENCE[0], mesh: str = H.REFERENCE[1]):
  """(state, per-step metrics) after STEPS steps from the one-device init."""
  r = lora_run(strategy, mesh)
  final, history = r.train(r.fresh_state(like=initial()), STEPS)
  return to_numpy(final), history


def is_adapter(keypath) -> bool:
  return any(k.startswith(lora.PREFIX) for k in state_lib.path_of(keypath))


def _without_adapters(tree):
  return {k: _without_adapters(v) if isinstance(v, dict) else v for k, v in tree.items()
          if not k.startswith(lora.PREFIX)}


def forward(r: H.Run, params, tokens):
  def logits(p, t):
    with activation_rules(r.mesh, r.rules):
      return state_lib.model(r.abstract, p)(t)
  return np.asarray(jax.jit(logits)(params, tokens))


def test_base_init_and_step_0_logits_are_the_base_models():
  base, adapted = H.reference(), lora_run()
  H.assert_trees_equal(_without_adapters(initial().params), to_numpy(base.init.params),
                       "base params with LoRA")
  tokens = H.tokens(base.cfg)[:4, :-1]
  np.testing.assert_array_equal(forward(adapted, adapted.init.params, tokens),
                                forward(base, base.init.params, tokens))
  # B starts at zero, A does not (else no gradient would ever reach either).
  for layer in ("attn", "mlp"):
    for adapter in initial().params["blocks"][layer].values():
      if isinstance(adapter, dict):
        assert not adapter["b"].any() and adapter["a"].std() > 0


def test_rank_0_builds_the_base_model_unchanged():
  plain = run_lib.abstract_state(H.make_config())
  off = run_lib.abstract_state(lora_config(lora_cfg=config.LoraConfig(rank=0)))
  assert off.frozen is None and off.state == plain.state and off.names == plain.names


def test_only_adapters_train_and_the_base_stays_bit_identical():
  final, history = trained()
  assert history[-1]["lr"] > 0 and history[-1]["loss"] < history[0]["loss"]
  before = initial().params
  changed = jax.tree_util.tree_map_with_path(
      lambda p, a, b: (is_adapter(p), bool((a != b).any())), final.params, before)
  for path, (adapter, moved) in jax.tree_util.tree_flatten_with_path(
      changed, is_leaf=lambda x: isinstance(x, tuple))[0]:
    assert moved == adapter, f"{jax.tree_util.keystr(path)}: adapter {adapter}, moved {moved}"
  H.assert_trees_equal(_without_adapters(final.params), _without_adapters(before), "base")


def test_optimizer_state_and_gradients_exist_for_adapters_only():
  r = lora_run()
  abstract = r.abstract
  cfg = r.cfg
  n_adapter = sum(a.size for p, a in jax.tree_util.tree_flatten_with_path(
      abstract.state.params)[0] if is_adapter(p))
  assert n_adapter == cfg.model.n_lora_params(cfg.lora) > 0
  opt = jax.tree.leaves(abstract.state.opt_state)
  big = [a for a in opt if a.size > 1]
  # AdamW: mu and nu, fp32, per adapter param; the rest are step counts.
  assert sum(a.size * a.dtype.itemsize for a in big) == 2 * 4 * n_adapter
  assert sum(a.size for a in opt if a.size == 1) <= 4
  assert set(jax.tree.leaves(abstract.trainable(abstract.frozen))) == {False}
  # What the compiled step takes (donated and returned): the params, the adapters' moments
  # and the batch, no base-sized moment (the base alone is 20x the adapters here).
  params_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract.state.params))
  batch_bytes = cfg.train.global_batch * (cfg.train.seq_len + 1) * 4
  memory = r.compiled_step.memory_analysis()
  assert params_bytes > 20 * 4 * n_adapter
  assert memory.argument_size_in_bytes <= params_bytes + 2 * 4 * n_adapter + batch_bytes + 64


def test_bf16_policy_stores_the_base_in_bf16_and_the_adapters_in_fp32():
  abstract = run_lib.abstract_state(lora_config(precision="bf16"))
  dtypes = jax.tree_util.tree_map_with_path(lambda p, a: (is_adapter(p), str(a.dtype)),
                                            abstract.state.params)
  assert set(jax.tree.leaves(dtypes, is_leaf=lambda x: isinstance(x, tuple))) == {
      (True, "float32"), (False, "bfloat16")}


def test_adapters_shard_like_the_weights_they_adapt():
  cases = {("tp", H.MESHES["tp"]): ("attn", "lora_q", "b", (None, None, "tensor", None)),
           ("fsdp", H.MESHES["fsdp"]): ("attn", "lora_q", "a", (None, "fsdp", None)),
           ("fsdp_tp", H.MESHES["fsdp_tp"]): ("mlp", "lora_down", "a", (None, "tensor", None))}
  for (strategy, mesh), (layer, adapter, which, want) in cases.items():
    r = H.Run(lora_config(strategy, mesh), None)
    spec = r.sh.state.params["blocks"][layer][adapter][which].spec
    assert H.normalized(spec, len(want)) == want, (strategy, adapter, which, spec)
    assert r.abstract.names["blocks"][layer][adapter][which][-1 if which == "a" else 1] == \
        lora.RANK_AXIS


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_steps_match_one_device(strategy):
  final, history = trained(strategy, H.MESHES[strategy])
  want, want_history = trained()
  for got, expected in zip(history, want_history):
    np.testing.assert_allclose([got["loss"], got["grad_norm"]],
                               [expected["loss"], expected["grad_norm"]], rtol=1e-5)
  H.assert_trees_equal(_without_adapters(final.params), _without_adapters(want.params),
                       f"{strategy} base")
  H.assert_trees_close(final.opt_state, want.opt_state, what=f"{strategy} opt", **FP32_ADAM)
  # Adam's step m/sqrt(v) has the size lr whatever the gradient's: an element whose
  # gradient is a rounding error away from zero may step anywhere within ±lr. B (two steps,
  # scale 2·lr) is compared to 1e-3 of a step (seen: 2e-6, lr 1e-2); A takes its first step
  # at the last one (its gradient is zero while B is), where such an element flips its
  # sign (seen: 1 of 1024), so A's gradient, what the step feeds Adam, is compared below.
  pick = lambda tree: jax.tree_util.tree_map_with_path(
      lambda p, x: x if is_adapter(p) and state_lib.path_of(p)[-1] == "b" else None, tree)
  H.assert_trees_close(pick(final.params), pick(want.params), what=f"{strategy} B",
                       rtol=1e-5, atol=1e-3 * H.TRAIN.lr)


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_grads_with_trained_adapters_match_one_device(strategy):
  """The sharded forward and backward through trained adapters (B no longer zero)."""
  results = []
  for r in (lora_run(), lora_run(strategy, H.MESHES[strategy])):
    params = jax.device_put(trained()[0].params, r.sh.state.params)
    loss, grads = r.value_and_grad(params, r.batch(STEPS))
    results.append((float(loss), to_numpy(grads)))
  (want_loss, want), (loss, grads) = results
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  H.assert_trees_close(grads, want, what=f"{strategy} grads", **FP32)


def test_merge_is_the_adapted_weight():
  rng = np.random.default_rng(0)
  w, a, b = (rng.normal(size=s).astype(np.float32)
             for s in ((2, 6, 3, 5), (2, 6, 4), (2, 4, 3, 5)))
  want = w + 0.5 * np.einsum("ndr,nrhe->ndhe", a, b)
  np.testing.assert_allclose(lora.merged(w, a, b, 0.5), want, rtol=1e-6, atol=1e-6)
  x = rng.normal(size=(1, 7, 6)).astype(np.float32)
  adapter = lora.Adapter("bld,dhe->blhe", (6, 3, 5), ("embed", "heads", "head_dim"), 4, 0.5,
                         np.float32, nnx.Rngs(0))
  adapter.a[...], adapter.b[...] = a[0], b[0]
  np.testing.assert_allclose(lora.project("bld,dhe->blhe", x, w[0], adapter),
                             np.einsum("bld,dhe->blhe", x, want[0]), rtol=1e-5, atol=1e-5)


def test_bad_targets_name_the_valid_ones():
  with pytest.raises(ConfigError, match=r"lora.targets qq not offered .* valid: q, k, v, o, "
                                        r"gate, up, down"):
    run_lib.abstract_state(lora_config(lora_cfg=config.LoraConfig(rank=4, targets="q,qq")))
  gpt2 = dataclasses.replace(H.make_config(), model=GPT2Config(name="g", vocab_size=256,
                                                               d_model=32, n_layers=1,
                                                               n_heads=2, max_seq_len=32),
                             lora=LORA)
  # GPT-2's MLP has no gate (lora.targets' default names it): its own targets are listed.
  with pytest.raises(ConfigError, match=r"lora.targets gate not offered .* valid: q, k, v, o, "
                                        r"up, down$"):
    run_lib.abstract_state(gpt2)


# ---- with Hugging Face: --init-from hf:, convert to-hf --merge-lora, generate -----------

HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
          max_position_embeddings=64)
SMALL = ["--set", "train.seq_len=16", "--set", "train.global_batch=8", "--set",
         "train.log_every=1", "--set", "data.max_bytes=200000", "--set", "train.lr=0.01",
         "--set", "train.warmup_steps=1", "--sample-tokens", "0", "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
  """(HF dir, LoRA checkpoint dir, first-step metrics): a random HF Llama, fine-tuned with
  LoRA from hf:DIR for STEPS steps on the fsdp × tensor mesh."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  root = tmp_path_factory.mktemp("lora")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      **HF, initializer_range=0.25, attn_implementation="eager")).eval()
  model.save_pretrained(root / "hf")
  from shardlab.hf import config as hf_config
  from shardlab.hf import convert as hf_convert
  (root / "model.toml").write_text(hf_config.to_toml(hf_convert.hf_model_config(root / "hf")))
  args = ["--model", str(root / "model.toml"), "--mesh", "fsdp:4,tensor:2", "--init-from",
          f"hf:{root / 'hf'}", "--checkpoint-dir", str(root / "ckpt"), "--metrics-file",
          str(root / "metrics.jsonl"), "--set", "lora.rank=4", "--set", "lora.alpha=8",
          "--quiet"] + SMALL
  assert cli.train_main(args) == 0
  first = json.loads((root / "metrics.jsonl").read_text().splitlines()[0])
  return root / "hf", root / "ckpt", first


def hf_loss(hf_dir, tokens) -> float:
  import torch
  import transformers
  model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
  batch = torch.from_numpy(tokens).long()
  with torch.no_grad():
    logp = torch.log_softmax(model(batch[:, :-1]).logits, dim=-1)
    return -logp.gather(-1, batch[:, 1:, None]).mean().item()


def test_init_from_hf_loads_the_base_and_keeps_the_adapters_at_init(lora_checkpoint):
  hf_dir, _, first = lora_checkpoint
  corpus = data.load(config.DataConfig(max_bytes=200000), 16)
  tokens = data.rows(corpus.train, 0, 0, 8, 16, (0, 8))
  # B is zero at the first step, so the loss is the HF base model's.
  assert first["step"] == 1 and first["loss"] == pytest.approx(hf_loss(hf_dir, tokens),
                                                               rel=1e-5)


def test_export_merges_the_adapters_only_when_asked(lora_checkpoint, tmp_path, capsys):
  import torch
  import transformers
  from shardlab import generate
  from shardlab.hf import weights as hf
  _, ckpt, _ = lora_checkpoint
  assert cli.main(["convert", "to-hf", str(ckpt), str(tmp_path / "refused")]) == 2
  assert "pass --merge-lora" in capsys.readouterr().err
  assert cli.main(["convert", "to-hf", str(ckpt), str(tmp_path / "merged"),
                   "--merge-lora"]) == 0

  gen, params, cfg, _ = generate.from_checkpoint(str(ckpt))
  tokens = np.random.default_rng(0).integers(0, 256, size=(4, 16)).astype(np.int32)

  def ours(abstract, p):
    with activation_rules(gen.sh.mesh, gen.sh.rules):
      return np.asarray(jax.jit(lambda p, t: state_lib.model(abstract, p)(t))(p, tokens))

  unmerged = ours(gen.abstract, params)
  without = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 0 if is_adapter(p) and state_lib.path_of(p)[-1] == "b" else x, params)
  assert np.abs(unmerged - ours(gen.abstract, without)).max() > 1e-3  # the adapters trained
  # The export read back into the base model (same mesh): the merge costs only rounding
  # (x·(W + s·A·B) against x·W + s·(x·A)·B), 1e-5 of the logits' scale.
  base_cfg = dataclasses.replace(cfg, lora=config.LoraConfig())
  abstract = run_lib.abstract_state(base_cfg)
  sh = run_lib.shardings(base_cfg, abstract, gen.sh.mesh)
  merged = hf.load_params(tmp_path / "merged", cfg.model, abstract, sh)
  H.assert_trees_close(ours(abstract, merged), unmerged, what="merged logits", **FP32)
  # transformers computes the merged model as it computes any import (tests/test_hf.py).
  reloaded = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path / "merged", attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = reloaded(torch.from_numpy(tokens).long()).logits.float().numpy()
  np.testing.assert_allclose(theirs, unmerged, rtol=0, atol=1e-4)


def test_generate_cli_uses_the_adapters(lora_checkpoint, capsys):
  """The CLI's greedy continuation is the one the trained adapters give, which differs from
  the base's alone (B zeroed): a generate that ignored the adapters would print the latter."""
  import shardlab.cli.text as text_io
  from shardlab import generate
  _, ckpt, _ = lora_checkpoint
  args = ["--checkpoint", str(ckpt), "--prompt", "def f", "--max-new-tokens", "16",
          "--temperature", "0", "--quiet"]
  assert generate_cli.generate_main(args) == 0
  printed = capsys.readouterr().out
  gen, params, cfg, _ = generate.from_checkpoint(str(ckpt))
  tokenizer = text_io.tokenizer_of(cfg)
  greedy = generate.Sampling(max_new_tokens=16, temperature=0, vocab=tokenizer.vocab_size)
  base = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 0 if is_adapter(p) and state_lib.path_of(p)[-1] == "b" else x, params)
  (adapted,), _ = text_io.texts(gen, params, tokenizer, ["def f"], greedy)
  (alone,), _ = text_io.texts(gen, base, tokenizer, ["def f"], greedy)
  assert adapted[0] != alone[0], adapted  # the adapters change the continuation
  assert printed == "def f" + adapted[0] + "\n"