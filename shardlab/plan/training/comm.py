"""Analytic communication, FLOPs and a roofline step time.

Collective bytes follow shardlab.hlo's convention (the per-device buffer on the full side:
all-gather result, reduce-scatter operand, all-reduce buffer), so they can be compared with a
compiled step's HLO one to one. They are derived from the rules tables, per parameter leaf
(the weights' transfers: weight_comm.py) and per activation:
  compute layout C  the weight's spec under the *activation* table (tensor axes only);
  forward/backward  axes in the param spec but not in C are all-gathered before use: once in
                    the forward and once in the backward for scanned layers, once for the
                    embedding/head/final norm (XLA keeps that copy for the backward);
  gradients         partial sums over the batch axes (in the dtype `Backend` says); reduce-
                    scattered onto the axes the gradient sharding keeps, all-reduced over the
                    rest (a backend without reduce-scatter, like XLA:CPU, all-reduces the
                    whole compute-layout grad);
  update            axes the optimizer state is sharded over but the params are not (ZeRO-1/2)
                    mean the updated params are all-gathered;
  tensor parallel   per layer and microbatch two all-reduces of B×L×D forward (after o-proj
                    and down-proj) and five backward (one per input projection), one more
                    under full remat; one for the vocab-sharded embedding lookup and one for
                    the head's input gradient;
  sequence parallel those reductions land on the sequence shards (reduce-scatters), and each
                    block's input is all-gathered (`sequence_transfers`).
"""

import dataclasses
import math

from shardlab import remat as remat_lib
from shardlab.sharding import rules as rules_lib
from shardlab.runtime.hardware import Accelerator
from shardlab.plan.training.activations import ActivationShapes

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


@dataclasses.dataclass(frozen=True)
class Transfer:
  kind: str
  bytes: float  # per device per step, hlo.py's convention
  axes: tuple[str, ...]  # mesh axes the collective spans
  what: str


def _axes(spec) -> set[str]:
  out = set()
  for entry in spec:
    if entry is None:
      continue
    out.update((entry,) if isinstance(entry, str) else entry)
  return out


def _live(rule, mesh) -> tuple[str, ...]:
  """The mesh axes of an activation rule that split anything on `mesh`, sorted."""
  return tuple(sorted(x for x in rules_lib._axes(rule) if mesh.shape.get(x, 1) > 1))


def _shards(axes, mesh) -> int:
  return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class Backend:
  """How a compiler spells the step's collectives.

  TPU (and GPU) gather the weights after the cast to the compute dtype and reduce gradients
  in it (the dtype of the weight-gradient matmul), and form reduce-scatters. XLA:CPU
  computes bf16 in fp32, so its collectives move the stored (fp32) dtype, and it lowers a
  reduce-scatter as all-reduce + slice.
  """
  name: str
  reduce_scatter: bool
  compute_dtype_collectives: bool


BACKENDS = {"tpu": Backend("tpu", True, True), "gpu": Backend("gpu", True, True),
            "cpu": Backend("cpu", False, False)}


def context_transfers(m, a: ActivationShapes, rules: rules_lib.Rules, mesh, p: int,
                      remat: str, microbatches: int) -> list[Transfer]:
  """Context parallelism's KV exchange per layer and microbatch (parallel/context.py), K and V
  with their positions and segment ids (int32):
    all-gather  forward gathers the whole K/V (again under full remat); backward
                reduce-scatters dK/dV in fp32;
    ring        forward passes the local K/V block on c-1 times; backward passes it on c-1
                times more and the fp32 dK/dV accumulators c times (they end at home);
  and the zig-zag layout's permute of the B×L×D output, forward and backward."""
  axes = _live(rules.activations.get("length"), mesh)
  c = a.context
  if c == 1 or not axes:
    return []
  kv, meta = 2 * a.kv * p, 2 * a.positions * 4
  forwards = 2 if remat_lib.recomputes_all(remat) else 1
  per = m.n_layers * microbatches
  if a.ring:
    out = [Transfer("collective-permute",
                    per * ((forwards + 1) * (c - 1) * kv + c * 2 * a.kv * 4 +
                           forwards * (c - 1) * meta), axes, "ring K/V blocks and dK/dV")]
  else:
    out = [Transfer("all-gather", per * forwards * c * (kv + meta), axes, "K/V for attention"),
           Transfer("reduce-scatter", per * c * 2 * a.kv * 4, axes, "dK/dV")]
  return out + [Transfer("collective-permute", 2 * a.d * p * microbatches, axes,
                         "zig-zag layout of the output")]


