"""The inference planner: KV-cache and weight bytes by hand, fit and fewest devices, the
roofline speeds, the command line; and its memory against the compiled decode step."""

import json

import pytest

from shardlab import generate
from shardlab.cli import plan as plan_cli
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.plan.compiled import aot
from shardlab.plan.serving import terms as inf
from shardlab.plan.serving import estimate as inf_estimate
from shardlab.plan.serving import planner as inference_plan
from shardlab.runtime import hardware

GiB = 2**30


def test_kv_cache_bytes_by_hand():
  # llama2-7b (MHA): 2 (K, V) × 32 layers × 4096 tokens × 32 kv heads × 128 × 2 bytes.
  llama2 = registry.load("llama2-7b")
  assert inf.kv_bytes(llama2, inf.Layout(), 1, 4096, "bf16") == 2 * 32 * 4096 * 32 * 128 * 2
  assert inf.kv_bytes(llama2, inf.Layout(), 1, 4096, "bf16") == 2 * GiB
  # llama3-8b (GQA, 8 kv heads): a quarter of the per-token bytes of MHA at 32 heads.
  llama3 = registry.load("llama3-8b")
  assert inf.kv_bytes(llama3, inf.Layout(), 1, 8192, "bf16") == 2 * 32 * 8192 * 8 * 128 * 2
  assert inf.kv_bytes(llama3, inf.Layout(), 32, 8192, "bf16") == 32 * GiB
  # kv heads over tensor, rows over data, layers over stages.
  assert inf.kv_bytes(llama3, inf.Layout(tensor=8, data=2, stage=2), 32, 8192,
                      "bf16") == 32 * GiB / 32
  # int8 entries keep a bf16 scale per token and head: 1 + 2/128 bytes an entry.
  assert inf.kv_bytes(llama3, inf.Layout(), 1, 8192, "int8") == \
      2 * 32 * 8192 * 8 * 128 * (1 + 2 / 128)


def test_kv_heads_must_divide_over_tensor():
  with pytest.raises(ConfigError, match="kv_heads"):
    inf.kv_bytes(registry.load("tiny"), inf.Layout(tensor=4), 1, 16, "bf16")


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_weight_bytes_per_dtype(dtype):
  m = registry.load("llama2-7b")
  vectors = 2 * 32 * 4096 + 4096  # the norm scales, 16-bit unless fp32
  matrices = m.n_params - vectors
  per = {"fp32": 4, "bf16": 2, "int8": 1 + 2 / 128, "int4": 0.5 + 2 / 128}[dtype]
  vec = 4 if dtype == "fp32" else 2
  whole, one_layer = inf.weight_bytes(m, inf.Layout(), dtype)
  assert whole == pytest.approx(matrices * per + vectors * vec, rel=1e-12)
  assert one_layer == pytest.approx((4096 * 128 * 128 + 3 * 4096 * 11008) * per)
  # Tensor parallelism splits every matrix (the tables over the vocabulary), not the norms.
  split = inf.weight_bytes(m, inf.Layout(tensor=2), dtype)[0]
  assert split == pytest.approx(matrices * per / 2 + vectors * vec, rel=1e-12)
  if dtype == "bf16":
    assert whole == 2 * m.n_params


def test_stages_hold_their_layers_and_one_table():
  m = registry.load("llama2-7b")
  table = 32000 * 4096 * 2
  one_layer = inf.weight_bytes(m, inf.Layout(), "bf16")[1]
  staged = inf.weight_bytes(m, inf.Layout(stage=3), "bf16")[0]
  assert staged == pytest.approx(11 * one_layer + table + (2 * 11 + 1) * 4096 * 2, rel=1e-3)
  with pytest.raises(ConfigError, match="stage"):
    inf.weight_bytes(m, inf.Layout(stage=33), "bf16")


