"""A run config file (`train.py --config run.toml`): the Config's own sections and keys as
TOML, checked by the Config's own types (config.from_dict), and the resolved config every
run directory gets (RUN_DIR/config.toml), which `--config` reruns as it ran.

    model = "tiny"                # a preset or a model file; or a whole [model] table
    mesh = "data:1,fsdp:-1,tensor:2"
    [train]
    steps = 100
"""

import dataclasses
import json
import tomllib
import typing
from pathlib import Path

from shardlab import config as config_lib
from shardlab.errors import ConfigError, read_toml, suggest
from shardlab.models import registry

RESOLVED = "config.toml"  # in the run directory: every field, as the run used it
FREE_FORM = ("rules",)  # keys are logical axis names, checked by the strategy's rules


def load(path: str, default_model: str = "tiny") -> config_lib.Config:
  """The Config a TOML file describes; what it leaves out keeps the Config's defaults (the
  model: `default_model`). A key the Config lacks, or a value of the wrong type, is a
  ConfigError naming `section.key`, the value and what is valid."""
  file = Path(path)
  if not file.is_file():
    raise ConfigError(f"run config {path!r} does not exist")
  data = read_toml(file, f"run config {path!r}")
  try:
    model = _model(data.pop("model", default_model), file.stem)
    _check_keys(data, config_lib.Config)
    return config_lib.from_dict(config_lib.Config, data, model=model)
  except ConfigError as e:
    raise ConfigError(f"run config {path!r}: {e}") from None


def _model(value, stem: str):
  """`model = "NAME_OR_FILE"`, or a [model] table with a model file's keys."""
  if isinstance(value, str):
    return registry.load(value)
  if isinstance(value, dict):
    arch = value.get("arch", "llama")
    if arch in registry.ARCHITECTURES:
      _check_keys(value, registry.ARCHITECTURES[arch], "model.")
    return registry.from_dict({"name": stem, **value})
  raise ConfigError(f"model must be a preset name, a model TOML file or a [model] table, "
                    f"got {value!r}; presets: {', '.join(registry.presets())}")


def _check_keys(data: dict, cls, where: str = "") -> None:
  """Every key is a field of `cls`, and so on down its dataclass sections."""
  hints, fields = typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]
  for key, value in data.items():
    if key not in fields:
      valid = [where + name for name in fields]
      raise ConfigError(f"unknown key {where}{key} = {value!r}{suggest(where + key, valid)}; "
                        f"valid keys{f' of [{where[:-1]}]' if where else ''}: "
                        f"{', '.join(valid)}")
    if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
      _check_keys(value, hints[key], f"{where}{key}.")


def to_toml(cfg: config_lib.Config) -> str:
  """Every field of `cfg` as TOML that `load` reads back to an equal Config (checked here:
  a field TOML cannot hold is an error, not a silently different rerun)."""
  tree = config_lib.to_dict(cfg)
  scalars = {k: v for k, v in tree.items() if not isinstance(v, dict)}
  lines = ["# A resolved run config: `python train.py --config THIS_FILE` reruns the run; a",
           "# flag overrides a value here (--run-dir, --checkpoint-dir: start somewhere fresh)."]
  lines += [f"{_key(k)} = {_value(v, k)}" for k, v in scalars.items() if v is not None]
  for section, table in ((k, v) for k, v in tree.items() if isinstance(v, dict)):
    lines += _table(section, table)
  text = "\n".join(lines) + "\n"
  before, after = _flat(tree), _flat(config_lib.to_dict(_loads(text)))
  before = {k: "none" if v is None and k.startswith("rules.") else v  # what "none" means
            for k, v in before.items()}
  diff = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
  if diff:
    raise ConfigError(f"the run config cannot be written as TOML exactly: "
                      f"{', '.join(diff)} would read back otherwise")
  return text


def _flat(tree: dict, prefix: str = "") -> dict:
  """{"train.steps": 300, ...}, lists for tuples (as TOML reads them back)."""
  tree = json.loads(json.dumps(tree))
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else
               {prefix + key: value})
  return out


def _table(name: str, table: dict) -> list[str]:
  out = ["", f"[{name}]"]
  out += [f"{_key(k)} = {_value(v, f'{name}.{k}')}" for k, v in table.items()
          if not isinstance(v, dict) and (v is not None or name.split(".")[0] in FREE_FORM)]
  for key, sub in ((k, v) for k, v in table.items() if isinstance(v, dict)):
    out += _table(f"{name}.{_key(key)}", sub)
  return out


def _key(key: str) -> str:
  return key if key and all(c.isalnum() or c in "_-" for c in key) else _string(key)


def _string(text: str) -> str:
  # JSON's escapes are TOML's, except DEL, which TOML wants escaped too.
  return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value, field: str) -> str:
  if value is None:  # only in rules, where "none" means replicated
    return '"none"'
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return repr(value)  # a float's repr reads back to the same float
  if isinstance(value, str):
    return _string(value)
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(_value(v, field) for v in value) + "]"
  raise ConfigError(f"{field} = {value!r} cannot be written as TOML")


def _loads(text: str) -> config_lib.Config:
  data = tomllib.loads(text)
  model = registry.from_dict(data.pop("model"))
  return config_lib.from_dict(config_lib.Config, data, model=model)


def write(cfg: config_lib.Config, run_dir: str) -> Path:
  """RUN_DIR/config.toml: the resolved config, for `--config` to rerun."""
  path = Path(run_dir) / RESOLVED
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(to_toml(cfg))
  return path
