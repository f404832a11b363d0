"""What XLA's C++ code logs while it compiles, caught and read.

The SPMD partitioner logs "[SPMD] Involuntary full rematerialization ..." straight to file
descriptor 2: nothing in Python sees it, each is a screenful of HLO, and a run or a layout
search prints one per compile. `captured` points fd 2 at a temporary file for a compile;
`RematWarning`s are parsed from what came out, and a run says them in one line that names
its layout (`summary`), keeping the partitioner's text in its run dir (`keep`).
"""

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path

from shardlab.observe import hlo_source

# One log record: from its "W1126 09:29:32.018568 15716 file.cc:656] " prefix up to the next
# record or the end (an HLO operation in the message may span lines).
_RECORD = r"(?:^[EWIF]\d{4} [^\n]*?\] )?\[SPMD\] Involuntary full rematerialization"
_REMAT = re.compile(_RECORD + r".*?(?:\n(?=[EWIF]\d{4} )|\Z)", re.S | re.M)
_FROM_TO = re.compile(r"from sharding (\{.*?\}) to (\{.*?\})")
_OPERATION = re.compile(r"HLO operation:?\s*%?([\w.\-]+)\s*=\s*(\w+\[[\d,]*\])")


@dataclasses.dataclass(frozen=True)
class RematWarning:
  text: str
  source: str  # "sharding → sharding"
  target: str
  instruction: str
  shape: str  # the HLO type text of the tensor rematerialised, "" if not printed
  frames: tuple  # hlo_source.Frame, innermost first


@contextlib.contextmanager
def captured(out: list, echo: bool = True):
  """Collects what is written to fd 2 (C++ logging included) into `out[0]`; with `echo`, it
  is written back to the real stderr afterwards (the capture only reads it)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as f:
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      text = f.read().decode(errors="replace")
      out.append(text)
      if echo:
        sys.stderr.write(text)


def split(text: str) -> tuple[list[RematWarning], str]:
  """(the rematerialisation warnings in `text`, the rest of it)."""
  return warnings(text), _REMAT.sub("", text)


def warnings(text: str) -> list[RematWarning]:
  out = []
  for m in _REMAT.finditer(text):
    body = m.group(0)
    ft, op = _FROM_TO.search(body), _OPERATION.search(body)
    line = re.search(r'source_file="([^"]+)"\s+source_line=(\d+)', body)
    frames = (hlo_source.Frame(line.group(1), int(line.group(2))),) if line else ()
    out.append(RematWarning(" ".join(body.split())[:400], ft.group(1) if ft else "?",
                            ft.group(2) if ft else "?", op.group(1) if op else "",
                            op.group(2) if op else "", frames))
  return out


def summary(found: list[RematWarning], layout: str, log: str | None) -> str:
  """One line for a compile's rematerialisations: what, under which layout, where to look."""
  shapes = sorted({w.shape or w.instruction or "?" for w in found})
  where = f"; XLA's text is in {log}" if log else ""
  return (f"warning: under {layout} XLA's SPMD partitioner reshards {len(found)} tensor(s) "
          f"by gathering them whole on every device ({', '.join(shapes[:3])}"
          f"{', ...' if len(shapes) > 3 else ''}): extra memory and traffic each step. "
          f"`shardlab explain` with this layout shows where{where}")


def keep(text: str, run_dir: str | None) -> str | None:
  """Appends XLA's captured text to RUN_DIR/xla.log; its path, or None without a run dir."""
  if not run_dir or not text:
    return None
  path = Path(run_dir) / "xla.log"
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    f.write(text)
  return str(path)


@contextlib.contextmanager
def quiet_remat(layout: str, run_dir: str | None, say):
  """Around a compile: XLA's rematerialisation warnings become one `say(...)` line naming
  `layout` (the partitioner's text kept in the run dir); anything else it logs passes on."""
  out: list[str] = []
  try:
    with captured(out, echo=False):
      yield
  except BaseException:
    sys.stderr.write(out[0] if out else "")  # a failed compile's log is all passed on
    raise
  found, rest = split(out[0])
  if rest:
    sys.stderr.write(rest)
  if found:
    say(summary(found, layout, keep(out[0], run_dir)))
