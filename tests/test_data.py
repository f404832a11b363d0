"""The data path: tokenizers, `shardlab data prepare`, packed rows with document masks, the
resumable loader (its position in the checkpoint), prefetch, and an end-to-end run on BPE
tokens (docs/data.md)."""

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlab import cli, config
from shardlab.errors import ConfigError
from shardlab.models import lm, registry
from shardlab.data import corpus, feed, listing, packing, sources, tokenizer, tokens
from shardlab.training import loop as train

import helpers as H

TEXT = "def f(x):\n    return x + 1  # ünïcode ✓\n"
TOKENS_OF_VOCAB = 512


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE tokenizer.json trained on 1 MB of the standard library (~1 s)."""
  files = sources.documents("stdlib", max_bytes=2**20, stdlib_files=_stdlib())
  return tokenizer.train_bpe(files, TOKENS_OF_VOCAB, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def _stdlib():
  return corpus._files(config.DataConfig())[0]


@pytest.fixture(scope="module")
def prepared(bpe, tmp_path_factory):
  out = tmp_path_factory.mktemp("prepared") / "stdlib"
  index = tokens.prepare("stdlib", out, str(bpe), held_out_fraction=0.05, workers=2,
                         max_bytes=600_000, stdlib_files=_stdlib())
  return out, index


def test_tokenizer_round_trips(bpe, tmp_path):
  byte = tokenizer.load("bytes")
  assert byte.decode(byte.encode(TEXT)) == TEXT and byte.vocab_size == 256
  hf = tokenizer.load(str(bpe))
  ids = hf.encode(TEXT)
  assert hf.decode(ids) == TEXT and len(ids) < len(TEXT.encode())  # merges happened
  assert hf.vocab_size == TOKENS_OF_VOCAB and hf.eos_id == hf.inner.token_to_id("<|endoftext|>")
  assert tokenizer.load(str(bpe.parent)).spec == str(bpe)  # a directory holding one
  sentencepiece = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text((TEXT + "the quick brown fox jumps over the lazy dog\n") * 200)
  sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                           vocab_size=60, model_type="bpe")
  sp = tokenizer.load(str(tmp_path / "sp.model"))
  assert sp.decode(sp.encode("the quick brown fox")) == "the quick brown fox"
  assert sp.eos_id is not None


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"data.tokenizer '.*nowhere.json' does not exist; "
                                        r"valid: 'bytes', a tokenizer.json"):
    tokenizer.load(str(tmp_path / "nowhere.json"))
  with pytest.raises(ConfigError, match=r"is a directory without tokenizer.json or "
                                        r"tokenizer.model"):
    tokenizer.load(str(tmp_path))
  with pytest.raises(ConfigError, match=r"data.tokenizer is empty"):
    config.DataConfig(tokenizer=" ")
  with pytest.raises(ConfigError, match=r"data.prefetch must be >= 0, got -1"):
    config.DataConfig(prefetch=-1)


def test_packing_rows_segments_positions_and_loss_mask():
  # Documents of 3, 5, 12 and 2 tokens (EOS included) into rows of 8.
  lengths = [3, 5, 12, 2]
  starts = np.cumsum([0] + lengths[:-1])
  stream = np.arange(1, sum(lengths) + 1)
  row_starts, row_lengths = packing.plan(starts, len(stream), 8)
  # [3+5] fills a row; 12 is cut into 8 + 4; the 4 and the 2 share a row.
  assert row_starts.tolist() == [0, 8, 16] and row_lengths.tolist() == [8, 8, 6]
  ids, segments, positions = packing.row(stream, starts, 16, 6, 8)
  assert ids.tolist() == [17, 18, 19, 20, 21, 22, 0, 0]
  assert segments.tolist() == [1, 1, 1, 1, 2, 2, 0, 0]
  assert positions.tolist() == [0, 1, 2, 3, 0, 1, 0, 1]
  ids, segments, positions = packing.row(stream, starts, 0, 8, 8)
  assert segments.tolist() == [1, 1, 1, 2, 2, 2, 2, 2]
  assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]

  # The loss counts a target only inside its input's document: never across the boundary
  # or into padding. A loss that sees only counted targets ignores what padding holds.
  model = H.MICRO.make(nnx.Rngs(0), jnp.float32)
  padded = packing.row(stream, starts, 16, 6, 8)
  batch = {"tokens": jnp.asarray([padded[0]] * 2), "segment_ids": jnp.asarray([padded[1]] * 2),
           "positions": jnp.asarray([padded[2]] * 2)}
  scrambled = dict(batch, tokens=batch["tokens"].at[:, 6:].set(99))  # only padding differs
  assert float(lm.next_token_loss(model, batch)) == float(lm.next_token_loss(model, scrambled))
  boundary = dict(batch, tokens=batch["tokens"].at[:, 4].set(7))  # doc 2's first token
  assert float(lm.next_token_loss(model, batch)) != float(lm.next_token_loss(model, boundary))


def test_no_attention_crosses_documents():
  """A document's hidden states in a packed row equal those of the document alone."""
  model = H.MICRO.make(nnx.Rngs(0), jnp.float32)
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 256, 5), rng.integers(0, 256, 7)
  row = np.concatenate([a, b, [0, 0, 0, 0]])[None]
  segments = np.array([[1] * 5 + [2] * 7 + [0] * 4])
  positions = np.array([list(range(5)) + list(range(7)) + list(range(4))])
  packed = model.hidden(jnp.asarray(row), jnp.asarray(positions), jnp.asarray(segments))
  alone = model.hidden(jnp.asarray(b[None]))
  np.testing.assert_allclose(packed[0, 5:12], alone[0], rtol=1e-5, atol=1e-5)
  other = np.concatenate([rng.integers(0, 256, 5), b, [0, 0, 0, 0]])[None]
  changed = model.hidden(jnp.asarray(other), jnp.asarray(positions), jnp.asarray(segments))
  np.testing.assert_allclose(changed[0, 5:12], packed[0, 5:12], rtol=1e-5, atol=1e-5)


