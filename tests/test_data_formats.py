"""`shardlab data prepare` on Parquet, Arrow IPC (file and streaming formats) and a
`datasets` save_to_disk directory: the token shards equal, array for array, those of the
same text given as .jsonl; a missing, non-text or null column is refused naming the file."""

import json

import numpy as np
import pytest

from shardlab import config
from shardlab.cli.data import data_main
from shardlab.data import corpus, feed, sources, tokens
from shardlab.errors import ConfigError

pa = pytest.importorskip("pyarrow")
ipc = pytest.importorskip("pyarrow.ipc")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = "alpha beta gamma delta héllo wörld ☃ 日本語 tab\tnew\nline".split(" ")


def texts() -> list[str]:
  rng = np.random.default_rng(0)
  return [" ".join(rng.choice(WORDS, rng.integers(1, 30))) for _ in range(2500)]


def table():
  rows = texts()  # beside the text: a number column, which the reader never touches
  return pa.table({"id": pa.array(range(len(rows)), pa.int64()), "body": rows})


def prepare(source, out, **kw) -> dict[str, np.ndarray]:
  """{file name: array} of a prepared directory (its index's splits included)."""
  index = tokens.prepare(str(source), out, "bytes", text_field="body", held_out_fraction=0.1,
                         workers=1, shard_tokens=20_000, **kw)
  arrays = {p.name: np.load(p) for p in sorted(out.glob("*.npy"))}
  arrays["index"] = {k: v for k, v in index.items() if k != "source"}
  return arrays


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  root = tmp_path_factory.mktemp("formats")
  with open(root / "corpus.jsonl", "w") as f:
    for i, text in enumerate(texts()):
      f.write(json.dumps({"id": i, "body": text}) + "\n")
  return root, prepare(root / "corpus.jsonl", root / "from-jsonl")


def assert_same(got: dict, want: dict) -> None:
  assert got.keys() == want.keys() and len(want) > 6  # several train shards, both splits
  assert got["index"] == want["index"]
  for name in want:
    if name != "index":
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
      assert got[name].dtype == want[name].dtype


def write_arrow(path, stream: bool) -> None:
  data = table()
  opener = ipc.new_stream if stream else ipc.new_file
  with opener(str(path), data.schema) as writer:
    for batch in data.to_batches(max_chunksize=700):  # several batches, one boundary mid-doc-list
      writer.write_batch(batch)


@pytest.mark.parametrize("kind", ["parquet", "arrow-file", "arrow-stream"])
def test_parquet_and_arrow_prepare_as_jsonl(reference, tmp_path, kind):
  root, want = reference
  path = tmp_path / ("corpus.parquet" if kind == "parquet" else "corpus.arrow")
  if kind == "parquet":
    pq.write_table(table(), path, row_group_size=600)
  else:
    write_arrow(path, stream=kind == "arrow-stream")
  assert_same(prepare(path, tmp_path / "out"), want)


def test_datasets_save_to_disk_prepares_as_jsonl(reference, tmp_path):
  datasets = pytest.importorskip("datasets")
  root, want = reference
  rows = texts()
  order = np.random.default_rng(1).permutation(len(rows))
  # Shuffled, then saved in 3 files: the rows come back in the dataset's order, not the
  # order they were created in.
  shuffled = datasets.Dataset.from_dict({"body": [rows[i] for i in np.argsort(order)]})
  shuffled = shuffled.select(order)
  assert shuffled["body"] == rows
  shuffled.save_to_disk(str(tmp_path / "ds"), num_shards=3)
  assert len(list((tmp_path / "ds").glob("*.arrow"))) == 3
  assert_same(prepare(tmp_path / "ds", tmp_path / "out"), want)
  # A DatasetDict is refused naming its splits.
  datasets.DatasetDict({"train": shuffled, "test": shuffled}).save_to_disk(str(tmp_path / "dd"))
  with pytest.raises(ConfigError, match=r"DatasetDict with splits \['train', 'test'\].*dd/train"):
    sources.documents(str(tmp_path / "dd"))
  # train.py reads such a directory as records too (never its .arrow bytes as text).
  assert feed.is_packed(config.DataConfig(corpus=str(tmp_path / "ds")))


def test_max_bytes_reads_the_same_documents_as_jsonl(reference, tmp_path):
  root, _ = reference
  pq.write_table(table(), tmp_path / "c.parquet", row_group_size=300)
  for limit in (1, 5000, 123_457):
    got = list(sources.documents(str(tmp_path / "c.parquet"), "body", limit))
    assert got == list(sources.documents(str(root / "corpus.jsonl"), "body", limit))
    assert 0 < len(got) < 2500


