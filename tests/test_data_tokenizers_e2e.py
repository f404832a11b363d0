"""End to end with real tokenizers (docs/data.md): a SentencePiece model through `data
prepare` → train → held-out loss below the unigram baseline → generate; and `--init-from
hf:DIR` where DIR holds a tokenizer.json beside a random HF Llama, picked up by training
(its data is tokenized with it) and by generate (prompts encoded, samples decoded, and the
model's eos ids end a sample)."""

import json
import re

import numpy as np
import pytest

from shardlab import cli, config, generate
from shardlab.cli import text
from shardlab.data import corpus as data, sources, tokenizer

pytestmark = pytest.mark.slow
SMALL = ["--mesh", "fsdp:4,tensor:2", "--set", "train.seq_len=32", "--set",
         "train.global_batch=8", "--set", "train.log_every=10", "--set", "model.n_layers=2"]


def stdlib_texts(max_bytes: int):
  return sources.documents("stdlib", max_bytes=max_bytes,
                          stdlib_files=data._files(config.DataConfig())[0])


def held_out_and_unigram(out: str) -> tuple[float, float]:
  found = re.search(r"held-out loss ([\d.]+) nats/token \(unigram baseline ([\d.]+)\)", out)
  assert found, out
  return float(found[1]), float(found[2])


def test_sentencepiece_prepare_train_generate(tmp_path, capsys):
  sentencepiece = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(stdlib_texts(400_000)))
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400, model_type="bpe",
      byte_fallback=True, minloglevel=2)
  data_dir, ckpt = tmp_path / "data", tmp_path / "ckpt"
  assert cli.main(["data", "prepare", "stdlib", str(data_dir), "--tokenizer",
                   str(tmp_path / "sp.model"), "--max-bytes", "600000", "--workers", "1",
                   "--held-out-fraction", "0.1"]) == 0
  assert json.loads((data_dir / "index.json").read_text())["tokenizer"] == "sp.model"
  capsys.readouterr()
  assert cli.train_main(["--model", "tiny", *SMALL, "--steps", "80", "--checkpoint-dir",
                         str(ckpt), "--sample-tokens", "8", "--set", f"data.corpus={data_dir}",
                         "--set", "model.vocab_size=400", "--set", "train.warmup_steps=10"]) == 0
  out = capsys.readouterr().out
  assert f"{data_dir}/sp.model, vocab 400" in out  # trained on SentencePiece ids
  held, unigram = held_out_and_unigram(out)
  assert held < unigram, out
  assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "import os",
                   "--max-new-tokens", "12", "--quiet"]) == 0
  sample = capsys.readouterr().out
  assert sample.startswith("import os") and "\ufffd" not in sample


def hf_llama(directory, vocab: int, eos_ids: list[int]) -> None:
  """A random tiny Llama saved with transformers, with these eos ids in its config."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      bos_token_id=None, eos_token_id=eos_ids)
  transformers.LlamaForCausalLM(cfg).save_pretrained(directory)


def test_init_from_hf_picks_up_the_checkpoints_tokenizer(tmp_path, capsys):
  pytest.importorskip("tokenizers")
  hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
  tok_file = tokenizer.train_bpe(stdlib_texts(300_000), 320, hf_dir / "tokenizer.json")
  tok = tokenizer.load(str(tok_file))
  hf_llama(hf_dir, tok.vocab_size, [tok.eos_id, 7])
  assert cli.main(["convert", "hf-config", str(hf_dir)]) == 0
  (tmp_path / "model.toml").write_text(capsys.readouterr().out)
  assert cli.train_main(["--model", str(tmp_path / "model.toml"), *SMALL[:-2],
                         "--init-from", f"hf:{hf_dir}", "--steps", "2", "--checkpoint-dir",
                         str(ckpt), "--sample-tokens", "8", "--set", "data.max_bytes=400000",
                         "--set", "data.held_out_fraction=0.1"]) == 0
  out = capsys.readouterr().out
  assert f"({tok_file}, vocab 320)" in out  # the data was tokenized with DIR's tokenizer

  # generate: the checkpoint's run names DIR's tokenizer; prompts are encoded and samples
  # decoded with it, and the HF config's eos ids (with the tokenizer's) end a sample.
  assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "def ",
                   "--max-new-tokens", "12", "--temperature", "0", "--quiet"]) == 0
  sample = capsys.readouterr().out
  gen, params, cfg, _ = generate.from_checkpoint(str(ckpt))
  assert cfg.data.tokenizer == str(hf_dir) and text.eos_ids(tok, cfg) == (tok.eos_id, 7)
  s = text.sampling(tok, cfg, max_new_tokens=12, temperature=0.0, top_k=0)
  ids = gen.generate(params, [np.asarray(tok.encode("def "), np.int32)], s)[0][0]
  assert tok.encode("def ") != list(b"def ")  # not byte ids: the prompt went through DIR's
  assert sample == "def " + text.decode(tok, ids, s.eos_ids)[0] + "\n"
