"""The one exception type for bad input (config, mesh, data, checkpoint), and reading a TOML
file into it."""

import difflib
import tomllib


class ConfigError(ValueError):
  """A user-facing mistake: the message names the field, the value and what is valid."""


def suggest(name: str, valid) -> str:
  """' (did you mean: a, b?)' for the names closest to `name`, or ''."""
  close = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.5)
  return f" (did you mean: {', '.join(close)}?)" if close else ""


def unknown(field: str, value, valid) -> ConfigError:
  valid = sorted(valid)
  return ConfigError(
      f"unknown {field} {value!r}{suggest(str(value), valid)}; valid: {', '.join(map(str, valid))}")


def parse_toml(text: str, what: str) -> dict:
  """A TOML file's tables, or a ConfigError saying `what` ("mesh file 'x.toml'") is not
  valid TOML and where."""
  try:
    return tomllib.loads(text)
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"{what} is not valid TOML: {e}") from None
