"""Matmul FLOPs of a compiled program, per device per step, read from its optimised HLO.

XLA's own `cost_analysis()` counts a while loop's body once, so a model whose layers are a
scan reports one layer's FLOPs. Here every `dot` (and `convolution`) is weighted by how many
times its computation runs per step, loops' trip counts included (shardlab.observe.hlo), and
costs 2 × (result elements) × (contracted elements), a convolution only its taps that land
on real input. Elementwise work is left out: it is a
few percent of a transformer's FLOPs and is bound by memory, not compute.
"""

import math
import re

from shardlab.observe import hlo
from shardlab.observe.hlo_text import with_runs

_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")


def _dot_macs(instr: hlo.Instruction, local: dict) -> float:
  lhs = local.get(instr.operands[0]) if instr.operands else None
  dims = hlo.arrays(lhs.shape)[0][1] if lhs is not None else ()
  m = _CONTRACTING.search(instr.attrs)
  contracted = [int(d) for d in m.group(1).split(",") if d] if m else []
  return _elements(instr) * math.prod(dims[d] for d in contracted)


def _conv_macs(instr: hlo.Instruction, local: dict) -> float:
  """Multiply-adds of a convolution that touch real input: the TPU compiler writes batched
  matmuls as convolutions whose window slides over padding or a dilated input, and those
  taps cost nothing."""
  labels, window = _LABELS.search(instr.attrs), _WINDOW.search(instr.attrs)
  shapes = [hlo.arrays(local[o].shape)[0][1] if o in local else () for o in instr.operands[:2]]
  if not labels or len(shapes) < 2 or not all(shapes):
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  out = hlo.arrays(instr.shape)[0][1]
  spatial = sorted(c for c in rhs_l if c.isdigit())
  fields = _window_fields(window.group(1) if window else "", len(spatial))
  per_output = shapes[1][rhs_l.index("i")]
  pairs = 1
  for k, d in enumerate(spatial):
    pairs *= _valid_taps(shapes[0][lhs_l.index(d)], out[out_l.index(d)],
                         shapes[1][rhs_l.index(d)], fields, k)
  rest = math.prod(n for n, c in zip(out, out_l) if not c.isdigit())
  return rest * pairs * per_output


def _window_fields(text: str, n: int) -> dict:
  out = {"stride": [1] * n, "lhs_dilate": [1] * n, "rhs_dilate": [1] * n, "pad": [0] * n}
  for key, value in (f.split("=", 1) for f in text.split() if "=" in f):
    if key == "pad":
      out["pad"] = [int(p.split("_")[0]) for p in value.split("x")]
    elif key in out:
      out[key] = [int(v) for v in value.split("x")]
  return out


def _valid_taps(size: int, out: int, taps: int, f: dict, k: int) -> int:
  """Over every output position, the window taps that land on a real input element."""
  stride, ld, rd, pad = f["stride"][k], f["lhs_dilate"][k], f["rhs_dilate"][k], f["pad"][k]
  extent = (size - 1) * ld + 1
  count = 0
  for o in range(out):
    for t in range(taps):
      x = o * stride + t * rd - pad
      count += 0 <= x < extent and x % ld == 0
  return count


def _elements(instr: hlo.Instruction) -> int:
  return sum(math.prod(dims) for _, dims in hlo.arrays(instr.shape))


def dot_flops(hlo_text: str) -> float:
  """2 × multiply-adds of every dot and convolution, times its executions per step."""
  return flops_of(*with_runs(hlo_text))


def flops_of(computations: dict, runs: dict) -> float:
  """`dot_flops` of a program already read (`hlo_text.with_runs`)."""
  total = 0.0
  for name, instrs in computations.items():
    if not runs.get(name):
      continue
    local = {i.name: i for i in instrs}
    for instr in instrs:
      if instr.opcode == "dot":
        total += 2.0 * _dot_macs(instr, local) * runs[name]
      elif instr.opcode == "convolution":
        total += 2.0 * _conv_macs(instr, local) * runs[name]
  return total
