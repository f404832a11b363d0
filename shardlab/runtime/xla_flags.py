"""XLA_FLAGS as this process and the processes it starts will read it: XLA reads it once,
when JAX's backend starts, so a flag added later changes nothing here."""

import os


def named(flag: str) -> bool:
  """Whether XLA_FLAGS already sets `flag`'s option ("--name=value"), to any value."""
  return flag.split("=")[0] in os.environ.get("XLA_FLAGS", "")


def add(flag: str) -> bool:
  """Appends `flag` to XLA_FLAGS unless its option is already set there (a user's choice
  stands); whether it was added."""
  if named(flag):
    return False
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  return True
