"""A number's type and valid range, declared once: `Int(min=1)`, `Float(gt=0, lt=0.5)`.

The one declaration is what a config field's check, a command-line option's parse (argparse's
`type=`, so a bad value exits 2 naming the option, the value and the range) and its --help
(`%(type)s` renders the range) all read, so they cannot drift apart. NaN and inf are no
float's valid value: every comparison with NaN is false, so no range check would see it."""

import argparse
import dataclasses
import math

from shardlab.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bound:
  """Limits of a number: `min`/`max` inclusive, `gt`/`lt` exclusive, any of them unset;
  `note` says what an edge value means ("0: off"), shown after the range."""
  min: float | None = None
  gt: float | None = None
  max: float | None = None
  lt: float | None = None
  note: str = ""
  kind = float  # the type a command-line value is parsed as (a class attribute, not a field)
  noun = "a finite number"

  def __str__(self) -> str:
    """The range as --help and the errors show it: '>= 1', 'in (0, 0.5)', '< 2**31'."""
    low = f"[{_show(self.min)}" if self.min is not None else \
        f"({_show(self.gt)}" if self.gt is not None else None
    high = f"{_show(self.max)}]" if self.max is not None else \
        f"{_show(self.lt)})" if self.lt is not None else None
    if low and high:
      text = f"in {low}, {high}"
    elif low:
      text = f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
    elif high:
      text = f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    else:
      text = "any"
    return f"{text} ({self.note})" if self.note else text

  def holds(self, value) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
      return False
    return ((self.min is None or value >= self.min) and (self.gt is None or value > self.gt)
            and (self.max is None or value <= self.max) and (self.lt is None or value < self.lt))

  def check(self, value, field: str):
    """`value`, or a ConfigError naming `field`, the value and the range."""
    if not self.holds(value):
      finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) \
          else ""
      raise ConfigError(f"{field} must be {finite}{self}, got {value!r}")
    return value

  def parse(self, text: str):
    """A number written as text (a command line, an ini file), or ValueError saying what is
    valid."""
    try:
      value = self.kind(text)
    except (TypeError, ValueError):
      value = None
    if value is None or not self.holds(value):
      raise ValueError(f"must be {self.noun} {self}, got {text!r}")
    return value

  def __call__(self, text: str):
    """argparse's `type=`: its message becomes 'argument --flag: must be ..., got ...'."""
    try:
      return self.parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None


class Int(Bound):
  """An integer: a command-line value parses as int() does ("007", " 12 "; not "1.0")."""
  kind = int
  noun = "an integer"


class Float(Bound):
  """A finite float: a command-line value parses as float() does, then NaN, inf and what
  overflows to it ("1e400") are refused."""


def check_fields(obj, bounds: dict, section: str) -> None:
  """Checks each field of dataclass `obj` that `bounds` (dotted key → Bound) declares under
  `section` ("train": the keys "train.*"; "": the keys without a dot)."""
  for key, bound in bounds.items():
    where, _, name = key.rpartition(".")
    if where == section:
      bound.check(getattr(obj, name), key)


def _show(x) -> str:
  """2**31 rather than 2147483648: the limits that big are powers of two."""
  if isinstance(x, int) and x >= 2**20 and x & (x - 1) == 0:
    return f"2**{x.bit_length() - 1}"
  return f"{x:g}" if isinstance(x, float) else str(x)
