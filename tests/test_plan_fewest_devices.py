"""The fewest-devices scan (`shardlab plan`'s "minimum devices" lines) skips, at each further
microbatch count, the meshes whose state alone was already too large: the answers must be
the ones the full scan gives."""

import dataclasses

from shardlab.models import registry
from shardlab.plan.training import estimate, fewest, planner
from shardlab.runtime import hardware


def test_skipping_meshes_whose_state_cannot_fit_changes_no_answer(monkeypatch):
  """llama2-7b, 64 × 2048 tokens, no remat, on 40 GB GPUs given 3 GB: most meshes at one
  microbatch hold more state than that, and nothing fits until 16 microbatches (128
  devices) or 1,024 devices at one."""
  model = dataclasses.replace(registry.load("llama2-7b"), attention="xla")
  acc = dataclasses.replace(hardware.get("a100-40g"), hbm_bytes=3e9)
  req = planner.Request.of(model=model, target="a100-40g", global_batch=64, seq_len=2048,
                           remat="none", devices=8)
  rules_out, skipped = fewest._Floors.rules_out, []
  monkeypatch.setattr(fewest._Floors, "rules_out",
                      lambda *args: skipped.append(rules_out(*args)) or skipped[-1])
  pruned, pruned_least = planner.min_devices(req, model, acc)
  assert sum(skipped) > 100  # the saving is real (808 meshes skipped here)
  monkeypatch.setattr(fewest._Floors, "rules_out", lambda *args: False)
  full, full_least = planner.min_devices(req, model, acc)
  assert pruned == full
  assert pruned["any_microbatches"]["microbatches"] > 1  # the later scans did run
  assert (pruned_least.strategy, pruned_least.mesh, pruned_least.memory) == \
         (full_least.strategy, full_least.mesh, full_least.memory)


def test_estimates_sharing_a_placement_equal_fresh_ones():
  """A scan's estimates share each (strategy, mesh)'s shardings and what follows from them
  alone (plan/training/placed.py) across microbatch counts and rules: every estimate equals
  the one made with nothing computed before it."""
  model = dataclasses.replace(registry.load("llama2-7b"), attention="xla")
  acc = hardware.get("a100-40g")
  spec = estimate.split_ici_dcn({"data": 2, "fsdp": 4, "tensor": 2}, acc.ici_domain)
  base = planner.Request.of(model=model, target="a100-40g", global_batch=64, seq_len=2048,
                            remat="full", devices=16)
  requests = [(base, "fsdp_tp"), (base.with_train(microbatches=4), "fsdp_tp"),
              (base.with_train(microbatches=4), "zero2"),
              (dataclasses.replace(base, rules={"params": {"mlp": None}}), "fsdp_tp"),
              (base.with_train(microbatches=8, grad_dtype="bf16"), "fsdp_tp")]
  shared = [estimate.estimate(req, model, acc, spec, strategy) for req, strategy in requests]
  fresh = []
  for req, strategy in requests:
    estimate._abstract_state.cache_clear()
    fresh.append(estimate.estimate(req, model, acc, spec, strategy))
  assert shared == fresh
  # The cases differ where they should: the accumulator, the strategy, the override.
  assert len({(e.memory.grads, e.memory.params, e.comm_s) for e in shared}) == len(shared)