def test_llama3_405b_has_the_released_parameter_count():
  m = registry.load("llama3-405b")
  assert m.n_params == 405_853_388_800
  assert inf.weight_bytes(m, inf.Layout(), "bf16")[0] == 2 * 405_853_388_800


def test_fit_and_fewest_devices_on_a_small_target():
  """llama2-7b in bf16 on 16 GiB v5e chips: 12.6 GiB of weights alone, so the cache, its
  copy in the step and the prefill's scores need a second chip; int4 weights fit on one."""
  req = inf.Request(model="llama2-7b", target="tpu-v5e", batch=1, context=4096)
  m, acc = registry.load("llama2-7b"), hardware.get("tpu-v5e")
  one = inf_estimate.estimate(req, m, acc, inf.Layout())
  assert one.memory.weights == pytest.approx(2 * m.n_params)
  assert one.memory.kv_cache == 2 * GiB and not one.fits
  assert inf_estimate.estimate(req, m, acc, inf.Layout(tensor=2)).fits
  result = inference_plan.plan(req)
  assert result.min_devices["tensor"]["devices"] == 2
  assert result.min_devices["overall"]["devices"] == 2
  assert result.estimate.layout == inf.Layout(tensor=2) and result.fits
  int8 = inference_plan.plan(inf.Request(model="llama2-7b", target="tpu-v5e", batch=1,
                                         context=4096, weights="int4"))
  assert int8.min_devices["overall"]["devices"] == 1 and int8.warnings  # formula only


def test_405b_needs_stages_beyond_a_node():
  req = inf.Request(model="llama3-405b", target="h100-80g", batch=1, context=8192)
  result = inference_plan.plan(req)
  assert result.min_devices["tensor"] is None  # 810 GB of weights over 8 GPUs does not fit
  overall = result.min_devices["overall"]
  assert overall["stage"] >= 2 and overall["devices"] <= 16
  assert overall["devices"] * hardware.get("h100-80g").usable_bytes > 2 * 405.8e9


def test_prefill_chunks_bound_the_scores():
  """generate prefills PREFILL_CHUNK tokens a call; the planner assumes the same, and a
  whole-context call holds every position's scores."""
  assert inf.PREFILL_CHUNK == generate.PREFILL_CHUNK
  m, acc = registry.load("llama3-70b"), hardware.get("h100-80g")
  chunked, whole = (inf_estimate.memory(inf.Request(model="llama3-70b", context=8192,
                                                    prefill_chunk=c), m, inf.Layout(tensor=8))
                    for c in (512, 8192))
  scores = 64 / 8 * (8192 - 512) * 8192 * inf_estimate.SCORE_BYTES
  assert whole.prefill_temp - chunked.prefill_temp > scores
  assert whole.decode_temp == chunked.decode_temp


def test_devices_plans_the_fastest_layout_of_that_many():
  fewest = inference_plan.plan(inf.Request(model="llama3-405b", target="h100-80g"))
  sixteen = inference_plan.plan(inf.Request(model="llama3-405b", target="h100-80g",
                                            devices=16))
  assert sixteen.estimate.layout.n_devices == 16 and sixteen.fits
  assert sixteen.estimate.layout.tensor == 8  # tensor parallel fills the node first
  assert (sixteen.estimate.decode.tokens_per_s >
          fewest.min_devices["overall"]["decode_tokens_per_s"])
  too_few = inference_plan.plan(inf.Request(model="llama3-405b", target="h100-80g",
                                            devices=4))
  assert not too_few.fits  # shown with the least memory it can take, marked as not fitting


