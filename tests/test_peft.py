"""PEFT LoRA adapters (shardlab/hf/peft.py): an adapter made by peft starts a LoRA run
through `--init-from hf:DIR` at peft's loss and logits, and the trained run's `convert to-hf
--peft` export loads in `peft.PeftModel.from_pretrained` with shardlab's logits (fp32, 1e-4)
and reads back bit-identical; mismatched or unsupported adapters are refused by field."""

import json
import shutil

import jax
import numpy as np
import pytest

from shardlab import cli, config, generate
from shardlab.data import corpus as data
from shardlab.errors import ConfigError
from shardlab.hf import peft
from shardlab.models import registry
from shardlab.sharding.activations import activation_rules
from shardlab.training import run as run_lib
from shardlab.training import state as state_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft_lib = pytest.importorskip("peft")

HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
          max_position_embeddings=64)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ["--set", "lora.rank=4", "--set", "lora.alpha=8"]
TOKENS = np.random.default_rng(0).integers(0, 256, size=(4, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(root, first-step metrics): a random HF Llama (root/hf), a LoRA adapter peft made for it
  with random nonzero B (root/made), and a 2-step LoRA run from that adapter (root/ckpt)."""
  root = tmp_path_factory.mktemp("peft")
  torch.manual_seed(0)
  base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      **HF, initializer_range=0.25, attn_implementation="eager")).eval()
  base.save_pretrained(root / "hf")
  made = peft_lib.get_peft_model(
      transformers.AutoModelForCausalLM.from_pretrained(root / "hf"),
      peft_lib.LoraConfig(r=4, lora_alpha=8, target_modules=MODULES, lora_dropout=0.0))
  with torch.no_grad():
    for name, p in made.named_parameters():
      if "lora_B" in name:  # zero at init: the adapter would compute nothing
        p.normal_(0, 0.1)
  made.save_pretrained(root / "made")
  from shardlab.hf import config as hf_config
  from shardlab.hf import convert as hf_convert
  (root / "model.toml").write_text(hf_config.to_toml(hf_convert.hf_model_config(root / "hf")))
  args = ["--model", str(root / "model.toml"), "--mesh", "fsdp:4,tensor:2", "--init-from",
          f"hf:{root / 'made'}", "--checkpoint-dir", str(root / "ckpt"), "--metrics-file",
          str(root / "metrics.jsonl"), "--quiet", "--steps", "2", "--sample-tokens", "0",
          "--set", "train.seq_len=16", "--set", "train.global_batch=8", "--set",
          "train.log_every=1", "--set", "train.eval_batches=1", "--set",
          "data.max_bytes=200000", "--set", "train.lr=0.02",
          "--set", "train.warmup_steps=1", *LORA]
  assert cli.train_main(args) == 0
  return root, json.loads((root / "metrics.jsonl").read_text().splitlines()[0])


def peft_model(root, adapter):
  base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf",
                                                           attn_implementation="eager")
  return peft_lib.PeftModel.from_pretrained(base, adapter).eval()


def torch_logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def ours(cfg, params, tokens=TOKENS) -> np.ndarray:
  p = run_lib.place(cfg)
  with activation_rules(p.shardings.mesh, p.shardings.rules):
    return np.asarray(jax.jit(lambda q, t: state_lib.model(p.abstract, q)(t))(params, tokens))


def lora_cfg(root, **lora) -> config.Config:
  model = registry.load(str(root / "model.toml"))
  return config.Config(model=model, mesh="fsdp:4,tensor:2", strategy="fsdp_tp",
                       lora=config.LoraConfig(**{"rank": 4, "alpha": 8.0, **lora}))


def load(directory, cfg):
  p = run_lib.place(cfg)
  return peft.load_params(directory, cfg, p.abstract, p.shardings)


def test_init_from_a_peft_adapter_starts_at_its_loss(run):
  root, first = run
  corpus = data.load(config.DataConfig(max_bytes=200000), 16)
  tokens = data.rows(corpus.train, 0, 0, 8, 16, (0, 8))
  batch = torch.from_numpy(tokens).long()

  def loss(model):
    with torch.no_grad():
      logp = torch.log_softmax(model(batch[:, :-1]).logits, dim=-1)
      return -logp.gather(-1, batch[:, 1:, None]).mean().item()

  base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
  assert abs(loss(base) - first["loss"]) > 1e-3  # the adapter is in the first step
  assert first["loss"] == pytest.approx(loss(peft_model(root, root / "made")), rel=1e-5)


def test_a_peft_adapter_reads_with_peft_logits(run):
  root, _ = run
  cfg = lora_cfg(root)
  theirs = torch_logits(peft_model(root, root / "made"))
  np.testing.assert_allclose(ours(cfg, load(root / "made", cfg)), theirs, rtol=0, atol=1e-4)


def test_to_hf_peft_loads_in_peft_with_shardlab_logits(run, capsys):
  root, _ = run
  out = root / "exported"
  assert cli.main(["convert", "to-hf", str(root / "ckpt"), str(out), "--peft"]) == 0
  assert "wrote a PEFT LoRA adapter (r 4, lora_alpha 8" in capsys.readouterr().out
  assert sorted(p.name for p in out.iterdir()) == [peft.ADAPTER_CONFIG, peft.ADAPTER_FILE]
  written = json.loads((out / peft.ADAPTER_CONFIG).read_text())
  # The run started from root/made, an adapter of root/hf: the base is root/hf.
  assert written["base_model_name_or_path"] == str(root / "hf")
  assert (written["r"], written["lora_alpha"]) == (4, 8)
  assert written["target_modules"] == sorted(MODULES)

  _, params, cfg, _ = generate.from_checkpoint(str(root / "ckpt"))
  expected = ours(cfg, params)
  made = torch_logits(peft_model(root, root / "made"))
  assert np.abs(expected - made).max() > 1e-3  # the 2 steps moved the adapters
  np.testing.assert_allclose(torch_logits(peft_model(root, out)), expected, rtol=0, atol=1e-4)


def test_the_export_reads_back_bit_identical(run, tmp_path):
  root, _ = run
  out = tmp_path / "adapter"
  assert cli.main(["convert", "to-hf", str(root / "ckpt"), str(out), "--peft",
                   "--base-model", str(root / "hf")]) == 0
  beside = tmp_path / "beside"  # the adapter in the base's own directory
  shutil.copytree(root / "hf", beside)
  for name in (peft.ADAPTER_CONFIG, peft.ADAPTER_FILE):
    shutil.copy(out / name, beside / name)
  _, params, cfg, _ = generate.from_checkpoint(str(root / "ckpt"))
  for directory in (out, beside):  # the base from base_model_name_or_path, or beside
    loaded = load(directory, cfg)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def edited(root, tmp_path, **fields):
  out = tmp_path / "edited"
  shutil.copytree(root / "made", out)
  cfg = json.loads((out / peft.ADAPTER_CONFIG).read_text())
  (out / peft.ADAPTER_CONFIG).write_text(json.dumps({**cfg, **fields}))
  return out


@pytest.mark.parametrize("fields,lora,match", [
    ({}, {"rank": 8}, r"lora.rank = 8, but r = 4; run with --set lora.rank=4 --set "
                      r"lora.alpha=8 --set lora.targets=q,k,v,o,gate,up,down"),
    ({}, {"alpha": 16.0}, r"lora.alpha = 16.0, but lora_alpha = 8"),
    ({}, {"targets": "q,v"}, r"lora.targets = 'q,v', but the adapter adapts "
                             r"q,k,v,o,gate,up,down"),
    ({}, {"rank": 0}, r"lora.rank = 0, but r = 4"),
    ({"peft_type": "IA3"}, {}, r"peft_type = 'IA3'; shardlab reads 'LORA'"),
    ({"use_dora": True}, {}, r"use_dora = True is not supported \(DoRA"),
    ({"use_rslora": True}, {}, r"use_rslora = True is not supported"),
    ({"modules_to_save": ["lm_head"]}, {}, r"modules_to_save = \['lm_head'\]"),
    ({"r": 0}, {}, r"r = 0 and lora_alpha = 8"),
    ({"base_model_name_or_path": None}, {}, r"base_model_name_or_path is None"),
    ({"base_model_name_or_path": "meta-llama/Llama-3-8B"}, {},
     r"'meta-llama/Llama-3-8B' is not a local directory"),
])
def test_mismatched_or_unsupported_adapters_are_refused(run, tmp_path, fields, lora, match):
  root, _ = run
  with pytest.raises(ConfigError, match=match):
    load(edited(root, tmp_path, **fields), lora_cfg(root, **lora))


def test_an_adapter_with_foreign_tensors_is_refused(run, tmp_path):
  root, _ = run
  out = edited(root, tmp_path)
  from safetensors.numpy import load_file, save_file
  tensors = load_file(out / peft.ADAPTER_FILE)
  tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 64), np.float32)
  save_file(tensors, out / peft.ADAPTER_FILE)
  with pytest.raises(ConfigError, match=r"no LoRA A or B of a llama target "
                                        r"\(base_model.model.lm_head.lora_A.weight\)"):
    load(out, lora_cfg(root))


def test_to_hf_peft_refusals(run, tmp_path, capsys):
  root, _ = run
  ckpt = str(root / "ckpt")
  assert cli.main(["convert", "to-hf", ckpt, str(tmp_path / "a"), "--peft",
                   "--merge-lora"]) == 2
  assert "--peft and --merge-lora exclude each other" in capsys.readouterr().err
  assert cli.main(["convert", "to-hf", ckpt, str(tmp_path / "b"), "--base-model", "x"]) == 2
  assert "pass --peft with it" in capsys.readouterr().err


@pytest.mark.parametrize("preset,target,why", [
    ("phi3-tiny", "q", r"it is part of the fused HF tensor model.layers.\{i\}.self_attn.qkv_proj"),
    ("gpt2-tiny", "o", r"its HF tensor transformer.h.\{i\}.attn.c_proj.weight has dims "
                       r"\('HE', 'D'\), not a Linear's \(out, in\)"),
])
def test_families_without_one_linear_per_target_are_refused(preset, target, why):
  with pytest.raises(ConfigError, match=rf"LoRA target '{target}' of \w+ has no PEFT module: "
                                        rf"{why}.*--merge-lora"):
    peft.targets(registry.load(preset), [target])


@pytest.mark.parametrize("preset", ["tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny",
                                    "qwen3-moe-tiny", "gemma2-tiny", "gemma3-tiny"])
def test_every_covered_familys_adapters_have_peft_shapes(preset):
  """Each target's A and B (one layer) laid out as lora_A (r, in) and lora_B (out, r) of
  the module whose weight lora_weights names, in every family the export covers."""
  m = registry.load(preset)
  names = list(m.lora_weights)
  cfg = config.Config(model=m, mesh="fsdp:-1", strategy="fsdp",
                      lora=config.LoraConfig(rank=4, targets=",".join(names)))
  params = run_lib.abstract_state(cfg).state.params
  found = peft.targets(m, names)
  assert [t.name for t in found] == names
  size = {**peft.families.for_model(m).sizes(m), "R": 4}
  hf_shapes = {w.hf: peft.weights.hf_shape(w, size) for w in peft.families.for_model(m).tensors(m)}
  for t in found:
    out, in_ = hf_shapes[t.module + ".weight"]
    for mapping, shape in ((t.a, (4, in_)), (t.b, (out, 4))):
      layer = np.zeros(peft.weights._at(params, mapping.param).shape[1:], np.float32)
      assert peft.weights.to_hf_layout(layer, mapping).shape == shape
  assert peft.target_modules(m, found) == sorted(t.module.rsplit(".", 1)[-1] for t in found)


def test_an_adapter_trains_with_its_base_models_tokenizer(tmp_path):
  from shardlab.cli import train as train_cli
  base, adapter = tmp_path / "base", tmp_path / "adapter"
  base.mkdir()
  adapter.mkdir()
  (base / "tokenizer.json").write_text("{}")
  (adapter / peft.ADAPTER_CONFIG).write_text(json.dumps(
      {"peft_type": "LORA", "base_model_name_or_path": str(base)}))

  def tokenizer():
    args = train_cli.train_parser().parse_args(["--model", "tiny", "--init-from",
                                                f"hf:{adapter}"])
    return train_cli.config_from_args(args).data.tokenizer

  assert tokenizer() == str(base)
  (adapter / "tokenizer.json").write_text("{}")  # its own, where it has one
  assert tokenizer() == str(adapter)
