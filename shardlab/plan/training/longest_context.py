"""How long a sequence fits on n devices, per context-parallel degree: for each power of two
c dividing n, the longest train.seq_len (a multiple of GRANULE, and of 2c for the zig-zag
layout) at which some layout with a `context` axis of c fits the target by formula, and the
fastest such layout.

The layouts tried are the ones that keep the least per device: the model state sharded over
every other device (fsdp), or with tensor parallelism inside the fast domain and Megatron
sequence parallelism (fsdp_tp_sp). Memory grows with the sequence, so the answer is found by
doubling and then bisecting.
"""

import dataclasses

from shardlab.errors import ConfigError
from shardlab.models import protocol
from shardlab.plan.training.estimate import Estimate, Request, estimate, split_ici_dcn
from shardlab.runtime.units import GiB, gib

GRANULE = 1024
MAX_SEQ_LEN = 2**24


@dataclasses.dataclass(frozen=True)
class Row:
  context: int
  seq_len: int  # 0: no sequence of GRANULE tokens fits
  best: Estimate | None  # the fastest fitting layout at seq_len
  why: str = ""  # when seq_len is 0


def layouts(model, acc, n: int, c: int):
  """(strategy, mesh spec) with a context axis of c: fsdp over the rest, or tensor (up to
  the fast domain, dividing the heads) × fsdp with sequence parallelism."""
  rest = n // c
  for t in (1, 2, 4, 8):
    if rest % t or t > acc.ici_domain or model.n_kv_heads % t or model.n_heads % t:
      continue
    shape = {"data": 1, "fsdp": rest // t, "tensor": t} | ({"context": c} if c > 1 else {})
    yield ("fsdp" if t == 1 else "fsdp_tp_sp"), split_ici_dcn(shape, acc.ici_domain)


def _estimates(req: Request, model, acc, n: int, c: int, seq_len: int) -> list[Estimate]:
  """The layouts' estimates at seq_len, fitting or not (a layout the batch or a dimension
  does not divide is left out)."""
  r, out = req.with_train(seq_len=seq_len), []
  for strategy, spec in layouts(model, acc, n, c):
    try:
      out.append(estimate(r, model, acc, spec, strategy))
    except ConfigError:
      continue
  return out


def fastest_fitting(req: Request, model, acc, n: int, c: int, seq_len: int) -> Estimate | None:
  return min((e for e in _estimates(req, model, acc, n, c, seq_len) if e.fits),
             key=lambda e: e.step_s, default=None)


def longest(req: Request, model, acc, n: int, cap: int = MAX_SEQ_LEN) -> list[Row]:
  """One row per context degree c (powers of two dividing n), shortest degree first."""
  rows, c = [], 1
  while c <= n:
    if n % c == 0:
      rows.append(_row(req, model, acc, n, c, cap))
    c *= 2
  return rows


def _row(req: Request, model, acc, n: int, c: int, cap: int) -> Row:
  unit = max(GRANULE, 2 * c)
  best, lo, hi = None, 0, unit
  while hi <= cap and (e := fastest_fitting(req, model, acc, n, c, hi)) is not None:
    best, lo, hi = e, hi, hi * 2
  while hi - lo > unit:
    mid = (lo + hi) // 2 // unit * unit
    if (e := fastest_fitting(req, model, acc, n, c, mid)) is not None:
      best, lo = e, mid
    else:
      hi = mid
  if best is not None:
    return Row(c, lo, best)
  why = (f"nothing fits at {unit} tokens" if _estimates(req, model, acc, n, c, unit) else
         f"global batch {req.train.global_batch} does not split over the {n // c} devices beside "
         f"the context axis (fsdp, or fsdp × tensor)")
  return Row(c, 0, None, why)


def render(rows: list[Row], model, acc, n: int, batch: int) -> list[str]:
  lines = [f"longest sequence that fits {model.name} on {n} × {acc.name} "
           f"({gib(acc.usable_bytes, digits=1)} usable), global batch {batch}, "
           f"attention {protocol.get(model, 'attention')}, KV exchange "
           f"{protocol.get(model, 'kv_exchange')}:",
           f"  {'context':>7s} {'seq_len':>10s}  {'layout':52s} {'GiB/device':>10s} "
           f"{'tokens/s':>10s}"]
  for r in rows:
    if r.best is None:
      lines.append(f"  {r.context:7d} {'-':>10s}  {r.why}")
      continue
    e = r.best
    lines.append(f"  {r.context:7d} {r.seq_len:10,d}  {e.strategy + ' ' + e.mesh:52s} "
                 f"{e.memory.total / GiB:10.2f} {e.tokens_per_s:10,.0f}")
  return lines
