"""Analytic memory per device: activations after Korthikanti et al. 2022, divided exactly as
shardlab's rules shard them (shard arithmetic: shardlab.plan.training.shards).

Model state (weights, gradients, optimizer state; host bytes under offload) is
shardlab.plan.training.state_bytes's.

Activations: what autodiff saves per layer (Korthikanti's per-layer accounting, with the
tensors each bundled model's config lists: RMSNorm or LayerNorm, grouped-query K/V, SwiGLU or
GELU, no dropout), each tensor divided by the mesh axes its logical names map to, plus the
transients live at the step's peak as XLA's buffer assignment shows them (docs/planning.md,
"Checking the formulas against the compiler").
"""

import dataclasses
import math

from shardlab import remat as remat_lib
from shardlab.config import TrainConfig
from shardlab.models import protocol
from shardlab.plan.training import recompute
from shardlab.plan.training.activations import ActivationShapes, activation_shapes
from shardlab.plan.training.shards import (  # noqa: F401 (re-exported)
    dim_shards, itemsize, shard_elems, tree_shard_bytes)

GB = 1e9
# Flash attention's custom-VJP residuals beyond the layer's own (its head-major copies of q
# and the output, of k and v), and the fp32 block tiles its backward holds at once.
FLASH_SAVED_Q, FLASH_SAVED_KV, FLASH_TILES, RING_TILES = 2, 2, 5, 10


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device."""
  params: float  # weights in the compute dtype, as forward/backward read them
  grads: float
  master: float  # fp32 stored weights when compute runs in a lower precision
  opt_state: float
  activations: float  # saved for backward, plus the peak transient of the step
  gathered: float  # weights all-gathered for compute (FSDP), live at once
  batch: float  # the token batch itself
  # Host memory per device, not in `total`: the stored weights and optimizer state under
  # train.offload=opt_state, the layer inputs under remat "offload".
  host: float = 0.0
  # The stored weights on the device (each is `params` or `master`, so not in `total`).
  stored: float = 0.0

  @property
  def state(self) -> float:
    """What the train state holds on the device between steps (the stored weights and the
    optimizer state)."""
    return self.stored + self.opt_state

  @property
  def total(self) -> float:
    return (self.params + self.grads + self.master + self.opt_state + self.activations +
            self.gathered + self.batch)

  @property
  def update_bytes(self) -> float:
    """What the optimizer's update moves on the device: it reads the stored weights, the
    optimizer state and the gradients, and writes the weights and the state back."""
    return 2 * self.state + self.grads

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(state=self.state, total=self.total)
    return d


# What autodiff saves per layer (`saved_activations`) and the matmul outputs remat keeps
# (`saved_matmul_outputs`) come from the model's config: a model without them is refused
# (shardlab.models.protocol.get), not given another model's counts.


def _saved_by_shape(a: ActivationShapes, p: int, m) -> dict[str, float]:
  counts = protocol.get(m, "saved_activations")
  # Its B×L×D tensors (norm inputs and outputs, residual adds) are the residual stream's,
  # sequence-split under sequence parallelism (XLA gathers them again for the backward).
  out = {k: getattr(a, "residual" if k == "d" else k) * (4 * f32 + p * low)
         for k, (f32, low) in counts.items()}
  if a.flash:  # no probabilities: the kernel keeps its own q, k, v, output and fp32 lse
    out["scores"] = a.q * FLASH_SAVED_Q * p + a.kv * FLASH_SAVED_KV * p + a.q / m.head_dim * 4
  return out


def layer_saved_bytes(a: ActivationShapes, p: int, remat: str, m) -> float:
  """Bytes one layer keeps on the device for its backward pass, per microbatch.

  remat none: what JAX's autodiff saves, as the model's config lists it (`saved_activations`,
    read off jax.ad_checkpoint.print_saved_residuals). In the bf16 policy the softmax keeps
    its fp32 exp and the bf16 probabilities (6 bytes a score, 8 in fp32); the masked scores
    are not kept (the mask alone is, once for all layers).
  Any other policy (shardlab/remat.py): the layer input (the scan carry; in host memory under
    offload), and what the policy keeps on the device: save-matmul-outputs the weight-matmul
    outputs the backward pass reads (`saved_matmul_outputs`), a named policy the named
    projections the backward pass reads (`saved_projections`); norms, activations and
    attention's einsums are recomputed. What a policy offloads is
    `offloaded_activation_bytes`.
  """
  policy = remat_lib.policy(remat)
  if policy is None:
    return sum(_saved_by_shape(a, p, m).values())
  kept = recompute.matmul_output_bytes(a, p, m) if policy.dots == "device" else 0.0
  return _carry(a, p, remat) + kept + recompute.projection_bytes(a, p, m, policy.saved)


def _mlp_rows(a: ActivationShapes) -> float:
  """F-wide elements of one layer's MLP: its token rows', or a mixture of experts' rows."""
  return max(a.mlp, a.expert_mlp)


