"""The step time: matmuls at the target's matmul efficiency, attention at a lower one, the
memory-bound work (norms, activations, softmax, RoPE, residual adds) by the bytes it moves,
and the collectives that cannot hide behind compute.

  matmuls       the weight matmuls' hardware FLOPs (6 a parameter a token, plus what remat
                runs again: recompute.hardware_flops_per_token) / (peak ×
                `matmul_efficiency`): the target's
                published fraction of peak (hardware.Accelerator) × MATMUL_OVER_STEP;
  attention     the L×L einsums (12·layers·heads·head_dim·L a token, the forward again where
                remat recomputes it) at ATTENTION_EFFICIENCY of that: flash kernels run
                their two matmuls and an online softmax per tile, and the backward pass
                recomputes the scores;
  memory-bound  per layer and microbatch, the elementwise passes over the residual stream,
                q/k/v and the MLP's hidden activations (ELEMENTWISE passes each, forward and
                backward, the forward again under any remat) and, without flash, the L×L
                scores (mask, softmax, its gradient) — bytes at the compute dtype / HBM
                bandwidth, since none of them is compute-bound;
  collectives   tensor parallelism's all-reduces (with sequence parallelism its reduce-
                scatters and all-gathers, comm.sequence_transfers) sit between a layer's
                matmuls (each waits for the one before: exposed in full); pipeline
                point-to-point likewise;
                weight gathers and gradient reductions (FSDP, ZeRO, data parallel) run
                beside the next or previous layer's compute, so only what exceeds the compute
                time is exposed, plus one layer's share (the first gather and the last
                reduction have nothing to hide behind);
  pipeline      the compute stretched by the bubble, 1 / (1 − bubble);
  update        the optimizer's pass over the state the device holds (read the weights,
                their gradients and the optimizer state, write the weights and the state)
                at HBM bandwidth, after the last gradient is made: nothing overlaps it.
                Small where the state is sharded over many devices; where it is replicated
                (data parallelism) every device updates all of it.
The constants below were set on the fitting half of `published.RUNS` only
(bench/plan_published.py prints both halves): MATMUL_OVER_STEP and flash's
ATTENTION_EFFICIENCY as the pair, on a grid (steps of 0.05), whose worst fitted run is
nearest; refitted when the TPU targets' efficiencies became HFU like the GPUs' and MaxText's
Llama 3.1 v6e and Llama 2 v5p runs joined (1.35 and 0.6 before: the held-out Llama 3.1 70B
came out 0.78), and again when remat stopped counting the down projection's forward, which
no backward reads (1.2 and 0.85 before: worst fitted 11.4%, held out 8.7%). Adding the
optimizer's update left the grid's best pair where it was (worst fitted 7.5%, held out 9.7%).
"""

import dataclasses

from shardlab.plan.training import comm as plan_comm

# The matmuls' fraction of peak over the whole step's published one (hardware.Accelerator:
# the best large runs' HFU, everything in the step included): a step's large matmuls
# run faster than its average, which also carries attention, memory-bound work and exposed
# collectives. One factor for every target.
MATMUL_OVER_STEP = 1.15
# Flash attention's FLOPs run at this fraction of the matmul efficiency (its blocks are
# small, and softmax and rescaling sit between its matmuls); materialised-score attention
# runs its einsums as batched matmuls whose inner (or output) dimension is only head_dim,
# its softmax counted as memory-bound bytes.
ATTENTION_EFFICIENCY = {True: 0.9, False: 0.6}
# Elementwise passes over each tensor per layer, forward + backward (each a read or a write
# of the compute dtype): residual stream (two norms, two residual adds, the norms' backward),
# q/k/v (RoPE), MLP hidden (activation and its gradient), scores (mask, softmax, its
# backward, as XLA and Megatron's fused kernels do without flash).
ELEMENTWISE = {"d": 24, "qkv": 8, "mlp": 8, "scores": 10}


@dataclasses.dataclass(frozen=True)
class StepTime:
  matmul_s: float
  attention_s: float
  elementwise_s: float
  exposed_comm_s: float  # the collectives' part that does not overlap compute
  bubble: float
  update_s: float  # the optimizer's update of the device's state

  @property
  def compute_s(self) -> float:
    """Matmuls, attention and memory-bound work, stretched by the pipeline bubble."""
    return (self.matmul_s + self.attention_s + self.elementwise_s) / (1 - self.bubble)

  @property
  def step_s(self) -> float:
    return self.compute_s + self.exposed_comm_s + self.update_s


def matmul_efficiency(acc) -> float:
  """The fraction of peak the step's weight matmuls run at on `acc` (at most 0.95)."""
  return min(0.95, acc.efficiency * MATMUL_OVER_STEP)


def attention_flops_per_token(m, seq_len: int, remat: str) -> float:
  """Hardware FLOPs of attention's L×L einsums a token: forward 4·heads·head_dim·L a layer,
  backward twice that, the forward again where remat recomputes it."""
  forward = 4 * m.n_layers * m.n_heads * m.head_dim * seq_len
  return forward * (3 + (1 if remat != "none" else 0))  # every policy recomputes them


def elementwise_bytes(a, p: int, layer_runs: float, remat: str) -> float:
  """HBM bytes of the memory-bound work: ELEMENTWISE passes per tensor per layer run, the
  forward's half again under any remat (save-matmul-outputs keeps only the matmuls' outputs)
  (`a`: one microbatch's ActivationShapes)."""
  e = ELEMENTWISE
  per_layer = e["d"] * a.d + e["qkv"] * (a.q + 2 * a.kv) + e["mlp"] * a.mlp
  if not a.flash:
    per_layer += e["scores"] * a.scores
  if remat != "none":  # every policy reruns the norms, activations and softmax
    per_layer *= 1.5
  return per_layer * p * layer_runs


def exposed(serial_s: float, hideable_s: float, compute_s: float, n_layers: int) -> float:
  """The collectives' time that compute cannot hide (see the module docstring): `serial_s`
  of the activations' collectives, `hideable_s` of the weights' gathers and reductions."""
  return serial_s + max(0.0, hideable_s - compute_s) + hideable_s / max(n_layers, 1)


def step_time(m, train, acc, tokens_per_device: float, flops_per_device: float, a, p: int,
              layer_runs: float, serial_s: float, hideable_s: float,
              bubble: float, update_bytes: float) -> StepTime:
  """The step's time on one device (see the module docstring). `flops_per_device`: its
  hardware FLOPs, attention included; `a`: one microbatch's ActivationShapes;
  `update_bytes`: what the optimizer's update reads and writes on the device."""
  attention = attention_flops_per_token(m, train.seq_len, train.remat) * tokens_per_device
  rate = acc.peak_flops * matmul_efficiency(acc)
  matmul_s = max(flops_per_device - attention, 0.0) / rate
  attention_s = attention / (rate * ATTENTION_EFFICIENCY[a.flash])
  elementwise_s = elementwise_bytes(a, p, layer_runs, train.remat) / acc.hbm_bw
  compute = (matmul_s + attention_s + elementwise_s) / (1 - bubble)
  return StepTime(matmul_s, attention_s, elementwise_s,
                  exposed(serial_s, hideable_s, compute, m.n_layers), bubble,
                  update_bytes / acc.hbm_bw)
