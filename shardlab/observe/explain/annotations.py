"""The sharding annotations a traced program asked for, and the Python lines that asked.

Read from the lowered module's debug text (`lowered.as_text(debug_info=True)`): each
`sdy.sharding_constraint` names its mesh axes per dim, and its `loc(...)` resolves through
named and call-site locations to source lines. The compiled module keeps none of this, so
the line of the *other* annotation in a disagreement comes from here.
"""

import dataclasses
import math
import re

from shardlab.observe.hlo_source import Frame, user_line

_CONSTRAINT = re.compile(r"sdy\.sharding_constraint\s+%[\w#.]+\s+<@?\w*,\s*\[(.*?)\]>\s*:\s*"
                         r"tensor<([^>]*)>\s*loc\((#loc\d*)\)")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
_FILE = re.compile(r'^"([^"]+)":(\d+):\d+')
_NAMED = re.compile(r'^"([^"]*)"\((#loc\d*)\)$')
_CALLSITE = re.compile(r"^callsite\((#loc\d*) at (#loc\d*)\)$")
_DIM = re.compile(r"\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Annotation:
  shape: tuple[int, ...]  # global
  axes: tuple[tuple[str, ...], ...]  # mesh axes per dim
  frames: tuple[Frame, ...]  # innermost first, libraries left out
  op_name: str

  def local_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(n // math.prod(sizes.get(a, 1) for a in axes)
                 for n, axes in zip(self.shape, self.axes))

  def spec_text(self) -> str:
    return "(" + ", ".join(",".join(a) or "-" for a in self.axes) + ")"


class _Locations:
  def __init__(self, text: str):
    self.defs = dict(_LOC_DEF.findall(text))
    self.memo: dict[str, tuple[list[Frame], str]] = {}

  def resolve(self, ref: str, depth: int = 0) -> tuple[list[Frame], str]:
    """(frames innermost first, the innermost op name) of a #loc reference."""
    if ref in self.memo or depth > 200:
      return self.memo.get(ref, ([], ""))
    body = self.defs.get(ref, "")
    frames, name = [], ""
    if m := _FILE.match(body):
      frames = [Frame(m.group(1), int(m.group(2)))]
    elif m := _NAMED.match(body):
      frames, inner = self.resolve(m.group(2), depth + 1)
      # The outermost name with a path is the op's (`jit(f)/transpose(jvp())/...`); the
      # inner ones are the Python functions it was traced in.
      name = m.group(1) if "/" in m.group(1) or not inner else inner
      if frames and "/" not in m.group(1) and not frames[0].function:
        frames = [dataclasses.replace(frames[0], function=m.group(1))] + frames[1:]
    elif m := _CALLSITE.match(body):
      callee, name = self.resolve(m.group(1), depth + 1)
      frames = callee + self.resolve(m.group(2), depth + 1)[0]
    self.memo[ref] = (frames, name)
    return frames, name


def annotations(debug_text: str) -> list[Annotation]:
  """Every sharding constraint of the forward pass (JAX mirrors each in the backward pass at
  the same line; those are left out)."""
  locs = _Locations(debug_text)
  out = []
  for dims, tensor, ref in _CONSTRAINT.findall(debug_text):
    frames, name = locs.resolve(ref)
    if "transpose(" in name:
      continue
    shape = tuple(int(x) for x in tensor.split("x")[:-1] if x.isdigit())
    axes = tuple(tuple(a.strip().strip('"') for a in d.split(",") if a.strip())
                 for d in _DIM.findall(dims))
    out.append(Annotation(shape, axes, tuple(f for f in frames if not f.library), name))
  return out


def disagreeing(notes: list[Annotation], shapes: list[tuple[int, ...]],
                sizes: dict[str, int]) -> list[Annotation]:
  """The annotations of an array one of `shapes` could be (its global or per-device size),
  when they ask for more than one sharding: the two (or more) that disagree."""
  # XLA reshapes what an all-to-all moves, so sizes are compared, not shapes.
  counts = {math.prod(s) for s in shapes} | {sum(math.prod(s) for s in shapes) // 2}
  # The step's own constraints (gradients placed where the optimizer wants them) are not
  # the user's to change: only annotations made from the user's lines count.
  mine = [a for a in notes if a.frames and not user_line(a.frames).toolkit
          and counts & {math.prod(a.shape), math.prod(a.local_shape(sizes))}]
  if len({a.axes for a in mine}) < 2:
    return []
  out, seen = [], set()
  for a in mine:
    if (a.axes, a.frames[:1]) not in seen:
      seen.add((a.axes, a.frames[:1]))
      out.append(a)
  return out
