"""The planner on the newer families: a Gemma 2 shape and Qwen3's against the train step
compiled on the 8 simulated CPU devices, a real Qwen3 against the TPU compiler on a v5e-256,
and `plan train` / `plan serve` on every new real preset.

On CPU: fp32 (XLA:CPU computes bf16 in fp32), one 512-token sequence a device, as the
reference grid (tests/test_plan_compile.py). The Gemma 2 shape keeps what sets its memory
apart from llama's: layers scanned two a step (local, global: its `layers_per_scan_step`),
attention soft-capping (its backward recomputes the fp32 scores), the final-logit soft-cap
(XLA:CPU holds the capped fp32 logits too; the vocabulary is 4096 so that the loss counts),
a window shorter than the sequence (dense attention masks it: no memory of its own). The
Gemma 3 shape (slow) scans six layers a step, twice. Qwen3's (qwen3-tiny) has q/k head norms
and a head_dim (64) that is not d_model / n_heads.
"""

import json

import pytest

from shardlab.cli import plan as plan_cli
from shardlab.models import protocol, registry
from shardlab.plan.compiled import aot
from shardlab.plan.compiled import train_step as plan_compile
from shardlab.plan.training import planner as plan
from shardlab.runtime import hardware

GEMMA2 = """
arch = "gemma2"
vocab_size = 4096
d_model = 128
n_layers = 4
n_heads = 4
n_kv_heads = 2
head_dim = 32
mlp_dim = 384
max_seq_len = 512
query_pre_attn_scalar = 32.0
sliding_window = 128
"""
# Gemma 3's pattern: five local layers to a global one, scanned six a step, two steps.
GEMMA3 = """
arch = "gemma3"
vocab_size = 256
d_model = 128
n_layers = 12
n_heads = 4
n_kv_heads = 2
head_dim = 32
mlp_dim = 384
max_seq_len = 512
query_pre_attn_scalar = 32.0
sliding_window = 128
"""
MESHES = {"fsdp": "fsdp:8", "fsdp_tp": "fsdp:4,tensor:2"}
# Each model under both strategies and both remat settings; Gemma 2's other pairing and the
# Gemma 3 shape are slow-marked (each compile takes 10 to 30 s on 2 cores).
CASES = [("gemma2", "fsdp", "none"), ("gemma2", "fsdp_tp", "full"),
         ("qwen3-tiny", "fsdp", "full"), ("qwen3-tiny", "fsdp_tp", "none")]
SLOW = [("gemma2", "fsdp", "full"), ("gemma2", "fsdp_tp", "none"),
        ("gemma3", "fsdp", "none"), ("gemma3", "fsdp", "full")]
CASES += [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW]
# What the planner reads off Gemma's config beyond llama's (models/protocol.py).
GEMMA_MEMBERS = ("layers_per_scan_step", "backward_transients", "loss_fp32_logits")
NEW_PRESETS = ("qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "mistral-7b", "gemma2-9b",
               "gemma3-12b")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
  folder = tmp_path_factory.mktemp("models")
  (folder / "gemma2-small.toml").write_text(GEMMA2)
  (folder / "gemma3-small.toml").write_text(GEMMA3)
  return {"gemma2": str(folder / "gemma2-small.toml"),
          "gemma3": str(folder / "gemma3-small.toml"), "qwen3-tiny": "qwen3-tiny"}


class Without:
  """`model` as a config that lacks `members` (the planner then takes their defaults)."""

  def __init__(self, model, members):
    self._model, self._members = model, members

  def __getattr__(self, name):
    if name in self._members:
      raise AttributeError(name)
    return getattr(self._model, name)


def ratio(report, req, model) -> dict:
  est = plan.estimate(req, model, hardware.get(req.target), plan_compile._spec(req),
                      backend="cpu")
  return plan_compile.compare(report, est)["ratio"]