def test_bad_columns_are_refused_naming_file_column_and_columns(tmp_path, capsys):
  data = pa.table({"id": [1, 2], "body": ["a", None], "title": ["x", "y"]})
  pq.write_table(data, tmp_path / "c.parquet")
  read = lambda field, name="c.parquet": list(sources.documents(str(tmp_path / name), field))
  with pytest.raises(ConfigError, match=r"c.parquet has no column 'text' .*columns: "
                                        r"\['id', 'body', 'title'\]"):
    read("text")
  with pytest.raises(ConfigError, match=r"c.parquet column 'id' holds int64, not text "
                                        r"\(string\); its text columns: \['body', 'title'\]"):
    read("id")
  with pytest.raises(ConfigError, match=r"c.parquet row 1: column 'body' is null"):
    read("body")
  assert read("title") == ["x", "y"]
  write_arrow(tmp_path / "c.arrow", stream=True)
  with pytest.raises(ConfigError, match=r"c.arrow has no column 'text'.*\['id', 'body'\]"):
    read("text", "c.arrow")
  (tmp_path / "bad.arrow").write_bytes((tmp_path / "c.arrow").read_bytes()[:300])
  with pytest.raises(ConfigError, match=r"bad.arrow cannot be read as Arrow"):
    read("body", "bad.arrow")
  (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
  with pytest.raises(ConfigError, match=r"bad.parquet cannot be read as Parquet"):
    read("body", "bad.parquet")
  # Through the command: exit 2, one line, and no output directory left behind.
  out = tmp_path / "out"
  assert data_main(["prepare", str(tmp_path / "c.parquet"), str(out), "--workers", "1"]) == 2
  assert "has no column 'text'" in capsys.readouterr().err
  assert not out.exists()


def test_byte_level_training_refuses_a_directory_of_parquet(tmp_path):
  pq.write_table(table(), tmp_path / "c.parquet")
  with pytest.raises(ConfigError, match="c.parquet, a Parquet/Arrow file, which is not text"):
    corpus.load(config.DataConfig(corpus=str(tmp_path)), 16)
  assert feed.is_packed(config.DataConfig(corpus=str(tmp_path / "c.parquet")))


@pytest.mark.parametrize("flag,value", [("--workers", "-1"), ("--shard-tokens", "0"),
                                        ("--max-bytes", "0")])
def test_out_of_range_settings_are_refused_before_anything_is_written(tmp_path, capsys, flag,
                                                                      value):
  (tmp_path / "c.txt").write_text("some text")
  out = tmp_path / "out"
  with pytest.raises(SystemExit) as got:  # argparse's: the option's declared range
    data_main(["prepare", str(tmp_path / "c.txt"), str(out), flag, value])
  assert got.value.code == 2
  assert f"error: argument {flag}: must be an integer >= {int(flag != '--workers')}" in \
      capsys.readouterr().err
  assert not out.exists()
  # The library's own check reads the same declaration (a caller of tokens.prepare).
  kw = {"--workers": {"workers": -1}, "--shard-tokens": {"shard_tokens": 0},
        "--max-bytes": {"max_bytes": 0}}[flag]
  with pytest.raises(ConfigError, match=f"{flag} must be >= {int(flag != '--workers')}"):
    tokens.prepare(str(tmp_path / "c.txt"), out, "bytes", **kw)
  assert not out.exists()


def test_a_shard_changed_under_a_run_is_an_error_naming_it(tmp_path):
  """Shards are memory-mapped: one truncated under a running run killed it with SIGBUS and
  no message. Each batch checks the files it reads are as mapped (grown here: a truncation
  would kill this test's process were the check off)."""
  source, out = tmp_path / "c.jsonl", tmp_path / "prepared"
  source.write_text("".join(json.dumps({"text": f"document {i}: " + "some text " * 30}) + "\n"
                            for i in range(50)))
  tokens.prepare(str(source), out, "bytes", held_out_fraction=0.1, workers=1)
  packed = feed.PackedFeed(config.DataConfig(corpus=str(out)), 0, 4, 32)
  packed.host(0, (0, 4))
  (shard,) = [p for p in out.glob("train-*.npy") if not p.name.endswith(".docs.npy")]
  with open(shard, "ab") as f:
    f.write(bytes(64))
  with pytest.raises(ConfigError, match=f"{shard} changed while this run reads it"):
    packed.host(4, (0, 4))
  shard.unlink()
  with pytest.raises(ConfigError, match=f"{shard} went away while this run reads it"):
    packed.host(8, (0, 4))
