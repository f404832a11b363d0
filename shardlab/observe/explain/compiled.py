"""Compiling a step for `explain`, with the SPMD partitioner's warnings caught
(observe/xla_log.py): what XLA logged is written back to stderr, so nothing is hidden, and
its involuntary rematerialisations become rows."""

import dataclasses

from shardlab.runtime import compile_only, jax_compat
from shardlab.observe.xla_log import RematWarning, captured, warnings


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
  # A persistent-cache hit would log no warnings, and its metadata may name another file.
  with jax_compat.fresh_compiles(), captured(err):
    compiled = compile_only.compile_lowered(lowered)
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
