"""Byte units and their one spelling in reports: binary multiples (GiB = 2**30) for memory,
as XLA and the device specs count it; decimal (GB = 10**9) for bandwidths, as vendors quote
them."""

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 10**9


def gib(nbytes: float, width: int = 0, digits: int = 2) -> str:
  """'  1.50 GiB' (`width` pads the number): one unit down a column of figures."""
  return f"{nbytes / GiB:{width}.{digits}f} GiB"


def size(nbytes: float, width: int = 0, digits: int = 2) -> str:
  """GiB from a tenth of one up, MiB below (a small model's figures stay readable)."""
  if nbytes >= GiB / 10:
    return gib(nbytes, width, digits)
  return f"{nbytes / MiB:{width}.{digits}f} MiB"