def layer_backward_transient(a: ActivationShapes, p: int, remat: str, m,
                             platform: str = "cpu") -> float:
  """Peak extra bytes while one layer runs backward, beyond what the layers keep.

  Without remat: the largest cotangents (SwiGLU's three F-wide gradients, a mixture of
  experts' at its dispatched rows; or attention's fp32 score gradient and its cast) plus two
  residual-stream gradients. With remat: the layer's
  residuals rebuilt, live while its backward runs — the residual stream's throughout, then
  the MLP's with its three F-wide gradients, then attention's with the fp32 scores and their
  gradient beside the kept probabilities (fitted to XLA:CPU's buffer assignment across the
  reference grid: 10 bytes a score), whichever is larger. XLA:TPU keeps no fp32 softmax: its
  attention holds the compute-dtype probabilities, their fp32 gradient and the score
  gradient in the compute dtype (8 bytes a score in bf16; tests/test_plan_tpu.py).
  A model's `backward_transients` (Gemma 2's soft-cap recomputes the fp32 scores) come on
  top. A scan step of several layers (`layers_per_scan_step`: Gemma's layer pattern) holds
  every one of its layers' buffers at once: under remat it rebuilds them together; without,
  XLA's buffer assignment keeps each layer's backward buffers apart and the other layers'
  residuals read out of the saved stacks beside them — unless one step is the whole stack,
  when XLA drops the loop and nothing is read out (tests/test_plan_families.py).
  """
  group, extra = scan_step_layers(m), _backward_extra(a, p, m)
  if remat == "none":
    read_out = (group - 1) * layer_saved_bytes(a, p, remat, m) if m.n_layers > group else 0
    return group * (max(_mlp_rows(a) * 3 * p, _attention_backward(a, p)) + a.d * 2 * p +
                    extra) + read_out
  part = dict.fromkeys(("d", "q", "kv", "scores", "mlp", "expert_d", "expert_mlp"), 0.0)
  part |= _saved_by_shape(a, p, m)
  if a.flash:
    scores = part["scores"] + _attention_backward(a, p)
  elif platform == "tpu":
    scores = a.scores * (2 * p + (p if a.compute_scores else 4))
  else:
    scores = part["scores"] + a.scores * 10
  attention = part["q"] + part["kv"] + scores
  mlp = part["mlp"] + part["expert_d"] + part["expert_mlp"] + _mlp_rows(a) * 3 * p
  rebuilt = part["d"] + max(mlp, attention) + extra
  kept = group * layer_saved_bytes(a, p, remat, m) - (group - 1) * _carry(a, p, remat)
  return max(group * rebuilt - kept, 0.0)


def scan_step_layers(m) -> int:
  """Layers one step of the layer scan runs (the model's `layers_per_scan_step`)."""
  return max(1, min(protocol.get(m, "layers_per_scan_step"), m.n_layers))


def _carry(a: ActivationShapes, p: int, remat: str) -> float:
  """The scan carry (a step's input) that a remat policy keeps on the device (every one but
  offload, which keeps it in host memory)."""
  policy = remat_lib.policy(remat)
  on_device = policy is not None and remat_lib.LAYER_INPUT not in policy.offloaded
  return a.residual * p if on_device else 0.0


def stack_saved_bytes(a: ActivationShapes, p: int, remat: str, m) -> float:
  """Bytes the layer stack keeps for backward: every layer's, but under remat one input for
  each scan step, whatever its layers."""
  steps = math.ceil(m.n_layers / scan_step_layers(m))
  return (m.n_layers * layer_saved_bytes(a, p, remat, m) -
          (m.n_layers - steps) * _carry(a, p, remat))


def _backward_extra(a: ActivationShapes, p: int, m) -> float:
  counts = protocol.get(m, "backward_transients")
  return sum(getattr(a, k) * (4 * f32 + p * low) for k, (f32, low) in counts.items())


