"""The packed loader across 2 real processes (× 4 simulated devices, 127.0.0.1, gloo): each
process reads only its own rows of the prepared data and hands them to
jax.make_array_from_process_local_data; the global batch equals what 1 process × 8 devices
builds (docs/data.md, "The loader and resume")."""

import os

import jax
import numpy as np
import pytest

from shardlab import config
from shardlab.models import registry
from shardlab.testing import processes
from shardlab.data import corpus as data, sources, tokenizer, tokens
from shardlab.training import run as run_lib

pytestmark = pytest.mark.slow

MESH = "dcn.data:2,fsdp:4"  # data across the two processes, fsdp inside each
DATA_DIR = "SHARDLAB_TEST_PREPARED_DATA"  # where the children find the prepared data
STEP, BATCH, SEQ = 2, 16, 32  # step 2's batch: rows 32..47 of the shuffled order
KEYS = ("tokens", "segment_ids", "positions")


def run_config(data_dir: str) -> config.Config:
  cfg = config.Config(model=registry.load("tiny"), mesh=MESH, strategy="fsdp")
  return config.set_values(cfg, {
      "model.vocab_size": 512, "model.n_layers": 1, "train.seq_len": SEQ,
      "train.global_batch": BATCH, "train.seed": 7, "data.corpus": data_dir,
      "data.prefetch": 0})


def step_batch(data_dir: str) -> tuple[dict, list[list[int]], tuple[int, int]]:
  """(step STEP's global batch as a jax.Array per key, the row indices this process read,
  its block of rows), through the run's own input path."""
  run = run_lib.setup(run_config(data_dir))
  read, batch_of = [], run.feed.train.batch
  run.feed.train.batch = lambda indices: (read.append(indices.tolist()), batch_of(indices))[1]
  inputs = run.inputs(STEP, None)
  try:
    batch = inputs.get(STEP)
  finally:
    inputs.close()
  return batch, read, run._rows()


def rows_of_this_process() -> dict:
  """In each launched process: what it read, what its devices hold, and the global batch."""
  from jax.experimental import multihost_utils
  batch, read, rows = step_batch(os.environ[DATA_DIR])
  local = {k: sorted((s.index[0].start or 0, np.asarray(s.data).tolist())
                     for s in v.addressable_shards) for k, v in batch.items()}
  gathered = {k: multihost_utils.process_allgather(v, tiled=True).tolist()
              for k, v in batch.items()}
  return {"process": jax.process_index(), "devices": jax.local_device_count(), "rows": rows,
          "read": read, "local": local, "global": gathered}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
  """A small BPE tokenizer and stdlib text prepared with it (a few seconds)."""
  files = data._files(config.DataConfig())[0]
  tok = tokenizer.train_bpe(sources.documents("stdlib", max_bytes=300_000, stdlib_files=files),
                            512, tmp_path_factory.mktemp("bpe") / "tokenizer.json")
  out = tmp_path_factory.mktemp("prepared") / "stdlib"
  tokens.prepare("stdlib", out, str(tok), held_out_fraction=0.1, workers=1,
                 max_bytes=600_000, stdlib_files=files)
  return str(out)


def test_each_process_reads_only_its_rows_and_the_batch_matches_one_process(prepared,
                                                                              monkeypatch):
  monkeypatch.setenv(DATA_DIR, prepared)
  two = processes.launch(f"{__name__}:rows_of_this_process", processes=2,
                         devices_per_process=4, timeout_s=400)
  one, read, rows = step_batch(prepared)  # this process: 8 simulated devices
  assert rows == (0, BATCH) and len(read) == 1
  order = read[0]  # the global batch's row indices, in order
  assert [r["process"] for r in two] == [0, 1] and all(r["devices"] == 4 for r in two)
  half = BATCH // 2
  for rank, r in enumerate(two):
    lo, hi = rank * half, (rank + 1) * half
    assert r["rows"] == [lo, hi]
    assert r["read"] == [order[lo:hi]]  # its own rows, and no other
    for key in KEYS:  # what its devices hold is cut from its rows alone
      for start, shard in r["local"][key]:
        assert lo <= start < hi and start + len(shard) <= hi
        np.testing.assert_array_equal(shard, np.asarray(one[key])[start:start + len(shard)])
  for key in KEYS:
    expected = np.asarray(jax.device_get(one[key]))
    assert expected.shape == (BATCH, SEQ + 1)
    for r in two:
      np.testing.assert_array_equal(np.asarray(r["global"][key]), expected)
