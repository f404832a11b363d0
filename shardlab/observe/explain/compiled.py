"""Compiling a step for `explain`, with the SPMD partitioner's warnings caught.

XLA logs "[SPMD] Involuntary full rematerialization ..." from C++ straight to file
descriptor 2 while it partitions: nothing in Python sees it, and in a long log nobody does.
The compile here points fd 2 at a temporary file for its duration, then writes what came
out back to the real stderr (so nothing is hidden) and parses the warnings.
"""

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

from shardlab.observe import hlo_source

_REMAT = re.compile(r"Involuntary full rematerialization.*?(?=\n[EWIF]\d{4} |\Z)", re.S)
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
def captured_stderr(out: list):
  """Collects what is written to fd 2 (C++ logging included) into `out[0]`."""
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
      sys.stderr.write(text)  # passed on: the capture only reads it


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


@dataclasses.dataclass(frozen=True)
class Compiled:
  text: str  # the optimised HLO
  debug: str  # the lowered module's text with source locations, or ""
  warnings: list  # RematWarning
  arguments: list  # (path, shape, sharding) of each argument leaf
  memory_bytes: int | None  # XLA's peak per device (arguments + outputs − aliased + temps)


def compiled_text(program, args) -> Compiled:
  """What explain reads of `program`: a jitted function (compiled here, its warnings
  caught), a Lowered (compiled here), a Compiled (its warnings were printed back then) or
  HLO text (no memory figure)."""
  if isinstance(program, str):
    return Compiled(program, "", [], [], None)
  if hasattr(program, "lower"):  # a jitted function (or a shardlab step)
    lowered = program.lower(*args)
  elif hasattr(program, "compile"):  # a Lowered
    lowered = program
  else:
    return Compiled(program.as_text(), "", [], arguments(program), memory(program))
  err: list[str] = []
  with captured_stderr(err):
    compiled = lowered.compile()
  return Compiled(compiled.as_text(), lowered.as_text(debug_info=True), warnings(err[0]),
                  arguments(compiled), memory(compiled))


def memory(compiled) -> int | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes +
          m.temp_size_in_bytes)


def arguments(compiled) -> list:
  """(key path, shape, sharding) of each positional argument leaf of a compiled program."""
  import jax
  try:
    infos = jax.tree_util.tree_flatten_with_path(compiled.args_info[0])[0]
    shardings = jax.tree.leaves(compiled.input_shardings[0])
  except (AttributeError, TypeError, IndexError):
    return []
  if len(infos) != len(shardings):
    return []
  return [(jax.tree_util.keystr(p), tuple(i.shape), s)
          for (p, i), s in zip(infos, shardings)]


def remat_row(w: RematWarning, ctx, row_type):
  """A row for a warning: the rematerialisation gathers the whole tensor on every device."""
  from shardlab.observe import hlo
  import shardlab.observe.explain.verdicts as verdicts
  arrays = hlo.arrays(w.shape)
  nbytes = int(sum(hlo.DTYPE_BYTES[d] * _prod(s) for d, s in arrays))
  axes = tuple(ctx.mesh.axis_names)
  src = str(w.frames[0]) if w.frames else w.instruction
  return row_type("rematerialization", axes, nbytes, 1, ctx.seconds("all-gather", nbytes, axes),
                  verdicts.REMAT, src, "", False, "", w.shape or "?",
                  f"{w.source} → {w.target}", verdicts.hint(verdicts.REMAT, src, []),
                  w.instruction)


def _prod(shape) -> int:
  n = 1
  for s in shape:
    n *= s
  return n
