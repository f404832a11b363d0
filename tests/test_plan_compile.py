"""Analytic figures against the real train step compiled on the 8 simulated CPU devices (the
reference grid's llama2-7b on 64, in a subprocess).

fp32 throughout: XLA:CPU computes bf16 in fp32 (its buffers and collectives are fp32 either
way), so bf16 is checked against the TPU compiler instead (test_plan_tpu.py).
"""

import functools

import pytest

from shardlab import config

from shardlab.plan.compiled import aot
from shardlab.runtime import hardware
from shardlab.sharding import mesh as mesh_lib
from shardlab.plan.training import planner as plan
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.models import registry

STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp")
MESHES = {"dp": "data:8", "zero1": "data:8", "zero2": "data:8", "fsdp": "fsdp:8",
          "tp": "data:4,tensor:2", "fsdp_tp": "fsdp:4,tensor:2",
          "tp_sp": "data:4,tensor:2", "fsdp_tp_sp": "fsdp:4,tensor:2"}
CASES = ([("tiny", s, "none", 32) for s in STRATEGIES] +
         [("125m", s, "none", 16) for s in STRATEGIES] +
         [("tiny", "fsdp", "full", 32), ("tiny", "zero2", "save-matmul-outputs", 32)] +
         [("gpt2-tiny", s, "none", 32) for s in ("zero2", "fsdp", "fsdp_tp")] +
         # Sequence parallelism: the residual stream's saved tensors split over tensor, its
         # all-gathers, and its reduce-scatters (all-reduce + slice on XLA:CPU).
         [("tiny", "tp_sp", "none", 32), ("125m", "fsdp_tp_sp", "none", 16)])


# Measured deviations beyond 10%, with the reason; the ratio must stay inside the band.
KNOWN = {
    # Measured 0.86: under fsdp_tp XLA gathers more than the weights for tiny (vocab 256,
    # d_model 128); not yet broken down (0.5 MB of 3.8 MB).
    ("tiny", "fsdp_tp", "all-gather"): (0.80, 0.90),
    # Measured 0.74 (10.10 of 13.69 MB). At XLA:CPU's peak, the MLP's backward in a rebuilt
    # layer (the "Live ranges at N (peak)" list of the step's *-live-range.txt dump), the
    # layer's recomputed attention probabilities are still live, in two layouts (2 × 1 MB,
    # B×H×L×L fp32), beside the MLP's three F-wide buffers: the formula counts one phase at
    # a time. That is 2.1 MB of the 3.6 MB gap; the rest is not broken down. The real
    # presets' grid (below) is within 15%.
    ("tiny", "fsdp", "full", "total"): (0.70, 0.80),
    # Measured 0.82: the same transient (0.71 for this row at full remat); the matmul outputs
    # the policy keeps are the planner's to the byte (tests/test_remat_policies.py).
    ("tiny", "zero2", "save-matmul-outputs", "total"): (0.78, 0.88),
    # Measured 1.15: the tensor all-reduces are modelled on llama's block; GPT-2's differ in
    # a way not yet broken down (the learned position table's gradient accounts for 0.2 MB
    # of the 2.3 MB: XLA reduces only the rows in use).
    ("gpt2-tiny", "fsdp_tp", "all-reduce"): (1.05, 1.20),
    # Measured 0.85: tiny's layer backward holds more than the formula's transient, as under
    # tp (0.87); what sequence parallelism saves is exact (the test below).
    ("tiny", "tp_sp", "none", "total"): (0.80, 0.90),
}


@functools.cache  # the sequence-parallel test below compares two of the rows
def compiled_and_analytic(model, strategy, remat, batch, precision="fp32", grad_dtype="auto",
                          lora=config.LoraConfig()):
  req = plan.Request.of(model=model, precision=precision, grad_dtype=grad_dtype,
                        global_batch=batch, seq_len=128, remat=remat, strategy=strategy,
                        mesh=MESHES[strategy], target="a100-80g", lora=lora)
  spec = mesh_lib.load(req.mesh)
  report = aot.compile_on_cpu(plan_compile.run_config(req, spec), 8)
  est = plan.estimate(req, registry.load(model), hardware.get(req.target), spec,
                      backend="cpu")
  return report, est, plan_compile.compare(report, est)["ratio"]


