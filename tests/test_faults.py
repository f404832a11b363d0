"""One process, faults of the filesystem and the input: nothing blocks, every refusal is an
exit code and a message naming the value. Cases that could hang run as subprocesses under a
deadline the test sets."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab import config
from shardlab.cli import generate as generate_cli
from shardlab.cli import inspect as inspect_cli
from shardlab.cli import train as train_cli
from shardlab.errors import ConfigError
from shardlab.data import corpus as data
from shardlab.testing import fast_compile
from test_checkpoint import SMALL

ROOT = Path(__file__).resolve().parents[1]


def train_args(*extra: str, steps: int = 2) -> list[str]:
  sets = [a for s in SMALL + [f"train.steps={steps}"] for a in ("--set", s)]
  return [*sets, "--quiet", "--sample-tokens", "0", *extra]


def train_process(args: list[str], timeout: float, mounts: str = "") -> tuple[int, str]:
  """train.py as a subprocess, run after the shell commands `mounts` in a fresh user and
  mount namespace (unshare -rm) if given; (exit code, output)."""
  cmd = [sys.executable, str(ROOT / "train.py"), "--simulate-devices", "8", *args]
  if mounts:
    cmd = ["unshare", "-rm", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast_compile.only(os.environ)}
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"train.py did not exit within {timeout} s:\n{e.stdout}\n{e.stderr}")
  return out.returncode, out.stdout + out.stderr


def needs_mount_namespace() -> None:
  if shutil.which("unshare") is None or subprocess.run(
      ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
    pytest.skip("needs unshare -rm (user namespaces) to mount a read-only or full directory")


def test_corpus_refuses_special_files_and_reads_at_most_max_bytes(tmp_path, capsys):
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  code, out = train_process(train_args("--set", f"data.corpus={fifo}"), timeout=120)
  assert code == 2, out  # reading it would block until a writer came: forever
  assert (f"error: data.corpus '{fifo}' is a FIFO (named pipe), not a regular file: reading "
          f"it could block or never end") in out

  assert train_cli.train_main(train_args("--set", "data.corpus=/dev/zero")) == 2
  assert "data.corpus '/dev/zero' is a character device, not a regular file" in \
      capsys.readouterr().err
  with pytest.raises(ConfigError, match=r"data.corpus is empty \(''\)"):
    config.DataConfig(corpus="")
  with pytest.raises(ConfigError, match=r"data.max_bytes must be >= 1, got 0"):
    config.DataConfig(max_bytes=0)

  # 64 GiB that take no disk (sparse): read whole first, this would not fit in memory.
  huge = tmp_path / "texts" / "huge.txt"
  huge.parent.mkdir()
  with open(huge, "wb") as f:
    f.truncate(64 * 2**30)
  os.mkfifo(huge.parent / "pipe")  # in a directory, special files are skipped
  start = time.monotonic()
  corpus = data.load(config.DataConfig(corpus=str(huge.parent), max_bytes=100_000), 32)
  assert len(corpus.train) + len(corpus.held_out) == 100_000
  assert time.monotonic() - start < 10


def test_unwritable_checkpoint_dir_is_refused_before_training(tmp_path, capsys):
  (tmp_path / "file").write_text("not a directory")
  assert train_cli.train_main(train_args("--checkpoint-dir", str(tmp_path / "file" / "c"))) == 2
  assert (f"error: --checkpoint-dir '{tmp_path}/file/c' cannot be created (Not a directory)"
          in capsys.readouterr().err)
  assert train_cli.train_main(train_args("--checkpoint-dir", "")) == 2
  assert "checkpoint.dir is empty ('')" in capsys.readouterr().err

  ckpt = tmp_path / "readonly"
  ckpt.mkdir()
  if os.geteuid() != 0:  # root writes through permissions: there, a read-only mount
    ckpt.chmod(0o555)
    code, out = train_process(train_args("--checkpoint-dir", str(ckpt)), timeout=120)
  else:
    needs_mount_namespace()
    code, out = train_process(
        train_args("--checkpoint-dir", str(ckpt)), timeout=120,
        mounts=f"mount --bind {ckpt} {ckpt} && mount -o remount,bind,ro {ckpt}")
  assert code == 2, out
  assert f"error: --checkpoint-dir '{ckpt}' is not writable (" in out
  assert "compiled the train step" not in out  # refused before any work


@pytest.mark.slow
def test_a_failed_async_save_ends_the_run_with_an_error(tmp_path):
  """A disk that fills up during the async save of step 20 (a 300 KiB tmpfs): the run ends
  with exit 2 at the next log step, not at the next save 20 steps on, and not held by
  Orbax's threads (they waited 20 min for a step directory that was never made)."""
  needs_mount_namespace()
  disk, metrics = tmp_path / "disk", tmp_path / "metrics.jsonl"
  disk.mkdir()
  code, out = train_process(
      train_args("--set", "checkpoint.every=20", "--set", "train.log_every=1",
                 "--metrics-file", str(metrics), "--checkpoint-dir", str(disk / "c"),
                 steps=1000),
      timeout=240, mounts=f"mount -t tmpfs -o size=300k tmpfs {disk}")
  assert code == 2, out[-3000:]
  assert f"error: could not write checkpoint step 20 to {disk}/c (" in out
  assert "No space left on device" in out
  assert "no complete checkpoint was written. Free space or fix the directory" in out
  logged = len(metrics.read_text().splitlines())
  print(f"the save of step 20 failed; the run ended after step {logged}")
  assert 20 <= logged < 40


def test_inspect_zero_devices_and_a_prompt_that_is_not_utf8(capsys):
  with pytest.raises(SystemExit) as got:
    inspect_cli.inspect_main(["--devices", "0"])
  assert got.value.code == 2
  assert "error: argument --devices: must be an integer >= 1, got '0'" in capsys.readouterr().err
  # What Python makes of the argument bytes b"def \xff": an undecodable byte, escaped.
  prompt = b"def \xff".decode("utf-8", "surrogateescape")
  assert generate_cli.generate_main(["--checkpoint", "nowhere", "--prompt", prompt]) == 2
  assert ("error: the prompt is not valid UTF-8 text: byte 0xff at position 4 (b'def \\xff'); "
          "give UTF-8 text") in capsys.readouterr().err
