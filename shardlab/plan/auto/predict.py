"""A candidate's step from its compiled program, by the planner's step-time model
(plan/training/step_time.py, fitted against published runs) rather than a program's FLOPs at
one constant fraction of peak.

The formula's step for the target gives each part's time; the compiled program corrects the
two it can see:
  compute       the weight matmuls and attention, scaled by the program's dot FLOPs over the
                formula's (loops unrolled, `observe.hlo_flops`; attention a fused kernel runs,
                splash or cuDNN, is not among the dots, so it is added back from the formula:
                `Estimate.kernel_flops`); the memory-bound work and the pipeline bubble as
                the formula has them;
  collectives   the activations' (serial) and the weights' (hideable behind compute) times,
                each scaled by the program's collective bytes over the formula's as compiled
                (XLA:CPU moves bf16 collectives as fp32); traffic the formula has none of
                crosses the slowest link the mesh has, exposed in full;
and the step is compute plus the collectives' exposed part (`step_time.exposed`) plus the
optimizer's update as the formula has it, or the HBM or host-transfer floor where either is
longer, as the planner's is.
"""

from shardlab.observe.step_report import StepReport
from shardlab.plan.training import step_time as plan_time
from shardlab.plan.training.estimate import Estimate
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib


def predict(report: StepReport, target_est: Estimate, compiled_est: Estimate,
            acc: hardware.Accelerator, spec: mesh_lib.MeshSpec,
            n_layers: int = 1) -> tuple[float, str]:
  """(step seconds, what bounds it) from a compiled program; `target_est` is the formula for
  the target, `compiled_est` the formula spelled for the backend it was compiled on."""
  t = target_est.time
  expected = compiled_est.flops_per_device - compiled_est.kernel_flops  # the dots it should run
  dots = report.flops / expected if expected > 0 else 1.0
  compute = ((t.matmul_s + t.attention_s) * dots + t.elementwise_s) / (1 - t.bubble)
  compiled_bytes = sum(k["bytes"] for k in report.kinds().values())
  formula_bytes = sum(compiled_est.collectives.values())
  if formula_bytes:
    scale = compiled_bytes / formula_bytes
    serial, hideable = target_est.serial_comm_s * scale, target_est.hideable_comm_s * scale
  else:
    serial, hideable = compiled_bytes / (acc.dcn_bw if spec.dcn else acc.ici_bw), 0.0
  exposed = plan_time.exposed(serial, hideable, compute, n_layers)
  terms = {"compute": compute + exposed + t.update_s, "memory": target_est.memory_s,
           "host transfers": target_est.host_s}
  longest = max(terms, key=terms.get)
  bound = "communication" if longest == "compute" and exposed > compute else longest
  return terms[longest], bound