@pytest.mark.parametrize("model, strategy, remat", CASES)
def test_planner_memory_is_within_15_percent_of_the_compiled_step(models, model, strategy,
                                                                  remat):
  """Measured (planner / compiled, per device): gemma2 fsdp 0.889 (none), 0.872 (full),
  fsdp_tp 0.898 (none), 0.876 (full); qwen3-tiny fsdp full 0.890, fsdp_tp none 0.887 (the
  other pairing, measured once: 0.889, 0.881); gemma3 (six layers a step) 1.061 (none) and
  0.950 (full). llama's tiny at this shape is at 0.90: XLA:CPU fills the attention mask's
  fp32 value for every head once outside the layer loop (5 bytes a score), which the
  formula leaves out (docs/planning.md). Without Gemma's members the planner said 0.68 to
  0.70 (gemma2) and 0.62 (gemma3) without remat, 0.42 to 0.45 and 0.23 with: a scan step
  of several layers holds all their buffers (rebuilt together under remat), and Gemma 2's
  soft-cap's backward an fp32 score array more."""
  req = plan.Request.of(model=models[model], precision="fp32", global_batch=8, seq_len=512,
                        remat=remat, strategy=strategy, mesh=MESHES[strategy],
                        target="a100-80g")
  spec = plan_compile._spec(req)
  report = aot.compile_on_cpu(plan_compile.run_config(req, spec), spec.n_devices)
  config = registry.load(models[model])
  got = ratio(report, req, config)
  assert got["state"] == pytest.approx(1, abs=0.02), got
  assert got["total"] == pytest.approx(1, abs=0.15), got
  if model.startswith("gemma"):
    assert all(protocol.has(config, m) for m in GEMMA_MEMBERS)
    assert ratio(report, req, Without(config, GEMMA_MEMBERS))["total"] < 0.8


@pytest.mark.slow
@pytest.mark.skipif(not aot.libtpu_available(),
                    reason="libtpu is not installed (pip install 'jax[tpu]==0.10.2'; it "
                           "needs no TPU)")
def test_qwen3_8b_fits_a_v5e_256_as_the_planner_says():
  """tests/test_plan_tpu.py's v5e-256 setup (FSDP, one 2048-token sequence a chip, full
  remat, bf16 compute over fp32 weights) for qwen3-8b: it fits, and the planner's per-chip
  total is within 15% of the TPU compiler's. Measured 0.949 (5.07 GiB compiled, 4.81
  planned; state 1.000), compiled in 145 s beside other work. gemma2-9b on the same setup
  measured 0.928 (6.77 GiB; the TPU compiler fuses its logit soft-cap into the loss, where
  XLA:CPU holds a capped fp32 copy), but its compiled arguments are 11% over the state's
  formula, not broken down (its d_model splits 14 a chip), so qwen3-8b (16 a chip) is the
  one held."""
  req = plan.Request.of(model="qwen3-8b", precision="bf16", global_batch=256, seq_len=2048,
                        remat="full", strategy="fsdp", devices=256, target="tpu-v5e")
  spec = plan_compile._spec(req)
  report = aot.compile_on_tpu(plan_compile.run_config(req, spec), "v5e", 256)
  est = plan.estimate(req, registry.load("qwen3-8b"), hardware.get("tpu-v5e"), spec)
  compared = plan_compile.compare(report, est)
  assert compared["fits"] and est.fits
  assert compared["ratio"]["state"] == pytest.approx(1, abs=0.02), compared["ratio"]
  assert compared["ratio"]["total"] == pytest.approx(1, abs=0.15), compared["ratio"]


def plan_json(capsys, *argv: str) -> dict:
  assert plan_cli.plan_main([*argv, "--json"]) == 0, capsys.readouterr().err
  return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", NEW_PRESETS)
def test_plan_train_and_serve_answer_for_every_new_preset(capsys, preset):
  """The analytic planners on each new family's real size, defaults only: `plan train`
  finds the fewest devices it fits on, `plan serve` holds the bf16 weights."""
  n_params = registry.load(preset).n_params
  train = plan_json(capsys, "train", "--model", preset)
  assert train["model"]["params"] == n_params
  assert train["estimate"]["fits"] and not train["warnings"]
  assert train["estimate"]["n_devices"] == train["fewest_devices"]["devices"]
  serve = plan_json(capsys, "serve", "--model", preset)
  assert serve["model"]["params"] == n_params and serve["fits"]
  assert serve["memory"]["weights"] == 2 * n_params