def test_prepare_writes_shards_and_an_index(prepared):
  out, index = prepared
  assert json.loads((out / "index.json").read_text()) == index
  assert (out / "tokenizer.json").exists() and index["tokenizer"] == "tokenizer.json"
  _, splits = tokens.read_prepared(out)
  shard = splits["train"][0]
  assert shard.tokens.dtype == np.uint16 and isinstance(shard.tokens, np.memmap)
  eos = index["eos_id"]
  ends = np.append(shard.doc_starts[1:], len(shard.tokens)) - 1
  assert (np.asarray(shard.tokens)[ends] == eos).all()  # every document ends with EOS
  tok = tokenizer.load(str(out / "tokenizer.json"))
  first = np.asarray(shard.tokens[:shard.doc_starts[1] - 1])
  assert tok.decode(first.tolist()) == next(sources.documents("stdlib", stdlib_files=_stdlib()))


def test_loader_order_epochs_and_process_rows(prepared):
  out, _ = prepared
  cfg = config.DataConfig(corpus=str(out))
  a, b = (feed.PackedFeed(cfg, seed=3, global_batch=8, seq_len=32) for _ in range(2))
  n = len(a.train)
  np.testing.assert_array_equal(a.order(np.arange(2 * n)), b.order(np.arange(2 * n)))
  epoch0, epoch1 = a.order(np.arange(n)), a.order(np.arange(n, 2 * n))
  assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
  assert (epoch0 != epoch1).any()  # a fresh permutation per epoch
  whole = a.host(40, (0, 8))
  halves = [a.host(40, (0, 4)), a.host(40, (4, 8))]  # two processes' rows
  for key in whole:
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])


def test_prefetch_overlaps_input_with_steps():
  """Input that takes as long as a step costs the step (almost) nothing once prefetched."""
  produce = lambda k: (time.sleep(0.05), k)[1]
  for depth, bound in ((2, 0.15), (0, 0.4)):  # prefetched: only the first batch is waited for
    prefetcher = feed.Prefetcher(produce, 0, depth)
    got = []
    for k in range(10):
      got.append(prefetcher.get(k))
      time.sleep(0.06)  # the "step"
    prefetcher.close()
    assert got == list(range(10))
    assert (prefetcher.wait_s < bound) if depth else (prefetcher.wait_s > bound)


