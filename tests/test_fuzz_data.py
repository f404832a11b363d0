"""The data readers fuzzed: tokenizer files (tokenizer.json, tokenizer_config.json beside it,
a SentencePiece .model), a prepared directory's index.json and shards (data/tokens.py,
data/prepared_check.py) and the loader position a checkpoint saves (data/feed.py). Each
input is accepted, and then usable, or refused by a ConfigError naming the file."""

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, strategies as st

from fuzz_harness import ODD, _count_inputs, damaged, mutations, outcome, write  # noqa: F401
from shardlab.config import DataConfig
from shardlab.data import feed as feed_lib
from shardlab.data import tokenizer, tokens

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  path = tokenizer.train_bpe([TEXT] * 4, 300, tmp_path_factory.mktemp("bpe") / "tokenizer.json")
  return path.read_bytes()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
  sentencepiece = pytest.importorskip("sentencepiece")
  d = tmp_path_factory.mktemp("sp")
  (d / "corpus.txt").write_text(TEXT.replace(". ", ".\n") * 5)
  sentencepiece.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(
      d / "sp"), vocab_size=40, model_type="bpe", minloglevel=2)
  return (d / "sp.model").read_bytes()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  d = tmp_path_factory.mktemp("prep")
  (d / "src").mkdir()
  for k in range(6):
    (d / "src" / f"{k}.txt").write_text(TEXT[: 50 + 20 * k])
  tokens.prepare(str(d / "src"), d / "out", "bytes", held_out_fraction=0.3, workers=1)
  return d / "out"


def _use(tok) -> None:
  """What an accepted tokenizer must allow: encoding and decoding text."""
  tok.decode(tok.encode("the fox"))


def test_tokenizer_json(bpe, tmp_path_factory):
  @given(raw=damaged(bpe))
  def check(raw):
    path = write(tmp_path_factory.mktemp("tj") / "tokenizer.json", raw)
    tok = outcome(lambda: tokenizer.load(str(path)), "tokenizer.json")
    if tok is not None:
      _use(tok)
  check()


def test_tokenizer_config_beside_it(bpe, tmp_path_factory):
  @given(config=st.one_of(mutations({"eos_token": "<|endoftext|>", "bos_token": None}), ODD),
         raw=st.one_of(st.none(), damaged(b'{"eos_token": "<|endoftext|>"}')))
  def check(config, raw):
    d = tmp_path_factory.mktemp("tc")
    write(d / "tokenizer.json", bpe)
    write(d / "tokenizer_config.json", json.dumps(config) if raw is None else raw)
    tok = outcome(lambda: tokenizer.load(str(d)), "tokenizer_config.json")
    if tok is not None:
      _use(tok)
  check()


def test_sentencepiece_model(sp_model, tmp_path_factory):
  @given(raw=damaged(sp_model))
  def check(raw):
    path = write(tmp_path_factory.mktemp("sp") / "tokenizer.model", raw)
    tok = outcome(lambda: tokenizer.load(str(path)), "tokenizer.model")
    if tok is not None:
      _use(tok)
  check()


def test_a_directory_named_like_a_tokenizer_is_refused(tmp_path):
  (tmp_path / "tokenizer.json").mkdir()
  assert outcome(lambda: tokenizer.load(str(tmp_path)), str(tmp_path)) is None
  assert outcome(lambda: tokenizer.load(str(tmp_path / "tokenizer.json")),
                 "tokenizer.json") is None


def _copy(prepared, tmp_path_factory):
  d = tmp_path_factory.mktemp("p") / "data"
  shutil.copytree(prepared, d)
  return d


def _read(d):
  index, splits = tokens.read_prepared(d)
  for shards in splits.values():  # what the loader then does with every shard
    for s in shards:
      assert int(np.asarray(s.tokens).max(initial=0)) < index["vocab_size"]
  return index


def test_prepared_index(prepared, tmp_path_factory):
  index = json.loads((prepared / "index.json").read_text())
  entry = index["splits"]["train"][0]

  @given(fields=st.one_of(
      mutations(index), mutations(entry).map(
          lambda e: {**index, "splits": {**index["splits"], "train": [e]}}),
      st.builds(lambda v: {**index, "splits": {"train": v, "held_out": []}}, ODD)))
  def check(fields):
    d = _copy(prepared, tmp_path_factory)
    write(d / "index.json", json.dumps(fields))
    outcome(lambda: _read(d), "index.json", str(d))
  check()


