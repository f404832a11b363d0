"""Named device meshes: TOML presets in meshes/, inline strings, ICI × DCN sizes per axis.

An axis's full size is its ICI size (within a slice or node) times its DCN size (across
slices or hosts). Axis order is fixed, outermost first, so `tensor` — the most
communication-hungry axis — always lands on neighbouring devices.
"""

import dataclasses
import importlib.resources
import math
from pathlib import Path

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardlab.errors import ConfigError, read_toml, unknown

# `context`: context parallelism, the sequence split over devices for the whole model
# (docs/long-context.md).
AXES = ("data", "stage", "fsdp", "expert", "context", "tensor")
CORE_AXES = ("data", "fsdp", "tensor")  # always present, size 1 if not given


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  ici: dict  # axis -> size within a slice/node; one axis in ici or dcn may be -1
  dcn: dict  # axis -> size across slices/nodes
  name: str = "inline"
  accelerator: str | None = None

  @property
  def axis_names(self) -> tuple[str, ...]:
    given = set(self.ici) | set(self.dcn) | set(CORE_AXES)
    return tuple(a for a in AXES if a in given)

  def resolve(self, n_devices: int) -> "MeshSpec":
    """Fills the one -1 axis so the mesh covers `n_devices`; checks the product."""
    sizes = [(k, s) for part in (self.ici, self.dcn) for k, s in part.items()]
    known = math.prod(s for _, s in sizes if s != -1)
    if any(s == -1 for _, s in sizes):
      if n_devices % known:
        raise ConfigError(
            f"mesh {self.name!r}: the -1 axis cannot be inferred: {n_devices} devices are not "
            f"divisible by the product of the other axes ({known})")
      fill = lambda part: {k: (n_devices // known if s == -1 else s) for k, s in part.items()}
      return dataclasses.replace(self, ici=fill(self.ici), dcn=fill(self.dcn))
    if known != n_devices:
      raise ConfigError(
          f"mesh {self.name!r} has {known} devices ({self.describe()}) but {n_devices} are "
          f"available; change an axis size or set one axis to -1")
    return self

  def size(self, axis: str) -> int:
    return self.ici.get(axis, 1) * self.dcn.get(axis, 1)

  @property
  def shape(self) -> dict:
    return {a: self.size(a) for a in self.axis_names}

  @property
  def n_devices(self) -> int:
    return math.prod(self.shape.values())

  def describe(self) -> str:
    parts = []
    for a in self.axis_names:
      ici, dcn = self.ici.get(a, 1), self.dcn.get(a, 1)
      parts.append(f"{a}={ici}" + (f"×{dcn}dcn" if dcn != 1 else ""))
    return " ".join(parts)


def _check_axes(part: dict, where: str) -> dict:
  out = {}
  if not isinstance(part, dict):
    raise ConfigError(f"{where} must be a table of axis = size, got {part!r}; axes: "
                      f"{', '.join(AXES)}")
  for axis, size in part.items():
    if axis not in AXES:
      raise unknown(f"mesh axis in {where}", axis, AXES)
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ConfigError(f"{where}.{axis} must be a positive integer or -1, got {size!r}")
    out[axis] = size
  return out


def _validate(spec: MeshSpec) -> MeshSpec:
  ici = _check_axes(spec.ici, f"mesh {spec.name!r} ici")
  dcn = _check_axes(spec.dcn, f"mesh {spec.name!r} dcn")
  wild = [f"{where}.{a}" for where, part in (("ici", ici), ("dcn", dcn))
          for a, s in part.items() if s == -1]
  if len(wild) > 1:
    raise ConfigError(
        f"mesh {spec.name!r} has more than one -1 axis ({', '.join(wild)}); at most one size "
        f"can be inferred")
  return dataclasses.replace(spec, ici=ici, dcn=dcn)


def parse_inline(text: str) -> MeshSpec:
  """'data:1,fsdp:-1,tensor:2' (ICI sizes); 'dcn.data:2' puts a size on DCN."""
  ici, dcn = {}, {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    key, sep, value = item.partition(":")
    try:
      size = int(value)
    except ValueError:
      raise ConfigError(f"mesh {text!r}: expected axis:size, got {item!r}") from None
    part, axis = (dcn, key[4:]) if key.startswith("dcn.") else (ici, key)
    if axis in part:
      raise ConfigError(f"mesh {text!r}: axis {key!r} is given twice; give each axis once")
    part[axis] = size
  return _validate(MeshSpec(ici=ici, dcn=dcn, name=text))


def load(name: str) -> MeshSpec:
  """A preset name from meshes/, a TOML file path, or an inline 'axis:size,...' string."""
  if ":" in name:
    return parse_inline(name)
  path = Path(name)
  if path.suffix != ".toml":
    path = _preset_dir() / f"{name}.toml"
    if not path.is_file():
      raise unknown("mesh preset", name, presets())
  elif not path.is_file():
    raise ConfigError(f"mesh file {name!r} does not exist")
  data = read_toml(path, f"mesh file {name!r}")
  extra = set(data) - {"ici", "dcn", "accelerator", "description"}
  if extra:
    raise unknown(f"key in mesh file {path.name}", sorted(extra)[0],
                  ("ici", "dcn", "accelerator", "description"))
  if not isinstance(data.get("accelerator", ""), str):
    raise ConfigError(f"mesh file {name!r}: accelerator must be a string (a target name), "
                      f"got {data['accelerator']!r}")
  return _validate(MeshSpec(ici=data.get("ici", {}), dcn=data.get("dcn", {}), name=path.stem,
                            accelerator=data.get("accelerator")))


def _preset_dir():
  return importlib.resources.files("shardlab.meshes")


def presets() -> list[str]:
  return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".toml"))


def build(spec: MeshSpec, devices=None) -> Mesh:
  """A jax Mesh with Auto axes (sharding is steered by with_sharding_constraint)."""
  devices = list(jax.devices() if devices is None else devices)
  spec = spec.resolve(len(devices))
  names = spec.axis_names
  ici = [spec.ici.get(a, 1) for a in names]
  dcn = [spec.dcn.get(a, 1) for a in names]
  by_slice = len({getattr(d, "slice_index", 0) for d in devices}) > 1
  granules = (len({d.slice_index for d in devices}) if by_slice
              else len({d.process_index for d in devices}))
  if math.prod(dcn) > 1 and granules > 1:
    if granules != math.prod(dcn):
      kind = "slices" if by_slice else "processes"
      raise ConfigError(
          f"mesh {spec.name!r}: its DCN sizes multiply to {math.prod(dcn)} but the devices "
          f"span {granules} {kind}; DCN axes must cover the {kind} exactly")
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                process_is_granule=not by_slice)
  elif math.prod(dcn) > 1:
    # One process, no slices (simulated devices): DCN is only a label here, so the outer
    # (DCN) block of each axis is laid out before its inner (ICI) block.
    grid = np.array(devices).reshape(dcn + ici)
    n = len(names)
    grid = grid.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
    grid = grid.reshape([d * i for d, i in zip(dcn, ici)])
  else:
    grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def make(name: str, devices=None) -> Mesh:
  """A jax Mesh from a preset name, TOML file or inline string ('data:2,fsdp:-1')."""
  return build(load(name), devices)
