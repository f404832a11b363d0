"""What every fuzzed reader must do, and the inputs fed to them.

A reader given any bytes either accepts them (they were valid) or raises a ConfigError whose
message names the file: never another exception (a traceback), never a hang (hypothesis'
deadline), never an allocation sized by an untrusted number (the inputs claim terabytes).

Two hypothesis profiles: "ci" (the default: few examples, derandomized, so the suite stays
fast and repeatable) and "deep" (SHARDLAB_FUZZ=deep, `make fuzz`: many more, random). With
SHARDLAB_FUZZ_LOG set, each module appends how many inputs it tried to that file.
"""

import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st

from shardlab.errors import ConfigError

settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=2000, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "deep", max_examples=2000, deadline=5000, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("SHARDLAB_FUZZ", "ci"))
if os.environ.get("SHARDLAB_FUZZ_EXAMPLES"):  # `make fuzz EXAMPLES=N`
  settings.register_profile("sized", settings.get_profile(settings._current_profile),
                            max_examples=int(os.environ["SHARDLAB_FUZZ_EXAMPLES"]))
  settings.load_profile("sized")

TRIED = {"n": 0}


@pytest.fixture(scope="module", autouse=True)
def _count_inputs(request):
  """Appends '<module> <inputs tried>' to $SHARDLAB_FUZZ_LOG (for `make fuzz`)."""
  before = TRIED["n"]
  yield
  log = os.environ.get("SHARDLAB_FUZZ_LOG")
  if log:
    with open(log, "a") as f:
      f.write(f"{request.module.__name__} {TRIED['n'] - before}\n")


def outcome(read, *names: str):
  """read()'s result, or None when it refused with a ConfigError naming one of `names`
  (the file's name or path). Any other exception fails the test with it."""
  TRIED["n"] += 1
  try:
    return read()
  except ConfigError as e:
    message = str(e)
    assert message.strip(), "an empty error message"
    assert any(n in message for n in names), f"the error does not name {names}: {message}"
    assert "Traceback" not in message, message
    return None


# Values a field should never take silently: wrong types, huge and negative numbers,
# NaN and inf, empty and odd strings.
ODD = st.one_of(
    st.sampled_from([0, -1, -(2**63), 2**63, 2**64 + 1, 10**30, 0.0, -0.0, -1.5, 1e308,
                     math.nan, math.inf, -math.inf, "", "x", "1e9", "\x00", True, False,
                     [], [1, 2], {}, {"a": 1}]),
    st.integers(), st.floats(), st.text(max_size=8), st.booleans())


def mutations(valid: dict, keys=None):
  """A copy of `valid` with one key removed, one unknown key added, or one value (of
  `keys`, default all) replaced by an ODD one."""
  keys = sorted(keys or valid)

  @st.composite
  def build(draw):
    out = dict(valid)
    how = draw(st.sampled_from(["replace", "replace", "replace", "drop", "extra"]))
    key = draw(st.sampled_from(keys))
    if how == "drop":
      out.pop(key, None)
    elif how == "extra":
      out[draw(st.sampled_from(["extra", "Vocab_size", "zz"]))] = draw(ODD)
    else:
      out[key] = draw(ODD)
    return out
  return build()


def damaged(valid: bytes):
  """`valid` truncated, with bytes flipped or inserted (non-UTF-8 among them), or random."""
  @st.composite
  def build(draw):
    how = draw(st.sampled_from(["truncate", "flip", "insert", "random"]))
    if how == "random":
      return draw(st.binary(max_size=256))
    at = draw(st.integers(0, max(len(valid) - 1, 0)))
    if how == "truncate":
      return valid[:at]
    if how == "flip":
      return valid[:at] + bytes([valid[at] ^ draw(st.integers(1, 255))]) + valid[at + 1:] \
          if valid else b"\xff"
    return valid[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\x00", b"]", b"\"",
                                              b"=", b"\n[x]\n"])) + valid[at:]
  return build()


def toml_value(v) -> str:
  """One TOML value (nan and inf as TOML spells them; an empty list stays a list)."""
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, float):
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) \
        else repr(v)
  if isinstance(v, int):
    return str(v)
  if isinstance(v, str):
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                         for c in v) + '"'
  if isinstance(v, list):
    return "[" + ", ".join(toml_value(x) for x in v) + "]"
  if isinstance(v, dict):
    return "{" + ", ".join(f'"{k}" = {toml_value(x)}' for k, x in v.items()) + "}"
  raise TypeError(v)


def to_toml(data: dict) -> str:
  """`data` as TOML: top-level scalars first, then one [table] per dict value."""
  lines = [f'"{k}" = {toml_value(v)}' for k, v in data.items() if not isinstance(v, dict)]
  for k, v in data.items():
    if isinstance(v, dict):
      lines.append(f'["{k}"]')
      lines += [f'"{kk}" = {toml_value(vv)}' for kk, vv in v.items()]
  return "\n".join(lines) + "\n"


def write(path: Path, content: bytes | str) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(content.encode() if isinstance(content, str) else content)
  return path
