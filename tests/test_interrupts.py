"""Ctrl-C at any moment of `train.py` exits cleanly: exit 130 and one line saying what was
saved; no traceback, no native crash (XLA may still be compiling on its own threads)."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def interrupted(wait_for: str | None, delay: float, *extra: str) -> tuple[int, str]:
  """Runs `train.py --model tiny --steps 50` on a terminal (where the compile shows as a
  live line), sends SIGINT `delay` s after `wait_for` appears (or after the start)."""
  master, slave = pty.openpty()
  # Without the suite's fast-compile flags: the delays are set for a run that compiles as a
  # user's does (with them, 3 s after the start already fell after the first step).
  proc = subprocess.Popen([sys.executable, "train.py", "--model", "tiny", "--steps", "50",
                           "--sample-tokens", "0", *extra], stdin=slave, stdout=slave,
                          stderr=slave, cwd=ROOT, start_new_session=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
  os.close(slave)
  text, sent_at, deadline = b"", None, time.monotonic() + 240
  try:
    while time.monotonic() < deadline:
      if sent_at is None and (wait_for is None or wait_for.encode() in text):
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        sent_at = time.monotonic()
      if not select.select([master], [], [], 0.2)[0]:
        if proc.poll() is not None:
          break
        continue
      try:
        chunk = os.read(master, 65536)
      except OSError:  # the terminal closed: the process is gone
        break
      text += chunk
    code = proc.wait(timeout=30)
  finally:
    proc.kill()
    os.close(master)
  out = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text.decode(errors="replace"))
  assert sent_at is not None, f"never saw {wait_for!r}:\n{out}"
  return code, out


def clean(code: int, out: str) -> None:
  assert code == 130, out
  for crash in ("Traceback", "Fatal Python error", "pure virtual method", "Segmentation",
                "LLVM ERROR"):
    assert crash not in out, out


def test_ctrl_c_while_compiling_exits_130_saying_what_was_saved(tmp_path):
  code, out = interrupted("compiling the train step", 0.5, "--checkpoint-dir",
                          str(tmp_path / "ckpt"))
  clean(code, out)
  assert f"interrupted (Ctrl-C): no checkpoint was saved in {tmp_path / 'ckpt'}" in out
  assert list((tmp_path / "ckpt").iterdir()) == []  # the directory's lock is released


@pytest.mark.parametrize("delay", [0.5, 3.0], ids=["importing", "starting"])
def test_ctrl_c_while_starting_exits_130(delay):
  code, out = interrupted(None, delay)
  clean(code, out)
  assert "interrupted (Ctrl-C)" in out and "nothing was saved" in out
