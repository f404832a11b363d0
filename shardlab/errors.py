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


def read_toml(path, what: str) -> dict:
  """The tables of TOML file `path`, or a ConfigError saying why `what` cannot be read: the
  OS reason, bytes that are not UTF-8, or where the TOML is invalid."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise ConfigError(f"{what} cannot be read: {e.strerror or e}") from None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{what} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                      f"a TOML file must be UTF-8") from None
  return parse_toml(text, what)


def finite(value, field: str) -> float:
  """`value` as a float, or a ConfigError: NaN, inf and numbers past float's range are no
  setting's valid value (every comparison with NaN is false, so no range check sees it)."""
  try:
    out = float(value)
  except OverflowError:
    out = float("inf")
  if out != out or out in (float("inf"), float("-inf")):
    raise ConfigError(f"{field} must be a finite number, got {value!r}")
  return out