def packed_config(tmp_path, data_dir, name, **overrides):
  cfg = config.Config(model=registry.load("tiny"), mesh="fsdp:4,tensor:2", strategy="fsdp_tp")
  values = {"model.vocab_size": TOKENS_OF_VOCAB, "model.n_layers": 2, "train.seq_len": 32,
            "train.global_batch": 8, "train.steps": 6, "train.log_every": 1,
            "train.eval_batches": 1, "train.warmup_steps": 2, "data.corpus": str(data_dir),
            "metrics_file": str(tmp_path / f"{name}.jsonl"), **overrides}
  return config.set_values(cfg, values)


def test_packed_resume_is_bitwise_and_keeps_the_position(prepared, tmp_path, capsys):
  out, _ = prepared
  straight = packed_config(tmp_path, out, "straight", **{"checkpoint.dir": str(tmp_path / "a")})
  train.train(straight, quiet=True)
  resumed = packed_config(tmp_path, out, "resumed", **{"checkpoint.dir": str(tmp_path / "b")})
  assert train.train(resumed, quiet=True, stop_after=3)["steps_done"] == 3
  saved = json.loads((tmp_path / "b" / "3" / "progress" / "metadata").read_text())
  assert saved["data"]["kind"] == "packed" and saved["data"]["rows_consumed"] == 3 * 8
  train.train(resumed, quiet=True)
  lines = lambda c: [json.loads(line) for line in open(c.metrics_file)]
  read = lambda c: [r for r in lines(c) if "loss" in r]  # the step records (not eval_loss's)
  assert [r["loss"] for r in read(resumed)] == [r["loss"] for r in read(straight)]
  assert lines(resumed)[-1] == lines(straight)[-1]  # the final held-out loss, too
  assert all(r["input_wait_s"] < r["step_time_s"] for r in read(straight))


@pytest.mark.slow
def test_end_to_end_prepare_train_generate(bpe, tmp_path, capsys):
  """prepare → 50 steps on BPE tokens → held-out loss below the unigram baseline →
  generate decodes text with the tokenizer."""
  data_dir = tmp_path / "data"
  assert cli.main(["data", "prepare", "stdlib", str(data_dir), "--tokenizer", str(bpe),
                   "--max-bytes", "1000000", "--workers", "2", "--held-out-fraction",
                   "0.1"]) == 0
  assert "tokenized" in capsys.readouterr().err
  ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
  args = ["--model", "tiny", "--mesh", "fsdp:4,tensor:2", "--steps", "50", "--eval-every",
          "25", "--eval-batches", "2", "--checkpoint-dir", str(ckpt), "--run-dir",
          str(run_dir), "--sample-tokens", "16", "--set", f"data.corpus={data_dir}",
          "--set", f"model.vocab_size={TOKENS_OF_VOCAB}", "--set", "train.seq_len=64",
          "--set", "train.global_batch=16", "--set", "train.log_every=10"]
  assert cli.train_main(args) == 0
  text = capsys.readouterr().out
  held, unigram = map(float, __import__("re").search(
      r"held-out loss ([\d.]+) nats/token \(unigram baseline ([\d.]+)\)", text).groups())
  assert held < unigram, text
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "eval_loss" in r] == [25, 50]  # every 25, and the end
  assert (run_dir / "plot.png").exists()
  assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "def ", "--max-new-tokens",
                   "12", "--quiet"]) == 0
  sample = capsys.readouterr().out
  assert sample.startswith("def ") and len(sample) > 8 and "\ufffd" not in sample[:4]


