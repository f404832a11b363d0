"""The seed question, "how many devices does it need", for `shardlab plan`: the fewest
devices of a target that a request fits on, and the mesh found, as an inline mesh."""

import dataclasses

from shardlab.errors import ConfigError
from shardlab.plan.training import planner as plan_lib
from shardlab.runtime import hardware


def fewest_devices(req: plan_lib.Request, any_strategy: bool = True):
  """The seed question, "how many devices does it need": the fewest devices of req.target
  on which some mesh fits (of req.strategy only, unless `any_strategy`), found by the
  planner's own min_devices (pipelines aside), and the request placed there: (request,
  row). Where nothing fits, (the request on 1 device, None): plan() then says what would."""
  mins, _ = plan_lib.min_devices(req, req.model_config(), hardware.get(req.target))
  row = mins["overall"]
  if not any_strategy:
    row = mins[req.strategy] and {**mins[req.strategy], "strategy": req.strategy}
  if row is None and mins["overall"] is not None:
    o = mins["overall"]
    raise ConfigError(f"strategy {req.strategy!r} fits on no count of {req.target} up to "
                      f"{plan_lib.MAX_DEVICES}; {o['strategy']} fits on {o['devices']} "
                      f"({o['mesh']}): leave --strategy out, or give --devices")
  if row is None:
    return dataclasses.replace(req, devices=1), None  # plan() names what it would take
  return dataclasses.replace(req, strategy=row["strategy"], devices=row["devices"],
                             mesh=inline_mesh(row["mesh"])), row


def inline_mesh(described: str) -> str:
  """An estimate's mesh ("data=1×2dcn fsdp=8 tensor=1") as an inline mesh
  ("data:1,dcn.data:2,fsdp:8,tensor:1")."""
  parts = []
  for item in described.split():
    axis, _, sizes = item.partition("=")
    ici, _, dcn = sizes.removesuffix("dcn").partition("×")
    parts += [f"{axis}:{ici}"] + ([f"dcn.{axis}:{dcn}"] if dcn else [])
  return ",".join(parts)
