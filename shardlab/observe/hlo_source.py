"""Where in Python each HLO instruction came from: the op metadata JAX records.

A compiled module's text carries the op name (`jit(step)/transpose(jvp())/while/body/...`:
`transpose(` marks the backward pass) and a `stack_frame_id` into tables printed after the
module header (FileNames, FunctionNames, FileLocations, StackFrames). A frame's printed
`parent_frame_id` is one more than its parent's id (1: no parent). Ops traced inside a nested
jaxpr (a scan body, a remat) repeat the body's frames once per nesting level before the outer
call stack goes on; the innermost frames are the op's own. Older XLA prints
`source_file=` / `source_line=` in the metadata instead; both are read.
"""

import dataclasses
import pathlib
import re

_TABLE = r"^{}\n((?:\d+ .*\n?)*)"
_METADATA = re.compile(r"metadata=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_FIELD = re.compile(r"(\w+)=(\d+)")
PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # shardlab/


@dataclasses.dataclass(frozen=True)
class Frame:
  file: str
  line: int
  function: str = ""

  def __str__(self) -> str:
    return f"{short_path(self.file)}:{self.line}"

  @property
  def library(self) -> bool:
    """Third-party or standard library code (jax, flax, optax): never the answer."""
    return "site-packages" in self.file or "/lib/python3" in self.file

  @property
  def toolkit(self) -> bool:
    """shardlab's own machinery (step, constrain, building blocks), not a model's code."""
    return pathlib.Path(self.file).resolve().is_relative_to(PACKAGE)


def short_path(path: str) -> str:
  """A path relative to the working directory where it lies under it."""
  try:
    return str(pathlib.Path(path).resolve().relative_to(pathlib.Path.cwd()))
  except ValueError:
    return path


@dataclasses.dataclass(frozen=True)
class Source:
  op_name: str
  frames: tuple[Frame, ...]  # innermost first, library frames left out

  @property
  def backward(self) -> bool:
    return "transpose(" in self.op_name

  @property
  def line(self) -> Frame | None:
    """The user's line: the innermost frame outside shardlab's machinery, else the innermost
    one of any code but libraries. Past a `lower` frame lies the code that asked for the
    compile, not the traced code: an op the step itself makes (the gradient norm) is
    attributed to the step's line, not to the caller of `.lower`."""
    return user_line(self.frames)

  @property
  def via(self) -> Frame | None:
    """The innermost toolkit frame when it is not `line` (e.g. shardlab/parallel/dot.py)."""
    return self.frames[0] if self.frames and self.frames[0] != self.line else None


def _table(text: str, name: str) -> dict[int, str]:
  m = re.search(_TABLE.format(name), text, re.M)
  if not m:
    return {}
  return {int(k): v for k, _, v in (line.partition(" ") for line in m.group(1).splitlines())}


class SourceMap:
  """The metadata of one compiled module's text."""

  def __init__(self, hlo_text: str):
    self.files = {k: v.strip('"') for k, v in _table(hlo_text, "FileNames").items()}
    self.functions = {k: v.strip('"') for k, v in _table(hlo_text, "FunctionNames").items()}
    self.locations = {k: dict((a, int(b)) for a, b in _FIELD.findall(v))
                      for k, v in _table(hlo_text, "FileLocations").items()}
    self.stack = {k: dict((a, int(b)) for a, b in _FIELD.findall(v))
                  for k, v in _table(hlo_text, "StackFrames").items()}

  def frames(self, frame_id: int) -> tuple[Frame, ...]:
    out, seen = [], set()
    while frame_id in self.stack and frame_id not in seen:
      seen.add(frame_id)
      entry = self.stack[frame_id]
      loc = self.locations.get(entry.get("file_location_id", 0), {})
      frame = Frame(self.files.get(loc.get("file_name_id", 0), "?"), loc.get("line", 0),
                    self.functions.get(loc.get("function_name_id", 0), ""))
      if not frame.library:
        out.append(frame)
      frame_id = entry.get("parent_frame_id", 0) - 1
    return tuple(out)

  def source(self, attrs: str) -> Source:
    """The Source of an instruction from its attribute text."""
    m = _METADATA.search(attrs)
    meta = m.group(1) if m else ""
    name = _OP_NAME.search(meta)
    frames: tuple[Frame, ...] = ()
    fid = _FRAME_ID.search(meta)
    if fid:
      frames = self.frames(int(fid.group(1)))
    elif _SOURCE.search(meta):
      file, line = _SOURCE.search(meta).groups()
      frames = tuple(f for f in (Frame(file, int(line)),) if not f.library)
    return Source(name.group(1) if name else "", frames)


def user_line(frames: tuple[Frame, ...]) -> Frame | None:
  """See Source.line."""
  for f in frames:
    if f.function.endswith("lower"):
      return frames[0]
    if not f.toolkit:
      return f
  return frames[0] if frames else None


def loop_call(frames: tuple[Frame, ...]) -> Frame | None:
  """For an op inside a nested jaxpr: the first outer frame after the body's repeated frames
  (where the scan or loop was called), None if the frames do not repeat."""
  if not frames:
    return None
  repeats = [i for i, f in enumerate(frames) if i and f == frames[0]]
  if not repeats:
    # A backward body's frames do not repeat the same way: the caller of a scan function.
    scans = [i for i, f in enumerate(frames) if f.function.split(".")[-1] == "scan"]
    rest = frames[scans[0] + 1:] if scans else ()
    own = [f for f in rest if not f.toolkit]
    return own[0] if own else None
  # The body is frames[:repeats[0]]; skip every repetition of it.
  body, i = repeats[0], repeats[-1]
  rest = frames[i + body:]
  own = [f for f in rest if not f.toolkit]
  return own[0] if own else (rest[0] if rest else None)