def test_prepared_shards(prepared, tmp_path_factory):
  """Shards truncated, flipped (ids past the vocabulary, a header claiming more elements
  than the file holds), or swapped for random bytes."""
  names = sorted(p.name for p in prepared.glob("*.npy"))

  @given(name=st.sampled_from(names), data=st.data())
  def check(name, data):
    d = _copy(prepared, tmp_path_factory)
    write(d / name, data.draw(damaged((prepared / name).read_bytes())))
    outcome(lambda: _read(d), str(d))
  check()


def test_prepared_uint16_ids_past_the_vocabulary_are_refused(prepared, tmp_path):
  d = tmp_path / "data"
  shutil.copytree(prepared, d)
  name = json.loads((d / "index.json").read_text())["splits"]["train"][0]["tokens"]
  ids = np.load(d / name)
  ids[3] = 300  # bytes: vocab 256
  np.save(d / name, ids)
  with pytest.raises(Exception, match=r"holds token id 300, outside the vocabulary of 256"):
    tokens.read_prepared(d)


def test_an_id_past_the_first_look_is_refused_in_its_batch(prepared, tmp_path, monkeypatch):
  """Reading the directory looks at each shard's head only (a pass over all the data at every
  start would not scale); the rest is checked batch by batch as the feed builds it."""
  from shardlab.data import prepared_check
  monkeypatch.setattr(prepared_check, "FIRST_LOOK", 4)
  d = tmp_path / "data"
  shutil.copytree(prepared, d)
  index = json.loads((d / "index.json").read_text())
  for entry in index["splits"]["train"] + index["splits"]["held_out"]:
    ids = np.load(d / entry["tokens"])
    ids[-1] = 300  # past the first look, in every shard
    np.save(d / entry["tokens"], ids)
  tokens.read_prepared(d)  # the heads are fine
  feed = feed_lib.PackedFeed(DataConfig(corpus=str(d)), 0, 4, 16)
  with pytest.raises(Exception, match=r"holds token id 300, outside the vocabulary of 256"):
    for position in range(0, 4 * len(feed.train), 4):  # an epoch: every row once
      feed.host(position, (0, 4))


def test_loader_position(prepared):
  """The data state a checkpoint saves, fuzzed: a resume accepts a valid one (its position
  from it) and refuses any other naming the field."""
  feed = feed_lib.PackedFeed(DataConfig(corpus=str(prepared)), 0, 4, 16)
  valid = feed.state(8)

  @given(saved=st.one_of(mutations(valid), ODD))
  def check(saved):
    position = outcome(lambda: feed.start(3, {"data": saved}), "checkpoint")
    if position is not None:
      assert isinstance(position, int) and position >= 0
  check()


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_file(tmp_path_factory, suffix):
  """A nanoGPT-style token file (data.corpus FILE.npy / FILE.bin) damaged: truncated,
  flipped, random; negative or out-of-vocabulary ids; float arrays."""
  ids = (np.arange(200) % 250).astype(np.uint16)
  d = tmp_path_factory.mktemp("tok")
  np.save(d / "valid.npy", ids)
  valid = (d / "valid.npy").read_bytes() if suffix == ".npy" else ids.tobytes()

  @given(raw=st.one_of(damaged(valid), st.sampled_from([
      np.array([1, -3, 4], np.int32), np.array([1.5, 2.0]), np.zeros((2, 3), np.uint16),
      np.array([1, 70000], np.uint32)]).map(_npy_bytes)))
  def check(raw):
    path = write(tmp_path_factory.mktemp("t") / f"tokens{suffix}", raw)
    split = outcome(lambda: tokens.read_token_file(path, tokenizer.ByteTokenizer(), 0.1),
                    f"tokens{suffix}")
    if split is not None:
      assert all(int(np.asarray(s.tokens).max(initial=0)) < 256 for s in split["train"])
  check()


def _npy_bytes(array) -> bytes:
  import io
  out = io.BytesIO()
  np.save(out, array)
  return out.getvalue()
