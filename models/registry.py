"""Bundled architectures by name, and their TOML presets (package data in presets/).

A preset or model file names its architecture with `arch = "..."` (default "llama"). Each
architecture registers itself in its own file with `@register("name")`
(shardlab.models.protocol); importing this module imports the bundled ones, so their names
are known. A new one (a file of your own) registers when it is imported, before `load`.
"""

import importlib.resources
from pathlib import Path

from shardlab import config as config_lib
from shardlab.errors import ConfigError, parse_toml, read_toml, unknown
# Imported for their registration: each file's @register puts its config on the registry.
from shardlab.models import gpt2_config, llama_config, moe_config  # noqa: F401
from shardlab.models import qwen2, qwen3, qwen3_moe  # noqa: F401
from shardlab.models import gemma_config, mistral, phi3  # noqa: F401
from shardlab.models.protocol import ARCHITECTURES  # noqa: F401 (read-only: name -> class)


def _preset_dir():
  return importlib.resources.files("shardlab.models") / "presets"


def presets() -> list[str]:
  return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".toml"))


def from_dict(data: dict, where: str = "model."):
  """The architecture's config dataclass from a preset's (or saved run's) fields."""
  arch = data.get("arch", "llama")
  if arch not in ARCHITECTURES:
    raise unknown(f"{where}arch", arch, ARCHITECTURES)
  return config_lib.from_dict(ARCHITECTURES[arch], data, where)


def load(name_or_file: str):
  """A preset name (`shardlab.models.registry.presets()`) or a TOML model file."""
  path = Path(name_or_file)
  if path.suffix == ".toml":
    if not path.is_file():
      raise ConfigError(f"model file {name_or_file!r} does not exist")
    data, stem = read_toml(path, f"model file {name_or_file!r}"), path.stem
  else:
    preset = _preset_dir() / f"{name_or_file}.toml"
    if not preset.is_file():
      raise unknown("model", name_or_file, presets())
    data, stem = parse_toml(preset.read_text(), f"model preset {name_or_file!r}"), name_or_file
  data.setdefault("name", stem)
  try:
    return from_dict(data)
  except ConfigError as e:
    raise ConfigError(f"model file {name_or_file!r}: {e}") from None


def run_config_from_dict(data: dict, where: str = "") -> config_lib.Config:
  """A run's Config from its saved JSON form (checkpoints, the AOT subprocess); an error
  starts with `where` (the checkpoint step it came from), if given."""
  try:
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
      raise ConfigError("a saved run config needs a 'model' table")
    data = dict(data)
    model = from_dict(data.pop("model"))
    return config_lib.from_dict(config_lib.Config, data, model=model)
  except ConfigError as e:
    raise ConfigError(f"{where}: {e}" if where else str(e)) from None
