"""What a compiled program communicates: collectives per kind and mesh axes, and bytes per
device of arrays. The parser is shardlab's own (shardlab.observe.hlo)."""

import jax
from jax.sharding import Mesh

from shardlab.observe import hlo, hlo_groups
from shardlab.runtime import compile_only

KINDS = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
         "all_reduce": "all-reduce", "all_to_all": "all-to-all",
         "collective_permute": "collective-permute"}


def _hlo_text(program) -> str:
  if isinstance(program, str):
    return program
  if hasattr(program, "compile") and not hasattr(program, "as_text"):
    program = compile_only.compile_lowered(program)  # a Lowered
  if hasattr(program, "lower"):
    raise TypeError("pass a compiled or lowered program (jit(f).lower(*args).compile()), "
                    "or use assert_collectives(f, *args)")
  return program.as_text()


def collectives(program, mesh: Mesh | None = None) -> dict[str, dict]:
  """{kind: {"count", "bytes", "axes": {axes: bytes}}} per device per execution of a
  compiled (or lowered) program, or its HLO text. Kinds absent from the program are absent
  here. `axes` (tuples of mesh axis names the groups span) needs the mesh."""
  out: dict[str, dict] = {}
  for op in hlo.collective_ops(_hlo_text(program)):
    runs = max(op.executions, 1)
    entry = out.setdefault(op.op, {"count": 0, "bytes": 0, "axes": {}})
    entry["count"] += runs
    entry["bytes"] += runs * op.bytes
    if mesh is not None:
      axes = hlo_groups.mesh_axes(op.groups, mesh)
      entry["axes"][axes] = entry["axes"].get(axes, 0) + runs * op.bytes
  return out


def assert_collectives(program, *args, mesh: Mesh, forbid=(), **required) -> dict:
  """Asserts the program's collectives: `all_gather={"fsdp"}` needs an all-gather whose
  groups span exactly the fsdp axis; `forbid=("all-reduce",)` allows none of a kind.
  `program` is compiled/lowered, or a jitted function called with `args`. Returns the
  collectives found."""
  if args or hasattr(program, "lower"):
    program = compile_only.compile_lowered(program.lower(*args))
  found = collectives(program, mesh)
  problems = []
  for key, axes in required.items():
    kind = KINDS.get(key)
    if kind is None:
      raise TypeError(f"unknown collective {key!r}; valid: {', '.join(KINDS)}")
    want = tuple(a for a in mesh.axis_names if a in set(axes))
    if want not in found.get(kind, {}).get("axes", {}):
      problems.append(f"no {kind} over {want or 'no axis'}")
  for kind in forbid:
    kind = KINDS.get(kind, kind)
    if kind in found:
      problems.append(f"{found[kind]['count']} {kind}(s) where none may be, over "
                      f"{sorted(found[kind]['axes'])}")
  if problems:
    seen = {k: sorted(v["axes"]) for k, v in found.items()} or "none"
    raise AssertionError("; ".join(problems) + f" (collectives found, by mesh axes: {seen})")
  return found


def bytes_per_device(tree) -> dict:
  """{device: bytes it holds} over every array leaf of `tree` (each shard counted where it
  lives)."""
  out: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