def activation_transfers(m, a: ActivationShapes, rules: rules_lib.Rules, mesh,
                         p: int, remat: str, microbatches: int,
                         layer_runs: float | None = None,
                         reduce_scatter: bool = False) -> list[Transfer]:
  """Tensor parallelism's collectives of the residual stream (Megatron's f/g operators: all-
  reduces, or under sequence parallelism reduce-scatters and all-gathers) and context
  parallelism's KV exchange. `layer_runs`: layer applications per device, each on one
  microbatch (default: n_layers × microbatches; fewer on a pipeline's stage);
  `reduce_scatter`: whether the backend forms reduce-scatters (`Backend`)."""
  out = context_transfers(m, a, rules, mesh, p, remat, microbatches)
  tensor = _live(rules.activations.get("heads"), mesh)
  if not tensor:
    return out
  # Forward: after o-proj and down-proj. Backward: XLA reduces each projection's input
  # gradient on its own (q, k, v; gate, up) rather than summing them first. Full remat
  # repeats the o-proj one (the layer's output itself is not needed again).
  per_layer = 2 + 5 + (1 if remat_lib.recomputes_all(remat) else 0)
  runs = m.n_layers * microbatches if layer_runs is None else layer_runs
  vocab = _live(rules.activations.get("vocab"), mesh)
  sequence = tuple(x for x in _live(rules.activations.get("residual_length"), mesh)
                   if x in tensor)
  if sequence:
    return out + sequence_transfers(a, (tensor, sequence, vocab), p, runs, per_layer,
                                    microbatches, reduce_scatter,
                                    remat_lib.recomputes_all(remat),
                                    m.vocab_size * m.d_model)
  out += [Transfer("all-reduce", runs * per_layer * a.d * p, tensor,
                  "attention/MLP outputs and input grads")]
  if vocab:
    out.append(Transfer("all-reduce", a.d * (p + 4) * microbatches, vocab,
                        "embedding lookup and the fp32 head's input grad"))
  return out


# Sequence parallelism's all-gathers of B×L×D a layer run (counted on XLA's compiles): the
# attention's and MLP's inputs, their output gradients, and the two norm outputs saved split,
# gathered again for the weight gradients (under full remat, by the recomputed forward).
SEQUENCE_GATHERS = 6
# Under full remat the TPU compiler keeps only one of the two recomputed inputs until its
# weight gradient and gathers the other again: 7 a layer run (counted on v5e compiles of
# tests/test_plan_tpu.py's model at 1 and 2 microbatches). XLA:CPU keeps both (6 on the
# tiny model's tp_sp compile at full remat). GPU is planned as TPU, as for the reduce-scatters
# (not checked on a GPU compile).
TPU_FULL_REMAT_REGATHERS = 1


def sequence_transfers(a: ActivationShapes, axes: tuple, p: int, runs: float, per_layer: int,
                       microbatches: int, reduce_scatter: bool, remat_all: bool,
                       table: int) -> list[Transfer]:
  """Megatron sequence parallelism (Korthikanti et al. 2022), the residual stream split along
  the sequence (`axes`: tensor, sequence, vocab axes): tensor parallelism's reductions of
  B×L×D land on the sequence shards, and each matmul region (the head too) starts with an
  all-gather of the sequence. With reduce-scatter (TPU) each region's input gradients (q, k,
  v; gate, up) are summed first, as in Megatron: 2 + 2 a layer (+1 under full remat), and the
  head's input gradient; a vocab-sharded embedding (`table`: V×D elements) is gathered whole
  for the lookup, once a microbatch. XLA:CPU all-reduces and slices `per_layer` a layer, and
  the lookup's, as for tensor parallelism."""
  tensor, sequence, vocab = axes
  gathers = SEQUENCE_GATHERS
  if reduce_scatter:
    reductions, outer, kind = per_layer - 3, a.d * p, "reduce-scatter"  # 5 backward: 2
    gathers += TPU_FULL_REMAT_REGATHERS if remat_all else 0
  else:
    reductions, outer, kind = per_layer, a.d * (p + 4), "all-reduce"
  out = [Transfer(kind, runs * reductions * a.d * p, tensor,
                  "attention/MLP outputs and input grads onto sequence shards"),
         Transfer("all-gather", (runs * gathers + microbatches) * a.d * p, sequence,
                  "the sequence for attention, the MLP and the head")]
  if vocab:
    out.append(Transfer(kind, outer * microbatches, vocab,
                        "embedding lookup (CPU) and the head's input grad"))
    if reduce_scatter:
      out.append(Transfer("all-gather", table * p * microbatches, vocab,
                          "the embedding table for the lookup"))
  return out


def totals(transfers: list[Transfer]) -> dict[str, float]:
  out = {k: 0.0 for k in KINDS}
  for t in transfers:
    out[t.kind] += t.bytes
  return out


def transfer_time(t: Transfer, mesh_spec, acc: Accelerator) -> float:
  """Ring time for one transfer, hierarchical over ICI then DCN: the ICI part moves the
  buffer, the DCN part only its 1/n_ici share (reduce-scatter inside, then across)."""
  n_ici = math.prod(mesh_spec.ici.get(a, 1) for a in t.axes)
  n_dcn = math.prod(mesh_spec.dcn.get(a, 1) for a in t.axes)
  if t.kind == "collective-permute":  # each buffer crosses one link, the slowest on the ring
    return t.bytes / (acc.dcn_bw if n_dcn > 1 else acc.ici_bw)
  factor = 2.0 if t.kind == "all-reduce" else 1.0
  time = factor * t.bytes * (n_ici - 1) / n_ici / acc.ici_bw if n_ici > 1 else 0.0
  if n_dcn > 1:
    time += factor * (t.bytes / n_ici) * (n_dcn - 1) / n_dcn / acc.dcn_bw
  return time