def test_packed_resume_after_a_global_batch_change_reads_every_row_once(prepared, tmp_path,
                                                                       monkeypatch):
  """The position is rows consumed: a resume with another train.global_batch (under
  --allow-config-change) reads on from there with its own batch size, so the rows of the two
  runs together are positions 0, 1, 2, ... of the shuffled order: none skipped or repeated."""
  out, _ = prepared
  read, host = [], feed.PackedFeed.host
  monkeypatch.setattr(feed.PackedFeed, "host", lambda self, position, rows: (
      read.append((position, rows)), host(self, position, rows))[1])
  same = {"checkpoint.dir": str(tmp_path / "ckpt"), "data.prefetch": 0, "train.steps": 5}
  train.train(packed_config(tmp_path, out, "eight", **same), quiet=True, stop_after=3)
  bigger = packed_config(tmp_path, out, "sixteen", **same, **{"train.global_batch": 16})
  with pytest.raises(ConfigError, match=r"train.global_batch: 8 → 16"):
    train.train(bigger, quiet=True)
  assert train.train(bigger, quiet=True, allow_config_change=True)["steps_done"] == 5
  assert read == [(0, (0, 8)), (8, (0, 8)), (16, (0, 8)), (24, (0, 16)), (40, (0, 16))]
  saved = json.loads((tmp_path / "ckpt" / "5" / "progress" / "metadata").read_text())
  assert saved["data"]["rows_consumed"] == 3 * 8 + 2 * 16


def test_token_files_split_at_eos_and_refuse_ids_past_the_vocabulary(tmp_path):
  stream = np.array([5, 6, 0, 7, 8, 9, 0, 10, 0, 11, 12, 0], np.uint16)  # 0 is the EOS here
  stream.tofile(tmp_path / "train.bin")
  eos_zero = type("Tok", (), {"vocab_size": 16, "eos_id": 0, "spec": "test"})()
  splits = tokens.read_token_file(tmp_path / "train.bin", eos_zero, held_out_fraction=0.3)
  # Documents start at 0, 3, 7, 9; the held-out 30% begins at a document start (7).
  assert splits["train"][0].doc_starts.tolist() == [0, 3]
  assert np.asarray(splits["train"][0].tokens).tolist() == stream[:7].tolist()
  assert np.asarray(splits["held_out"][0].tokens).tolist() == [10, 0, 11, 12, 0]
  assert splits["held_out"][0].doc_starts.tolist() == [0, 2]
  np.save(tmp_path / "big.npy", np.array([1, 2, 300], np.uint16))
  with pytest.raises(ConfigError, match=r"data.corpus '.*big.npy' holds token id 300, outside "
                                        r"the vocabulary of data.tokenizer 'bytes' \(256 ids\)"):
    feed.PackedFeed(config.DataConfig(corpus=str(tmp_path / "big.npy")), 0, 8, 4)


def test_a_directory_corpus_lists_its_files_as_rglob_did(tmp_path):
  """The data's byte order rests on the file order: listing.files_under gives rglob's files
  in rglob's sorted order (names where string and path order differ, a link to a file, a
  link to a directory not followed, a FIFO left out, `skip` pruned)."""
  for name in ("a/b/y.py", "a-b/x.py", "a.b", "a/site-packages/z.py", "c/d.txt"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(name * 3)
  (tmp_path / "link.py").symlink_to(tmp_path / "a-b" / "x.py")
  (tmp_path / "dirlink").symlink_to(tmp_path / "c", target_is_directory=True)
  os.mkfifo(tmp_path / "a" / "pipe")
  assert listing.files_under(tmp_path) == sorted(p for p in tmp_path.rglob("*") if p.is_file())
  assert listing.files_under(tmp_path, ".py", skip="site-packages") == sorted(
      p for p in tmp_path.rglob("*.py") if "site-packages" not in p.parts)


def test_the_unigram_baseline_counted_in_slices_is_the_whole_count():
  """Three 1 MiB slices and a remainder give the baseline one bincount over it all gives."""
  data = np.random.default_rng(0).integers(0, 200, 3 * 2**20 + 17, dtype=np.uint8)
  split = corpus.Corpus(data[:-1000], data[-1000:], "random")
  counts = np.bincount(split.train, minlength=256).astype(np.float64) + 1.0
  held = np.bincount(split.held_out, minlength=256)
  assert split.unigram_loss() == float(-(held @ np.log(counts / counts.sum())) / held.sum())
