"""Safetensors files without torch: lazy box reads through a memory map, streamed writes.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name
to its dtype, shape and byte range, then the raw little-endian data. Reading through
np.memmap touches only the pages a slice needs, so one device's shard of one tensor costs
that shard's bytes, never the file's. bf16 comes from ml_dtypes (numpy has none).
"""

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from shardlab.errors import ConfigError
from shardlab.runtime import units

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}
CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 * units.MiB  # a header larger than this is not a safetensors file


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: Path
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int  # absolute byte offsets in `file`
  end: int


def _header(path: Path) -> dict[str, TensorInfo]:
  """Every tensor the file's header lists, each checked against the file's size before
  anything is read or allocated: a truncated file, or a header claiming bytes the file does
  not hold, is a ConfigError naming the file and the tensor."""
  try:
    file_bytes = path.stat().st_size
    with open(path, "rb") as f:
      raw = f.read(8)
      size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
      if not 0 < size <= min(_MAX_HEADER, file_bytes - 8):
        raise ConfigError(f"{path} is not a safetensors file: header length {size} does not "
                          f"fit the file's {file_bytes} bytes (valid: 1..{_MAX_HEADER}, "
                          f"within the file); the file is damaged or truncated")
      header = json.loads(f.read(size))
  except OSError as e:
    raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from None
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise ConfigError(f"{path} is not a safetensors file (header: {e})") from None
  if not isinstance(header, dict):
    raise ConfigError(f"{path} is not a safetensors file: its header is not a JSON object")
  base = 8 + size
  return {name: _tensor(path, name, entry, base, file_bytes - base)
          for name, entry in header.items() if name != "__metadata__"}


def _tensor(path: Path, name: str, entry, base: int, data_bytes: int) -> TensorInfo:
  """One header entry as a TensorInfo, or a ConfigError naming the file, tensor and field."""
  where = f"tensor {name!r} in {path}"
  if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
    raise ConfigError(f"{where}: header entry {entry!r} is not an object with dtype, shape "
                      f"and data_offsets; the file is damaged")
  code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
  if not isinstance(code, str) or code not in DTYPES:
    raise ConfigError(f"{where} has dtype {code!r}; supported: {', '.join(DTYPES)}")
  natural = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
  if not isinstance(shape, list) or not all(map(natural, shape)):
    raise ConfigError(f"{where}: shape {shape!r} is not a list of sizes >= 0; the file is "
                      f"damaged")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(natural, offsets))
          and offsets[0] <= offsets[1] <= data_bytes):
    raise ConfigError(f"{where}: data_offsets {offsets!r} is not a byte range within the "
                      f"file's {data_bytes} data bytes; the file is damaged or truncated")
  dtype, (start, end) = DTYPES[code], offsets
  if end - start != math.prod(shape) * dtype.itemsize:
    raise ConfigError(f"{where}: byte range {start}..{end} does not hold shape "
                      f"{tuple(shape)} of {code}; the file is damaged")
  return TensorInfo(path, dtype, tuple(shape), base + start, base + end)


def _listing(directory: Path) -> str:
  return ", ".join(sorted(p.name for p in directory.iterdir())[:10]) or "nothing"


class Reader:
  """Every tensor of a Hugging Face weights directory (one file, or shards + index)."""

  def __init__(self, directory: str | Path):
    directory = Path(directory)
    self.tensors: dict[str, TensorInfo] = {}
    if (directory / INDEX_FILE).exists():
      files = self._indexed_files(directory)
    elif (directory / SINGLE_FILE).exists():
      files = [directory / SINGLE_FILE]
    else:
      found = _listing(directory)
      hint = (" (only .safetensors weights are read: convert .bin files with transformers' "
              "save_pretrained(..., safe_serialization=True))" if ".bin" in found else "")
      raise ConfigError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                        f"(found: {found}){hint}")
    for path in files:
      self.tensors.update(_header(path))
    self._maps: dict[Path, np.memmap] = {}

  def _indexed_files(self, directory: Path) -> list[Path]:
    try:
      weight_map = json.loads((directory / INDEX_FILE).read_bytes())["weight_map"]
    except OSError as e:
      raise ConfigError(f"{directory / INDEX_FILE} cannot be read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
      raise ConfigError(f"{directory / INDEX_FILE} is not a safetensors index "
                        f"({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()):
      raise ConfigError(f"{directory / INDEX_FILE}: weight_map must map each tensor name to "
                        f"a file name in {directory}, got {str(weight_map)[:200]}")
    files = sorted({directory / name for name in weight_map.values()})
    missing = [p.name for p in files if not p.is_file()]
    if missing:
      raise ConfigError(f"{directory / INDEX_FILE} names shard file(s) that do not exist: "
                        f"{', '.join(missing)}")
    return files

  def read(self, name: str, box: tuple[slice, ...] | None = None) -> np.ndarray:
    """A copy of tensor `name`, or of the box of it given by unit-step slices."""
    info = self.tensors[name]
    if info.file not in self._maps:
      self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
    data = self._maps[info.file][info.start:info.end].view(info.dtype).reshape(info.shape)
    return np.array(data if box is None else data[box])


def plan_files(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
  """Tensor names grouped in order into files of at most `max_bytes` (one tensor may
  exceed it alone)."""
  groups, current, used = [], [], 0
  for name, nbytes in sizes:
    if current and used + nbytes > max_bytes:
      groups.append(current)
      current, used = [], 0
    current.append(name)
    used += nbytes
  return groups + [current] if current else groups


def write(path: Path, entries: list[tuple[str, np.dtype, tuple[int, ...]]],
          produce: Callable[[str], np.ndarray]) -> None:
  """Writes one safetensors file; `produce(name)` is called once per tensor, in order, so
  only one tensor is in host memory at a time."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, dtype, shape in entries:
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, dtype, shape in entries:
      array = np.ascontiguousarray(produce(name))
      if array.dtype != dtype or array.shape != tuple(shape):
        raise ValueError(f"{name}: produced {array.dtype}{array.shape}, "
                         f"declared {dtype}{tuple(shape)}")
      f.flush()
      array.tofile(f)


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> None:
  index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
  (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
