"""Hugging Face `config.json` ↔ a shardlab model config, for any family with an adapter
(shardlab/hf/adapter.py): reading the file, the adapter that maps it, the model TOML it
becomes (`shardlab convert hf-config`). What a family's config.json may hold, and the errors
for what it may not, are its adapter's (shardlab/hf/llama.py, mixtral.py).
"""

import dataclasses
import json
from pathlib import Path

from shardlab.errors import ConfigError
from shardlab.hf import families
from shardlab.hf.adapter import CONFIG_FILE

__all__ = ["CONFIG_FILE", "read", "to_model", "to_toml"]


def read(hf_dir: str | Path) -> dict:
  path = Path(hf_dir) / CONFIG_FILE
  if not Path(hf_dir).is_dir():
    raise ConfigError(f"Hugging Face directory {str(hf_dir)!r} does not exist")
  if not path.exists():
    raise ConfigError(f"{hf_dir} has no {CONFIG_FILE}; expected a Hugging Face model "
                      f"directory (config.json + model.safetensors)")
  try:
    data = json.loads(path.read_bytes())
  except OSError as e:
    raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from None
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise ConfigError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"{path} must hold a JSON object")
  return data


def to_model(hf: dict, name: str = "hf", where: str = CONFIG_FILE, family=None):
  """The model config of a config.json, by `family` or the adapter that claims it; a
  ConfigError naming the file and the architecture no adapter reads, or the field its
  adapter cannot hold. The adapters check the fields they read by name; a value of a type
  no check foresaw still ends in a ConfigError naming the file, never a traceback."""
  family = family or families.for_hf(hf, where)
  try:
    return family.to_model(hf, name, where)
  except ConfigError as e:
    if where in str(e):
      raise
    raise ConfigError(f"{where}: {e}") from None  # the model config's own checks
  except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError,
          OverflowError) as e:
    raise ConfigError(f"{where}: a field holds a value of the wrong type or range "
                      f"({type(e).__name__}: {e}); compare it with a config.json that "
                      f"transformers wrote") from None


def to_toml(m) -> str:
  label = families.for_model(m).label
  lines = [f"# From a Hugging Face {label} config.json (shardlab convert hf-config)."]
  for f in dataclasses.fields(m):
    value = getattr(m, f.name)
    if f.name == "name":
      continue
    text = (str(value).lower() if isinstance(value, bool) else json.dumps(value)
            if isinstance(value, str) else repr(value) if isinstance(value, float)
            else str(value))
    lines.append(f"{f.name} = {text}")
  return "\n".join(lines) + "\n"