def _attention_backward(a: ActivationShapes, p: int) -> float:
  """Attention's backward beyond its inputs: the fp32 score gradient and its cast, or for
  flash attention fp32 block tiles with the fp32 dq accumulator, and under an all-gather KV
  exchange the gathered K/V with their fp32 gradients; ring attention's backward holds twice
  the tiles (both halves of a visited block). Tile counts fitted to XLA:CPU's buffer
  assignment (tests/test_plan_context.py)."""
  if not a.flash:
    return a.scores * (4 + p)
  if a.ring:  # the visiting block and the next in flight, with their fp32 gradients
    return a.scores * 4 * RING_TILES + a.q * 4 + 2 * 2 * a.kv * (p + 4)
  gathered = 2 * a.kv * a.context * (p + 4) if a.context > 1 else 0.0
  return a.scores * 4 * FLASH_TILES + a.q * 4 + gathered


def offloaded_activation_bytes(m, a: ActivationShapes, p: int, remat: str) -> float:
  """Host bytes per device that a remat policy keeps in host memory: offload's every scan
  step's input, qkv-proj-offloaded's projections and minimal-offloaded's matmul outputs
  every layer."""
  policy = remat_lib.policy(remat)
  if policy is None or not policy.on_host:
    return 0.0
  steps = math.ceil(m.n_layers / scan_step_layers(m))
  inputs = steps * a.residual * p if remat_lib.LAYER_INPUT in policy.offloaded else 0.0
  per_layer = recompute.matmul_output_bytes(a, p, m) if policy.dots == "host" else 0.0
  return inputs + m.n_layers * (per_layer + recompute.projection_bytes(a, p, m, policy.offloaded))


def loss_transients(a: ActivationShapes, p: int, fp32_logits: int = 1,
                    chunk_fraction: float = 1.0, platform: str = "cpu") -> tuple[float, float]:
  """The loss stage (models/lm.py's fused cross-entropy): forward, the fp32 logits beside
  the softmax it keeps (compute dtype); backward, that softmax turned in place into the
  logits' gradient, with the final norm's buffers. `fp32_logits`: more fp32 copies held
  at once (a soft-capped loss's capped logits on XLA:CPU, `loss_fp32_logits`).
  `chunk_fraction`: train.loss_chunk over the sequence, where the loss runs a chunk of
  positions at a time (parallel/loss.py): one chunk's logits live at once, and its backward
  computes the chunk's forward again, so it holds the forward's buffers too.
  XLA:TPU holds the fp32 logits alone, through the backward as well (no separate softmax:
  llama3-8b at 4 × 8192 tokens a v6e chip, whole and in 2048-position chunks, held one fp32
  B×C×V buffer at its peak; bench/plan_tpu.py's Llama 3.1 recipe)."""
  logits = a.logits * chunk_fraction
  norm = a.d * (8 + p)
  if platform == "tpu":
    return logits * 4, logits * 4 + norm
  forward = logits * (4 * fp32_logits + p)
  return forward, logits * p + norm + (forward if chunk_fraction < 1 else 0.0)


def activation_memory(m, t: TrainConfig, p: int, table: dict, mesh,
                      head_gathered: float = 0.0,
                      platform: str = "cpu") -> tuple[float, float, ActivationShapes]:
  """(activation bytes per device at the step's peak, token-batch bytes, shapes).

  On top of what every layer keeps: the largest of the loss stage's forward, its backward and
  one layer's backward. The loss's backward holds the output head's fp32 weight gradient,
  whole over the batch axes; with `train.early_grad_reduce` it is reduced to its shard
  before the layers' backward starts (parallel/early_grads.py), else XLA holds it through the
  layers' backward too (it reduces it with the others, at the end; the embedding lookup's
  gradient comes last, once the layers' buffers are free). Either way it takes the place of
  the largest gathered buffer (`head_gathered` bytes, counted with the gathered weights:
  under FSDP the head itself, dead once the logits' input gradient is computed)."""
  a = activation_shapes(m, t.global_batch // t.microbatches, t.seq_len, table, mesh,
                        platform)
  saved = stack_saved_bytes(a, p, t.remat, m) + a.residual * p  # + embedding output
  # The TPU compiler fuses a logit soft-cap into the softmax's reductions (gemma2-9b on a
  # v5e-256: one fp32 B×L×V less than XLA:CPU holds; tests/test_plan_families.py).
  copies = protocol.get(m, "loss_fp32_logits") if platform == "cpu" else 1
  chunk = t.loss_chunk / t.seq_len if t.loss_chunk else 1.0
  loss_forward, loss_backward = loss_transients(a, p, copies, chunk, platform)
  head_grad = a.head * 4 - head_gathered
  layers = layer_backward_transient(a, p, t.remat, m, platform)
  transient = max(loss_forward, loss_backward + head_grad,
                  layers - head_gathered if t.early_grad_reduce else layers + head_grad)
  peak = saved + transient
  batch = a.tokens * t.microbatches * 4  # the whole step's int32 tokens
  return peak, batch, a