@pytest.mark.parametrize("model, strategy, remat, batch", CASES,
                         ids=[f"{m}-{s}-{r}" for m, s, r, _ in CASES])
def test_analytic_memory_and_collectives_match_the_compiled_step(model, strategy, remat, batch):
  report, est, ratio = compiled_and_analytic(model, strategy, remat, batch)
  assert ratio["state"] == pytest.approx(1, abs=0.02), ratio
  low, high = KNOWN.get((model, strategy, remat, "total"), (0.85, 1.15))
  assert low <= ratio["total"] <= high, ratio
  for kind in ("all-gather", "reduce-scatter", "all-reduce"):
    got = report.kinds()[kind]["bytes"]
    want = est.collectives[kind]
    # Collectives of a few KB (loss scalars, norm partial sums) are not modelled.
    if max(got, want) <= 0.01 * sum(c["bytes"] for c in report.kinds().values()):
      continue
    low, high = KNOWN.get((model, strategy, kind), (0.90, 1.10))
    assert low <= want / got <= high, (kind, got, want)


def test_sequence_parallel_saving_matches_the_compiled_step():
  """tp_sp keeps each layer's saved B×L×D tensors (the norms' inputs and outputs) split over
  tensor, where tp keeps them whole: tiny on data:4 × tensor:2 holds 4.4 MB less per device
  compiled (4 layers × 4 tensors × half of 0.5 MB), and the planner's difference is the same
  within 5%. (llama2-7b on data:8 × tensor:8 at 2048 tokens: 51.2 GB against tp's 82.3 GB
  compiled, planned 0.97 of it.)"""
  tp, tp_est, _ = compiled_and_analytic("tiny", "tp", "none", 32)
  sp, sp_est, _ = compiled_and_analytic("tiny", "tp_sp", "none", 32)
  saved = tp.total_bytes - sp.total_bytes
  assert saved > 4e6, (tp.total_bytes, sp.total_bytes)
  assert tp_est.memory.total - sp_est.memory.total == pytest.approx(saved, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("model, strategy, remat, seq", plan_compile.GRID,
                         ids=["-".join(map(str, c)) for c in plan_compile.GRID])
def test_total_memory_matches_the_compiled_step_on_the_grid(model, strategy, remat, seq):
  """Every model × strategy × remat × sequence length of the reference grid (real presets,
  llama2-7b on 64 simulated devices; 36 compiles, about 4 minutes on 2 cores): the planner's
  per-device total (state, activations, temporaries) within 15% of XLA's memory analysis.
  Measured 0.86-1.09 (docs/planning.md has the table); the lowest, 125m with full remat at
  2048, is XLA:CPU materialising the attention mask and its fp32 fill value for every head
  outside the layer loop (5 bytes a score), which a TPU fuses away and the formula leaves out."""
  compared = plan_compile.compare_on_cpu(plan_compile.grid_request(model, strategy, remat, seq))
  ratio = compared["ratio"]
  assert ratio["state"] == pytest.approx(1, abs=0.02), ratio
  assert ratio["total"] == pytest.approx(1, abs=0.15), (ratio, compared["report"])


POLICIES = [("bf16", "auto"), ("bf16", "bf16"), ("bf16-params", "auto")]


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "fsdp"])
@pytest.mark.parametrize("precision, grad_dtype", POLICIES)
def test_state_bytes_match_the_compiled_step_in_every_policy(strategy, precision, grad_dtype):
  """What the step holds between steps (stored weights, optimizer state, the batch) is the
  compiled step's argument bytes, for every ZeRO stage and precision policy."""
  _, _, ratio = compiled_and_analytic("tiny", strategy, "none", 32, precision, grad_dtype)
  assert ratio["state"] == pytest.approx(1, abs=0.02), ratio


