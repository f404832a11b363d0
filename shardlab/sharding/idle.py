"""Mesh axes a strategy leaves idle: an axis of size > 1 that no rule of any table splits
over holds the same shards and computes the same values on each of its devices — n times
the hardware for one device's work (`--mesh cpu-8 --strategy fsdp` leaves tensor=2 idle).
It is not an error (a user may mean to measure it), so runs warn instead."""

from shardlab.sharding import rules as rules_lib


def used_axes(rules: rules_lib.Rules) -> set[str]:
  tables = (rules.params, rules.opt_state, rules.activations, rules.working or {})
  return {axis for table in tables for axes in table.values()
          for axis in rules_lib._axes(axes)}


def warnings(rules: rules_lib.Rules, mesh_shape: dict) -> list[str]:
  """One line per idle axis, naming the strategies that would use it."""
  out = []
  for axis, size in mesh_shape.items():
    if size > 1 and axis not in used_axes(rules):
      users = [name for name in rules_lib.STRATEGIES
               if axis in used_axes(rules_lib.strategy(name))]
      out.append(f"warning: mesh axis {axis} (size {size}) is split by no rule of strategy "
                 f"{rules.name}: its {size} devices hold the same shards and compute the "
                 f"same values. Drop it from the mesh, or use a strategy that splits over it"
                 f" ({', '.join(users) or 'none does; set a rule: --set rules.…'})")
  return out
