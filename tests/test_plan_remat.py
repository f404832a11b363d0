"""What the planner runs a step as: every remat policy the layer scan offers, modelled (the
residuals kept on the device, those kept in host memory, the forward run again); presets
planned with the attention their target runs; and the layout chooser predicting a compiled
candidate's step by the step-time model (plan/auto/predict.py), not by FLOPs at one
efficiency."""

import dataclasses

import pytest

from shardlab import parallel
from shardlab.models import registry
from shardlab.observe.step_report import CollectiveRow, StepReport
from shardlab.plan.auto.predict import predict
from shardlab.plan.training import estimate as est_lib
from shardlab.plan.training import step_time
from shardlab.plan.training.request import Request
from shardlab.runtime import hardware

DEVICES, BATCH, SEQ = 8, 8, 2048  # one 2048-token sequence per device


def plan(model, target: str = "h100-80g", backend: str | None = None, **train):
  req = Request.of(model=model, strategy="fsdp", target=target, precision="bf16",
                   global_batch=BATCH, seq_len=SEQ, **train)
  acc = hardware.get(target)
  spec = est_lib.split_ici_dcn({"fsdp": DEVICES}, acc.ici_domain)
  m = registry.load(model) if isinstance(model, str) else model
  return est_lib.estimate(req, m, acc, spec, backend=backend)


def test_every_remat_policy_the_layer_scan_runs_is_planned():
  """125m, one sequence a device: the host keeps exactly offload's layer inputs; the
  backward pass reruns the forward under full and offload (all but the down projection,
  whose output no backward reads), attention's score einsums
  under save-matmul-outputs (the weight matmuls' outputs are kept), nothing without remat;
  and the device keeps less the more a policy recomputes or offloads."""
  assert set(est_lib.REMAT_POLICIES) == set(parallel.REMAT_POLICIES)
  m = registry.load("125m")
  e = {r: plan("125m", remat=r) for r in est_lib.REMAT_POLICIES}
  tokens = BATCH * SEQ / DEVICES
  attention_forward = 4 * m.n_layers * m.n_heads * m.head_dim * SEQ * tokens
  assert e["none"].flops_per_device == m.flops_per_token(SEQ) * tokens
  rerun = {"none": 0, "save-matmul-outputs": attention_forward,
           "full": 2 * (m.n_layer_params - m.n_layers * m.d_model * m.mlp_dim) * tokens
           + attention_forward}
  rerun["offload"] = rerun["full"]
  for r, extra in rerun.items():
    assert e[r].flops_per_device - e["none"].flops_per_device == pytest.approx(extra), r
  layer_input = SEQ * m.d_model * 2  # B×L×D of one sequence, bf16
  assert e["offload"].memory.host == m.n_layers * layer_input
  assert all(e[r].memory.host == 0 for r in ("none", "full", "save-matmul-outputs"))
  acts = [e[r].memory.activations for r in ("none", "save-matmul-outputs", "full", "offload")]
  assert acts == sorted(acts, reverse=True) and len(set(acts)) == 4, acts
  # The stack's saved inputs leave the device (one layer's rebuilt input stays transient).
  assert acts[2] - acts[3] >= (m.n_layers - 1) * layer_input
  # Every policy reruns the memory-bound work of the forward; the step lengthens with what
  # is recomputed, and offload's transfers are counted (both ways, at the host link).
  elementwise = {r: e[r].time.elementwise_s for r in e}
  assert all(elementwise[r] == pytest.approx(1.5 * elementwise["none"]) for r in rerun
             if r != "none")
  steps = [e[r].step_s for r in ("none", "save-matmul-outputs", "full")]
  assert steps == sorted(steps) and len(set(steps)) == 3
  assert e["offload"].host_transfer_bytes == 2 * e["offload"].memory.host
  assert e["offload"].step_s >= e["full"].step_s


def test_full_size_presets_run_the_targets_attention():
  """Every preset but the tiny CPU ones says "auto" (flash where the target has a kernel);
  Gemma 2's soft-capped scores keep plain attention, which cuDNN's kernel refuses."""
  for name in registry.presets():
    want = "xla" if "tiny" in name or name == "gemma2-9b" else "auto"
    assert registry.load(name).attention == want, name


@pytest.mark.parametrize("target", ["h100-80g", "tpu-v5e"])
def test_presets_plan_with_the_attention_the_target_runs(target):
  """llama2-7b planned for a GPU or TPU is planned with flash attention (no L×L scores), as
  the step runs there; a user's `attention = "xla"` is kept; planned for the CPU compiler,
  whose step runs plain attention, it is plain."""
  preset = registry.load("llama2-7b")
  planned = plan("llama2-7b", target)
  flash = plan(dataclasses.replace(preset, attention="flash"), target)
  dense = plan(dataclasses.replace(preset, attention="xla"), target)
  assert planned.memory == flash.memory and planned.step_s == flash.step_s
  # No L×L scores: on a TPU flash's peak is then the loss stage's (XLA:TPU holds the fp32
  # logits through its backward, memory.loss_transients), 0.78 of plain attention's here.
  assert planned.memory.activations < 0.8 * dense.memory.activations
  assert planned.kernel_flops > 0 and dense.kernel_flops == 0  # one fused kernel there
  on_cpu = plan("llama2-7b", target, backend="cpu")
  assert on_cpu.memory == plan(dataclasses.replace(preset, attention="xla"), target,
                               backend="cpu").memory


def program(e: est_lib.Estimate, flops: float) -> StepReport:
  """A compiled step's report with the formula's collective bytes and `flops` in its dots."""
  rows = [CollectiveRow(k, "fsdp", 1, b, 1) for k, b in e.collectives.items() if b]
  return StepReport(collectives=rows, argument_bytes=0, output_bytes=0, alias_bytes=0,
                    temp_bytes=0, flops=flops)


@pytest.mark.parametrize("target, remat", [("h100-80g", "full"), ("tpu-v5e", "offload"),
                                           ("a100-80g", "save-matmul-outputs")])
def test_a_compiled_step_is_predicted_by_the_step_time_model(target, remat):
  """A program whose dots and collectives are the formula's predicts the planner's own step
  (flash's fused kernel is not among the dots: it is added back); twice the dot FLOPs
  doubles the matmuls' and attention's time, the memory-bound work, the collectives and the
  optimizer's update as they were."""
  e, acc = plan("125m", target, remat=remat), hardware.get(target)
  spec = est_lib.split_ici_dcn({"fsdp": DEVICES}, acc.ici_domain)
  layers = registry.load("125m").n_layers
  seen = e.flops_per_device - e.kernel_flops
  step, bound = predict(program(e, seen), e, e, acc, spec, layers)
  assert step == pytest.approx(e.step_s, rel=1e-6) and bound == e.binding
  t = e.time
  compute = (2 * (t.matmul_s + t.attention_s) + t.elementwise_s) / (1 - t.bubble)
  want = (compute + step_time.exposed(e.serial_comm_s, e.hideable_comm_s, compute, layers) +
          t.update_s)
  doubled, _ = predict(program(e, 2 * seen), e, e, acc, spec, layers)
  assert doubled == pytest.approx(max(want, e.memory_s, e.host_s), rel=1e-6)
