"""The analytic estimate for one mesh and strategy: per-device memory, collectives and a
roofline step time, all from `state.shardings` on an abstract mesh (no devices, no memory).
"""

import dataclasses
import functools
import math
import types

import jax.numpy as jnp
from jax.sharding import AbstractMesh

from shardlab import config as config_lib
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.training import precision as precision_lib
from shardlab.plan.training import comm as plan_comm
from shardlab.plan.training import experts as plan_experts
from shardlab.plan.training import gathered as plan_gathered
from shardlab.plan.training import memory as plan_memory
from shardlab.plan.training import pipeline as plan_pipeline
from shardlab.plan.training import placed as placed_lib
from shardlab.plan.training import recompute
from shardlab.plan.training import state_bytes
from shardlab.plan.training import step_time as plan_time
from shardlab.plan.training import weight_comm
from shardlab.plan.training.request import Request, train_config
from shardlab.sharding import rules as rules_lib
from shardlab import remat as remat_lib
from shardlab.errors import ConfigError
from shardlab.models import protocol
from shardlab.training import run as run_lib
from shardlab.training import step as step_lib

MAX_DEVICES = 65536
STRATEGIES = tuple(rules_lib.STRATEGIES)
# The layer scan's remat policies (parallel.REMAT_POLICIES), each modelled: the residuals
# kept on the device (memory.layer_saved_bytes), those kept in host memory
# (memory.offloaded_activation_bytes: Memory.host, and the host-transfer time), and the
# forward work the backward pass runs again (recompute.hardware_flops_per_token, step_time);
# a custom policy (remat.policy) is modelled by the same terms.
REMAT_POLICIES = tuple(remat_lib.POLICIES)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Analytic figures for one (strategy, mesh)."""
  strategy: str
  mesh: str  # "data=2 fsdp=32 tensor=1"
  mesh_shape: dict
  n_devices: int
  memory: plan_memory.Memory
  usable_bytes: float
  collectives: dict  # kind -> bytes per device per step
  flops_per_device: float  # hardware FLOPs per step (remat recompute included)
  model_flops_per_device: float
  compute_s: float  # matmuls, attention and memory-bound ops, bubble included (step_time)
  memory_s: float  # all HBM traffic time (weights, activations, optimizer): a floor
  comm_s: float  # every collective's time, hidden or not
  step_s: float  # predicted: compute + the collectives' exposed part (step_time.py)
  binding: str  # "compute" | "memory" | "communication" | "host transfers"
  mfu: float  # predicted: model FLOPs / (step_s × peak)
  mfu_ceiling: float  # the roofline's: every term at 100% of peak (no run reaches it)
  efficiency: float  # the fraction of peak the matmuls run at (hardware.Accelerator)
  tokens_per_s: float
  host_transfer_bytes: float  # host↔device per device per step (offload), both ways
  host_s: float  # their time at the target's host link bandwidth
  accounting: dict  # category -> {"bytes_per_param", "divided_by"} (ZeRO's table)
  pipeline: object = None  # plan.pipeline.Pipeline when the rules split layers over stage
  time: object = None  # step_time.StepTime: the step's parts
  # The collectives' time in step_time's two kinds (activations' serial, weights' hideable),
  # and attention's FLOPs where a fused kernel (splash, cuDNN) runs them, out of sight of a
  # compiled program's dot count: what auto.predict needs to redo the step from a program.
  serial_comm_s: float = 0.0
  hideable_comm_s: float = 0.0
  kernel_flops: float = 0.0

  @property
  def fits(self) -> bool:
    return self.memory.total <= self.usable_bytes

  @property
  def headroom(self) -> float:
    return self.usable_bytes - self.memory.total


def abstract_mesh(spec: mesh_lib.MeshSpec) -> AbstractMesh:
  shape = spec.shape
  return AbstractMesh(tuple(shape.values()), tuple(shape))


@functools.lru_cache(maxsize=8)
def _abstract_state(model, train: config_lib.TrainConfig,
                    lora: config_lib.LoraConfig) -> placed_lib.State:
  return placed_lib.State(run_lib.abstract_state(config_lib.Config(model=model, train=train,
                                                                   lora=lora)))


def _shape_settings(train: config_lib.TrainConfig) -> config_lib.TrainConfig:
  """`train` without what the state's shapes do not depend on (the sequence, the batch and
  its split), so one abstract state serves every estimate of a search."""
  return dataclasses.replace(train, seq_len=1, loss_chunk=0, global_batch=1, microbatches=1)


def split_ici_dcn(shape: dict, ici_domain: int) -> mesh_lib.MeshSpec:
  """Puts the innermost axes (tensor first) on the fast domain until it is full; the rest of
  each axis crosses DCN."""
  ici, dcn, room = {}, {}, ici_domain
  for axis in [a for a in reversed(mesh_lib.AXES) if a != "stage"] + ["stage"]:  # stage: DCN
    size = shape.get(axis, 1)
    inner = math.gcd(size, room)
    room //= inner
    if axis in shape:
      ici[axis], dcn[axis] = inner, size // inner
  dcn = {a: s for a, s in dcn.items() if s > 1}
  return mesh_lib.MeshSpec(ici=ici, dcn=dcn, name="planned")


def default_shape(strategy: str, n: int, model,
                  acc: hardware.Accelerator) -> dict:
  """The usual mesh for a strategy on n devices: tensor within a node, capped at 8."""
  if strategy in ("dp", "zero1", "zero2"):
    return {"data": n, "fsdp": 1, "tensor": 1}
  if strategy == "fsdp":
    return {"data": 1, "fsdp": n, "tensor": 1}
  t = max(d for d in (1, 2, 4, 8) if n % d == 0 and d <= acc.ici_domain
          and all(x % d == 0 for x in (model.n_heads, model.n_kv_heads, model.mlp_dim,
                                       model.vocab_size)))
  return {"data": n // t, "fsdp": 1, "tensor": t} if strategy == "tp" else \
         {"data": 1, "fsdp": n // t, "tensor": t}


def resolve_mesh(req: Request, model, acc) -> mesh_lib.MeshSpec:
  if req.mesh is None:
    if req.devices is None:
      raise ConfigError("give a mesh (--mesh) or a device count (--devices)")
    return split_ici_dcn(default_shape(req.strategy, req.devices, model, acc), acc.ici_domain)
  spec = mesh_lib.load(req.mesh)
  if req.devices is not None:
    return spec.resolve(req.devices)
  if any(s == -1 for part in (spec.ici, spec.dcn) for s in part.values()):
    raise ConfigError(f"mesh {req.mesh!r} has a -1 axis: give --devices to size it")
  return spec


def estimate(req: Request, model, acc: hardware.Accelerator, spec: mesh_lib.MeshSpec,
             strategy: str | None = None, backend: str | None = None) -> Estimate:
  """Analytic memory, collectives and roofline time for one mesh and strategy (ConfigError
  if a dimension or the batch does not divide). `backend` (default: the target's kind) says
  how collectives are spelled; "cpu" to compare with a step compiled on CPU."""
  strategy = strategy or req.strategy
  train = _modelled(train_config(req))
  policy = precision_lib.resolve(train.precision)
  rules = rules_lib.strategy(strategy, req.rules)
  mesh = abstract_mesh(spec)
  # The batch check needs only the rules and the mesh: run it before the shardings (speed).
  step_lib.check_batch(train.global_batch, train.microbatches,
                       types.SimpleNamespace(rules=rules, mesh=mesh))
  held = _abstract_state(model, _shape_settings(train), req.lora)
  placed = held.placed(rules, mesh)
  abstract, sh = held.abstract, placed.shardings
  p = jnp.dtype(policy.compute_dtype).itemsize
  be = plan_comm.BACKENDS[backend or acc.kind]
  grad_dtype = precision_lib.gradient_dtype(policy, train.grad_dtype)
  uses = plan_pipeline.passes(model, train, rules, mesh)  # a pipeline loops on its own
  memory, shapes, state, offloaded_acts, accounting = _memory(
      model, train, placed, policy, grad_dtype, p, be, uses)
  weights, serial = _transfers(model, req, train, placed, policy, be, uses, shapes, p)
  tokens_per_device = _tokens_per_device(req, rules, mesh)
  flops = (recompute.hardware_flops_per_token(model, train.seq_len, train.remat) -
           _frozen_weight_grad_flops(model, req.lora)) * tokens_per_device
  model_flops = model.flops_per_token(train.seq_len) * tokens_per_device
  memory_s = _hbm_traffic(memory, shapes, model, train, p) / acc.hbm_bw
  memory, serial, _, pipe = plan_pipeline.fold(
      model, train, rules, mesh, p, abstract, sh, be.name, memory, serial, 0.0)
  seconds = lambda ts: sum(plan_comm.transfer_time(t, spec, acc) for t in ts)
  serial_s, hideable_s = seconds(serial), seconds(weights)
  comm_s = hideable_s + serial_s
  bubble = pipe.bubble if pipe else 0.0  # a pipeline's layer runs count its idle ones
  time = plan_time.step_time(model, train, acc, tokens_per_device, flops, shapes, p,
                             uses.layer_runs * (1 - bubble), serial_s, hideable_s, bubble,
                             memory.update_bytes)
  host_bytes = 2 * (state["host"] + offloaded_acts * train.microbatches)  # both ways
  terms = {"compute": time.step_s, "memory": memory_s,
           "host transfers": host_bytes / acc.host_bw}
  step_s = max(terms.values())
  binding = max(terms, key=terms.get)
  if binding == "compute" and time.exposed_comm_s > time.compute_s:
    binding = "communication"
  ceiling_s = max(flops / acc.peak_flops, memory_s, comm_s)
  return Estimate(
      strategy=strategy, mesh=spec.describe(), mesh_shape=dict(mesh.shape),
      n_devices=spec.n_devices, memory=memory, usable_bytes=acc.usable_bytes,
      collectives=plan_comm.totals(weights + serial), flops_per_device=flops,
      model_flops_per_device=model_flops, compute_s=time.compute_s, memory_s=memory_s,
      comm_s=comm_s, step_s=step_s, binding=binding,
      mfu=model_flops / (step_s * acc.peak_flops),
      mfu_ceiling=model_flops / (ceiling_s * acc.peak_flops),
      efficiency=plan_time.matmul_efficiency(acc),
      tokens_per_s=train.global_batch * train.seq_len / step_s,
      host_transfer_bytes=host_bytes, host_s=terms["host transfers"],
      accounting=accounting, pipeline=pipe, time=time,
      serial_comm_s=serial_s, hideable_comm_s=hideable_s,
      kernel_flops=_kernel_flops(model, train, be.name, shapes) * tokens_per_device)


def _modelled(train: config_lib.TrainConfig) -> config_lib.TrainConfig:
  remat_lib.policy(train.remat)  # refuses what is neither listed nor a custom spec
  return train


def _kernel_flops(model, train, platform: str, shapes) -> float:
  """Attention's FLOPs a token where flash runs as one fused kernel (splash on a TPU, cuDNN
  on a GPU), out of sight of a compiled program's dot count; under context parallelism it
  is ring.py's blockwise einsums, which the count sees."""
  if platform in ("tpu", "gpu") and shapes.flash and shapes.context == 1:
    return plan_time.attention_flops_per_token(model, train.seq_len, train.remat)
  return 0.0


