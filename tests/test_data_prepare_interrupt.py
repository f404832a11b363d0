"""An interrupted `shardlab data prepare`: SIGKILL mid-way leaves no worker process; the
unfinished directory is refused by the training loader (naming what is missing and the
command that redoes it), never read as text; --overwrite then writes the shards an
uninterrupted prepare writes. SIGTERM and Ctrl-C end it with one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardlab import config
from shardlab.cli.data import data_main
from shardlab.data import feed, tokenizer, tokens, workers
from shardlab.errors import ConfigError

SETTINGS = ["--held-out-fraction", "0.1", "--workers", "1", "--shard-tokens", "500"]
# The command starts as a terminal's foreground command does: SIGINT at its default and not
# blocked. A child inherits an ignored or blocked SIGINT from the pytest worker, whatever an
# earlier test in that process left; in a whole-suite run the SIGINT case once went unheeded
# for 10 s (no "interrupted" line), as it would with either.
COMMAND = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM}); "
           "from shardlab.cli.data import data_main; sys.exit(data_main(sys.argv[1:]))")
# Each chunk (of 20) sleeps this long in the worker: a worker that outlived its parent, or
# finished its chunk before stopping, would still be there this long after the parent. The
# margin between the two is for a loaded machine: 1.5 s was missed once under a load of 10,
# 4 s once under a load of 5 (the suite's two workers beside other compiles), and 6 s once
# in a whole suite run with nothing beside it. Since then the workers are killed before
# anything else on the way out (workers.Pool.kill), and a miss says where the command was.
DELAY_S, GONE_WITHIN_S = 15.0, 10.0
# The same prepare without the command's imports (JAX): quicker to start, for SIGKILL.
LIBRARY = ("import sys; from shardlab.data import tokens; tokens.prepare(sys.argv[2], "
           "sys.argv[3], 'bytes', held_out_fraction=0.1, workers=1, shard_tokens=500)")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("interrupt") / "corpus.jsonl"
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(1280):  # 20 chunks of 64 documents: a minute of work when slowed
      f.write(json.dumps({"text": f"doc {i} " + "ab " * int(rng.integers(1, 40))}) + "\n")
  return path


def bpe(tmp_path: Path) -> str:
  pytest.importorskip("tokenizers")
  return str(tokenizer.train_bpe(["ab ab doc"] * 10, 260, tmp_path / "bpe" / "tokenizer.json"))


def children(pid: int) -> list[int]:
  found = []
  for entry in Path("/proc").iterdir():
    try:
      stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
      if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent
        found.append(int(entry.name))
    except (OSError, IndexError, ValueError):
      pass
  return found


def is_worker(pid: int) -> bool:
  try:
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
  except OSError:
    return False


def alive(pid: int) -> bool:
  """Running (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def launch(source: Path, out: Path, entry: str) -> subprocess.Popen:
  """A prepare in a subprocess, its worker slowed to interrupt it mid-way."""
  env = {**os.environ, workers.DELAY_ENV: str(DELAY_S)}
  return subprocess.Popen([sys.executable, "-c", entry, "prepare", str(source), str(out),
                           *SETTINGS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def under_way(proc: subprocess.Popen, out: Path) -> list[int]:
  """Once `proc` has its worker (and multiprocessing's resource tracker) and has written
  its first shard: the pids of its child processes."""
  deadline = time.monotonic() + 90
  while time.monotonic() < deadline and proc.poll() is None:
    kids = children(proc.pid)
    if len(kids) >= 2 and (out / "train-00000.npy").exists():
      return kids
    time.sleep(0.05)
  proc.kill()
  pytest.fail(f"the prepare did not get going: {proc.communicate()}")


def signal_state(pid: int) -> str:
  """The process's pending, blocked, ignored and caught signal masks (/proc), for a miss."""
  try:
    return " ".join(l.replace("\t", "") for l in Path(f"/proc/{pid}/status").read_text()
                    .splitlines() if l.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn",
                                                   "SigCgt")))
  except OSError:
    return "gone"


def wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
  deadline = time.monotonic() + seconds
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  return [p for p in pids if alive(p)]


def arrays(out: Path) -> dict:
  found = {p.name: np.load(p) for p in sorted(out.glob("*.npy"))}
  index = json.loads((out / tokens.INDEX).read_text())
  return {**found, "index": {k: v for k, v in index.items() if k != "source"}}


def test_sigkill_leaves_no_worker_and_a_refused_directory_that_overwrite_replaces(
    source, tmp_path, capsys):
  out = tmp_path / "out"
  proc = launch(source, out, LIBRARY)
  kids = under_way(proc, out)
  proc.kill()
  proc.wait()
  assert not wait_gone(kids, GONE_WITHIN_S), "a worker outlived the killed prepare"
  assert not (out / tokens.INDEX).exists() and list(out.glob("train-*.npy"))
  # The training loader refuses it, byte-level or with a tokenizer: never read as text.
  command = f"shardlab data prepare {source} {out} {' '.join(SETTINGS)} --overwrite"
  for cfg in (config.DataConfig(corpus=str(out)),
              config.DataConfig(corpus=str(out), tokenizer=bpe(tmp_path)),
              config.DataConfig(corpus=str(tmp_path))):  # also from a directory above it
    with pytest.raises(ConfigError) as refused:
      feed.feed(cfg, seed=0, global_batch=2, seq_len=8)
    assert f"{out} is an unfinished `shardlab data prepare` output: it has no index.json" \
        in str(refused.value) and str(refused.value).endswith(command)
  # Without --overwrite the command refuses to touch it, naming the flag.
  assert data_main(["prepare", str(source), str(out), *SETTINGS]) == 2
  assert "already holds an unfinished prepare (no index.json); pass --overwrite" in \
      capsys.readouterr().err
  assert data_main(["prepare", str(source), str(out), *SETTINGS, "--overwrite"]) == 0
  assert data_main(["prepare", str(source), str(tmp_path / "straight"), *SETTINGS]) == 0
  got, want = arrays(out), arrays(tmp_path / "straight")
  assert got.keys() == want.keys() and len(got) > 10 and got["index"] == want["index"]
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  names = lambda d: sorted(p.name for p in d.iterdir())
  assert names(out) == names(tmp_path / "straight")  # the marker gone, nothing left over
  # A finished one is replaced by --overwrite as well; a directory of other files never is.
  assert data_main(["prepare", str(source), str(out), *SETTINGS, "--overwrite"]) == 0
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  assert data_main(["prepare", str(source), str(tmp_path / "mine"), "--overwrite"]) == 2
  assert "not a prepared data directory" in capsys.readouterr().err
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_sigterm_and_ctrl_c_end_prepare_with_one_line(source, tmp_path):
  signals = (signal.SIGTERM, signal.SIGINT)
  outs = [tmp_path / f"out-{s.name}" for s in signals]
  procs = [launch(source, out, COMMAND) for out in outs]  # side by side: quicker
  for proc, out, signum in zip(procs, outs, signals):
    kids = under_way(proc, out)
    proc.send_signal(signum)  # the worker is stopped at once, not after its chunk
    left = wait_gone([k for k in kids if is_worker(k)], GONE_WITHIN_S)
    if left:  # say where the command was: still running (and what it printed), or gone
      running, masks = proc.poll() is None, signal_state(proc.pid)
      proc.kill()
      pytest.fail(f"the interrupted prepare left its worker running {GONE_WITHIN_S} s after "
                  f"{signum.name} (the command {'still running' if running else 'exited'}; "
                  f"its signals: {masks}; this process's SIGINT handler "
                  f"{signal.getsignal(signal.SIGINT)}): {proc.communicate()}")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stderr
    last = stderr.strip().splitlines()[-1]
    assert last == f"interrupted; {out} is unfinished: rerun with --overwrite to replace it"
    assert "Traceback" not in stderr and stdout == ""
    assert not wait_gone(kids, 10), "a child process outlived the interrupted prepare"