def test_decode_is_bandwidth_bound_at_batch_one():
  req = inf.Request(model="llama3-70b", target="h100-80g", batch=1, context=8192)
  m, acc = registry.load("llama3-70b"), hardware.get("h100-80g")
  e = inf_estimate.estimate(req, m, acc, inf.Layout(tensor=8))
  assert e.decode.bound == "memory" and e.prefill.bound == "compute"
  read = e.memory.weights + e.memory.kv_cache
  assert e.bytes_per_decode_step == read
  assert e.decode.tokens_per_s_per_seq == pytest.approx(acc.hbm_bw / read)
  flops = 8192 * m.flops_per_token(8192) / 3 / 8
  assert e.prefill.step_s == pytest.approx(flops / acc.peak_flops)
  big = inf_estimate.estimate(inf.Request(model="llama3-70b", target="h100-80g", batch=32,
                                          context=8192), m, acc, inf.Layout(tensor=8))
  assert big.decode.tokens_per_s > 10 * e.decode.tokens_per_s


@pytest.mark.parametrize("kw, message", [
    ({"weights": "fp8"}, "valid: bf16, fp32, int4, int8"), ({"kv_dtype": "int4"}, "--kv-dtype"),
    ({"batch": 0}, "batch"), ({"prefill_batch": 4, "batch": 2}, "prefill_batch"),
    ({"mesh": "fsdp:2,tensor:2"}, "data, tensor and stage")])
def test_bad_input_names_the_field(kw, message):
  with pytest.raises(ConfigError, match=message):
    inference_plan.plan(inf.Request(**{"model": "tiny", "context": 64, **kw}))


def test_cli_json_and_table(capsys):
  argv = ["serve", "--model", "llama3-70b", "--target", "h100-80g", "--batch", "32",
          "--context", "8192", "--weights", "int8"]
  assert plan_cli.plan_main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["fits"] and out["decode"]["bound"] == "memory"
  assert out["min_devices"]["overall"]["devices"] == out["layout"]["devices"]
  assert out["memory"]["total"] <= out["usable_bytes"]
  assert plan_cli.plan_main(argv) == 0
  table = capsys.readouterr().out
  assert "KV cache" in table and "bound by memory" in table and "minimum devices" in table
  assert f"{out['memory']['kv_cache'] / GiB:9.2f} GiB" in table
  assert plan_cli.plan_main(argv + ["--compile"]) == 2
  assert "formula only" in capsys.readouterr().err


# Planner against the compiled decode step (fp32, which XLA:CPU computes as written).
COMPILED = [("tiny", "data:2,tensor:2", 8, 512), ("tiny", "tensor:2", 4, 256),
            ("125m", "data:2,tensor:4", 8, 2048), ("125m", "data:8", 8, 1024)]


@pytest.mark.parametrize("model, mesh, batch, context", COMPILED)
def test_planner_matches_the_compiled_decode_step(capsys, model, mesh, batch, context):
  argv = ["serve", "--model", model, "--mesh", mesh, "--batch", str(batch),
          "--context", str(context), "--weights", "fp32", "--kv-dtype", "fp32",
          "--target", "a100-80g", "--compile", "--compile-on", "cpu", "--json"]
  assert plan_cli.plan_main(argv) == 0
  compiled = json.loads(capsys.readouterr().out)["compiled"][0]
  ratio = compiled["ratio"]
  assert ratio["state"] == pytest.approx(1, abs=0.02), compiled
  assert ratio["total"] == pytest.approx(1, abs=0.15), compiled


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_planner_matches_the_decode_step_compiled_for_a_tpu_topology(capsys):
  """llama2-7b in bf16 on a v5e-8 slice (tensor=8), 16 sequences of 4096 tokens."""
  argv = ["serve", "--model", "llama2-7b", "--target", "tpu-v5e", "--mesh", "tensor:8",
          "--batch", "16", "--context", "4096", "--compile", "--json"]
  assert plan_cli.plan_main(argv) == 0
  compiled = json.loads(capsys.readouterr().out)["compiled"][0]
  assert compiled["report"]["where"] == "tpu v5e:2x4"
  assert compiled["ratio"]["state"] == pytest.approx(1, abs=0.02), compiled
  assert compiled["ratio"]["total"] == pytest.approx(1, abs=0.15), compiled
