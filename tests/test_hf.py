"""Hugging Face Llama interop against transformers itself: import parity on every mesh,
export round trip, import → checkpoint → restore, --init-from hf:, bf16/fp16 shards.

Needs the `hf` extra (torch for CPU and transformers); skipped with the reason otherwise.
"""

import json

import jax
import numpy as np
import pytest

import helpers as H

try:
  import torch
  import transformers
except ImportError as e:  # only a missing extra skips; any other failure is a failure
  pytest.skip(f"needs the hf extra (pip install -e '.[hf]'): {e}", allow_module_level=True)

from shardlab.training import checkpoint
from shardlab import cli
from shardlab import config
from shardlab.data import corpus as data
from shardlab.hf import weights as hf
from shardlab.hf import convert as hf_convert
from shardlab.models import registry

# Llama-2 style (MHA), Llama-3 style (GQA, theta 500000, the larger vocab) and tied
# embeddings. Heads, kv heads and vocab divide a 4-way tensor axis; d_model an 8-way fsdp.
VARIANTS = {
    "mha": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5),
    "gqa": dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0,
                rms_norm_eps=1e-5),
    "tied": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
}
PLACEMENTS = {"1 device": ("dp", "data:1"), "fsdp": ("fsdp", "fsdp:-1"),
              "tp": ("tp", "data:2,tensor:4"), "fsdp_tp": ("fsdp_tp", "fsdp:4,tensor:2")}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(8, 16)).astype(np.int32)


def hf_model(variant: str) -> "transformers.LlamaForCausalLM":
  """A random Llama whose attention is far from uniform (so RoPE and the head grouping
  matter) and whose norm scales are not all ones (so swapping them would show)."""
  torch.manual_seed(sorted(VARIANTS).index(variant))
  cfg = transformers.LlamaConfig(**VARIANTS[variant], max_position_embeddings=64,
                                 initializer_range=0.25, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
  return model


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """{variant: (HF dir, reference logits)} written with save_pretrained."""
  out = {}
  for variant in VARIANTS:
    model = hf_model(variant)
    directory = tmp_path_factory.mktemp(f"hf-{variant}")
    model.save_pretrained(directory)
    out[variant] = (directory, hf_logits(model))
  return out


def placed(directory, placement: str = "1 device", precision: str = "fp32"):
  return H.placed_model(hf_convert.hf_model_config(directory), *PLACEMENTS[placement],
                        precision)


def logits(params, m, r, abstract, sh) -> np.ndarray:
  return H.model_logits(params, m, r, abstract, sh, TOKENS)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_import_logits_match_transformers(saved, variant, placement):
  directory, expected = saved[variant]
  cfg, m, r, abstract, sh = placed(directory, placement)
  params = hf.load_params(directory, cfg.model, abstract, sh)
  for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(sh.state.params)):
    assert p.sharding == s  # born on its target sharding, not moved there afterwards
  actual = logits(params, m, r, abstract, sh)
  assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
  np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_reloads_with_identical_logits(saved, tmp_path, variant):
  directory, expected = saved[variant]
  cfg, m, r, abstract, sh = placed(directory, "fsdp_tp")
  params = hf.load_params(directory, cfg.model, abstract, sh)
  # A small shard limit exercises the multi-file layout with its index.
  files = hf.export_params(params, cfg.model, tmp_path, max_shard_bytes=100_000)
  assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
  reloaded = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


def test_convert_cli_round_trip(saved, tmp_path, capsys):
  """from-hf → a shardlab checkpoint with the imported params → to-hf → transformers."""
  directory, expected = saved["gqa"]
  ckpt = tmp_path / "ckpt"
  assert cli.main(["convert", "from-hf", str(directory), str(ckpt),
                   "--mesh", "fsdp:4,tensor:2", "--strategy", "fsdp_tp"]) == 0
  assert "python train.py --model" in capsys.readouterr().out

  cfg, m, r, abstract, sh = placed(directory, "tp")
  restored, step = checkpoint.restore_params(ckpt, abstract, sh)
  imported = hf.load_params(directory, cfg.model, abstract, sh)
  assert step == 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored),
               jax.tree.map(np.asarray, imported))
  assert registry.load(str(ckpt / "model.toml")).rope_theta == 500000.0

  out = tmp_path / "exported"
  assert cli.main(["convert", "to-hf", str(ckpt), str(out), "--tokenizer-from",
                   str(directory)]) == 0
  assert "generation_config.json" in capsys.readouterr().out
  reloaded = transformers.LlamaForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sharded_input(saved, tmp_path, dtype):
  """bf16/fp16 shards + index (as save_pretrained writes them) import as the fp32 weights
  rounded to that dtype."""
  directory, _ = saved["gqa"]
  model = transformers.LlamaForCausalLM.from_pretrained(directory).to(getattr(torch, dtype))
  model.save_pretrained(tmp_path, max_shard_size="100KB")
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  cfg, m, r, abstract, sh = placed(directory, "fsdp")
  full = jax.tree.map(np.asarray, hf.load_params(directory, cfg.model, abstract, sh))
  half = jax.tree.map(np.asarray, hf.load_params(tmp_path, cfg.model, abstract, sh))
  rounded = jax.tree.map(lambda x: x.astype(jax.numpy.dtype(dtype)).astype(np.float32), full)
  jax.tree.map(np.testing.assert_array_equal, half, rounded)
  # bf16-params keeps them in bf16 on the devices.
  _, _, _, abstract16, sh16 = placed(directory, "fsdp", precision="bf16-params")
  params16 = hf.load_params(tmp_path, cfg.model, abstract16, sh16)
  assert {p.dtype for p in jax.tree.leaves(params16)} == {jax.numpy.dtype("bfloat16")}


def test_train_init_from_hf(saved, tmp_path, capsys):
  """train.py --init-from hf:DIR trains from the HF weights: its first loss is the HF
  model's loss on the same batch."""
  directory, _ = saved["mha"]
  toml = tmp_path / "model.toml"
  assert cli.main(["convert", "hf-config", str(directory)]) == 0
  toml.write_text(capsys.readouterr().out)
  metrics = tmp_path / "metrics.jsonl"
  small = ["--set", "train.seq_len=16", "--set", "train.global_batch=8", "--set",
           "train.log_every=1", "--set", "data.max_bytes=200000", "--steps", "2",
           "--stop-after", "1", "--metrics-file", str(metrics)]
  args = ["--model", str(toml), "--mesh", "fsdp:4,tensor:2", "--init-from",
          f"hf:{directory}"] + small
  assert cli.train_main(args) == 0
  assert f"initialised params from hf:{directory}" in capsys.readouterr().out

  corpus = data.load(config.DataConfig(max_bytes=200000), 16)
  batch = torch.from_numpy(data.rows(corpus.train, 0, 0, 8, 16, (0, 8))).long()
  model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
  with torch.no_grad():
    logp = torch.log_softmax(model(batch[:, :-1]).logits, dim=-1)
    expected = -logp.gather(-1, batch[:, 1:, None]).mean().item()
  first = json.loads(metrics.read_text().splitlines()[0])
  assert first["step"] == 1 and first["loss"] == pytest.approx(expected, rel=1e-5)

  args[1] = "tiny"  # shapes differ from the HF config: a clear error, before any step
  assert cli.train_main(args) == 2
  err = capsys.readouterr().err
  assert "does not match the Hugging Face config" in err
  assert "model.d_model = 128, but hidden_size = 64" in err