def _accumulates_in_scan(model, train) -> bool:
  """Whether the layer stack adds its gradients into the microbatch accumulator in its
  backward pass (shardlab/parallel/accumulate.py): under full remat, for a stack that reaches
  the scan as it is (Gemma's regrouped layers do not)."""
  return train.remat == "full" and protocol.get(model, "layers_per_scan_step") == 1


def _memory(model, train, placed: placed_lib.Placed, policy, grad_dtype, p: int, be, uses):
  """(Memory per device, the activation shapes, the model state's bytes, the activations
  remat offload keeps in host memory, the state's bytes a parameter: ZeRO's table)."""
  abstract, rules, mesh, sh = placed.abstract, placed.rules, placed.mesh, placed.shardings
  in_scan = _accumulates_in_scan(model, train)
  # The state's bytes depend on the microbatches only through whether there is more than one.
  accumulates = min(uses.looped, 2)
  state = dict(placed.derived(
      ("model_state", accumulates, grad_dtype, train.offload, in_scan),
      lambda: state_bytes.model_state(abstract, sh, policy, accumulates, grad_dtype,
                                      train.offload, in_scan)))
  gathered, head_gathered = placed.derived(
      ("gathered", p), lambda: plan_gathered.gathered_bytes(abstract, rules, mesh, p))
  acts, batch_bytes, shapes = plan_memory.activation_memory(model, train, p, rules.activations,
                                                            mesh, head_gathered, be.name)
  offloaded_acts = plan_memory.offloaded_activation_bytes(model, shapes, p, train.remat)
  memory = plan_memory.Memory(activations=acts, gathered=gathered, batch=batch_bytes,
                              **dict(state, host=state["host"] + offloaded_acts))
  accounting = placed.derived(
      ("accounting", accumulates, grad_dtype, train.offload, in_scan),
      lambda: state_bytes.state_accounting(abstract, sh, state, policy, accumulates,
                                           grad_dtype, in_scan))
  return memory, shapes, state, offloaded_acts, accounting