@pytest.mark.parametrize("strategy", ["zero2", "fsdp", "fsdp_tp"])
def test_lora_memory_and_collectives_match_the_compiled_step(strategy):
  """LoRA's frozen base: no gradient to reduce, no optimizer state (measured totals 1.02 to
  1.14; the all-reduces are the adapters' gradients alone, 5.6 MB against 438 MB of a full
  fine-tune's under fsdp)."""
  report, est, ratio = compiled_and_analytic("125m", strategy, "none", 16,
                                             lora=config.LoraConfig(rank=8))
  assert ratio["state"] == pytest.approx(1, abs=0.02), ratio
  assert ratio["total"] == pytest.approx(1, abs=0.15), ratio
  for kind in ("all-gather", "all-reduce"):
    assert ratio[kind] == pytest.approx(1, abs=0.10), (kind, ratio)


def test_a_mesh_larger_than_this_process_compiles_in_a_subprocess():
  req = plan.Request.of(model="tiny", precision="fp32", devices=16, global_batch=32, seq_len=128,
                        remat="none", target="a100-80g")
  result = plan_compile.attach(plan.plan(req), ("cpu",))
  (compiled,) = result.compiled
  assert compiled["report"]["where"] == "cpu x16"
  assert compiled["ratio"]["state"] == pytest.approx(1, abs=0.02)


def test_cli_compile_json(capsys):
  import json

  from shardlab.cli import plan as plan_cli
  argv = ["--model", "tiny", "--mesh", "fsdp:8", "--target", "h100-80g", "--precision", "fp32",
          "--global-batch", "32", "--seq-len", "128", "--remat", "none", "--compile", "--json"]
  assert plan_cli.plan_main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  (compiled,) = out["compiled"]
  assert compiled["report"]["n_devices"] == 8
  assert compiled["ratio"]["total"] == pytest.approx(1, abs=0.15)


def test_compile_on_gpu_says_what_it_needs(monkeypatch):
  # On a GPU machine `--compile-on gpu` compiles for the plan's GPUs mocked on its one
  # (docs/planning.md, "On a GPU's compiler"); CI has no GPU, so the refusals are checked.
  from shardlab.errors import ConfigError
  from shardlab.runtime import accelerators

  def request(target, devices):
    return plan.Request.of(model="tiny", precision="bf16", devices=devices, global_batch=32,
                           seq_len=128, remat="none", target=target)

  with pytest.raises(ConfigError, match="needs a GPU target, got 'tpu-v5e'"):
    plan_compile.where(request("tpu-v5e", 8), "gpu")
  monkeypatch.setattr(accelerators, "accelerator_present", lambda: False)
  with pytest.raises(ConfigError, match="has none"):
    plan_compile.where(request("h100-80g", 8), "gpu")
  monkeypatch.setattr(accelerators, "accelerator_present", lambda: True)
  assert plan_compile.where(request("h100-80g", 8), "gpu") == ("gpu",)
  # 64 H100s are 8 nodes: the planner's mesh puts an axis on DCN, which processes of this
  # machine's GPUs cannot stand for.
  assert max(plan_compile._spec(request("h100-80g", 64)).dcn.values()) > 1
  with pytest.raises(ConfigError, match="DCN axes"):
    plan_compile.where(request("h100-80g", 64), "gpu")


def test_compile_on_gpu_without_a_gpu_is_a_clear_error():
  from shardlab.errors import ConfigError

  req = plan.Request.of(model="tiny", precision="bf16", devices=2, global_batch=8, seq_len=64,
                        remat="none", target="h100-80g")
  with pytest.raises(ConfigError, match="JAX sees no GPU here"):
    aot.compile_on_gpu(plan_compile.run_config(req, plan_compile._spec(req)), 2)