def _transfers(model, req: Request, train, placed: placed_lib.Placed, policy, be, uses,
               shapes, p: int) -> tuple[list, list]:
  """Every collective of the step: the weights' (gathers and gradient reductions, which can
  run beside other layers' compute) and the activations' and experts' (which cannot)."""
  rules, mesh = placed.rules, placed.mesh
  wire = p if be.compute_dtype_collectives else 4  # XLA:CPU moves bf16 as fp32
  leaves = placed.derived(("param axes",),
                          lambda: weight_comm.param_axes(placed.abstract, rules, mesh))
  weights = weight_comm.param_transfers(leaves, rules, mesh, policy, uses.looped,
                                        model.tie_embeddings, be, uses.layer_uses)
  serial = (plan_comm.activation_transfers(model, shapes, rules, mesh, wire, train.remat,
                                           train.microbatches, uses.layer_runs,
                                           be.reduce_scatter) +
            plan_experts.transfers(model, rules, mesh, train.global_batch, train.seq_len,
                                   wire, train.remat))
  return weights, serial


def _tokens_per_device(req: Request, rules: rules_lib.Rules, mesh) -> float:
  """Tokens each device computes on per step: split over the token axes, and each token's
  heads over the tensor axes."""
  tensor_shards = math.prod(mesh.shape[a] for a in rules_lib._axes(
      rules.activations.get("heads")) if a in mesh.shape)
  token_shards = math.prod(mesh.shape[a] for a in rules.token_axes if a in mesh.shape)
  stages = rules_lib.pipeline_stages(rules, mesh)  # each stage runs 1/stages of the layers
  return req.train.global_batch * req.train.seq_len / token_shards / tensor_shards / stages


def _frozen_weight_grad_flops(model, lora: config_lib.LoraConfig) -> float:
  """Per token: the weight-gradient matmuls (2 FLOPs a parameter) a LoRA run skips for its
  frozen base, less the adapters' own training FLOPs (6 a parameter)."""
  if not lora.rank:
    return 0.0
  lookup = 0 if model.tie_embeddings else model.vocab_size * model.d_model
  return 2 * (model.n_params - lookup) - 6 * model.n_lora_params(lora)


def _hbm_traffic(memory: plan_memory.Memory, a, model, train, p: int) -> float:
  """Bytes moved to and from HBM per step (rough): weights read forward and backward (and
  again where remat reruns the forward) per microbatch, saved activations written and read,
  logits, and the optimizer's read-modify-write of params, grads and state."""
  weights = memory.params + memory.gathered
  again = remat_lib.recomputes_all(train.remat)  # offload's forward runs again too
  reads = (3 + (1 if again else 0)) * weights * train.microbatches
  acts = 2 * (memory.activations + a.logits * 4 * 2) * train.microbatches
  return reads + acts + memory.update_bytes
