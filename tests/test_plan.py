"""The planner's analytic side: ZeRO's figures, the HLO collective parser, search, errors."""

import dataclasses
import json
from pathlib import Path

import pytest

from shardlab.runtime import hardware
from shardlab.observe import hlo
from shardlab.plan.training import planner as plan
from shardlab.cli import plan as plan_cli
from shardlab.plan.training import plot as plan_plot
from shardlab.plan.training import step_time
from shardlab.errors import ConfigError
from shardlab.models import registry


ZERO_MODEL = str(Path(__file__).parent / "data" / "zero-7.5b.toml")
PSI = 7.5e9


@pytest.mark.parametrize("strategy, mesh, paper_gb, bytes_per_param", [
    ("dp", "data:64", 120.0, 16), ("zero1", "data:64", 31.4, 4 + 12 / 64),
    ("zero2", "data:64", 16.6, 2 + 14 / 64), ("fsdp", "fsdp:64", 1.9, 16 / 64)])
def test_cli_reproduces_zero_paper_figure_1(capsys, strategy, mesh, paper_gb, bytes_per_param):
  """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, mixed-precision Adam (16-bit
  params and grads, fp32 master and moments): per-device model state, from the public CLI."""
  argv = ["--model", ZERO_MODEL, "--strategy", strategy, "--mesh", mesh, "--target",
          "a100-80g", "--precision", "bf16", "--grad-dtype", "bf16", "--global-batch", "64",
          "--seq-len", "128", "--json"]
  assert plan_cli.plan_main(argv) == 0
  memory = json.loads(capsys.readouterr().out)["estimate"]["memory"]
  state = sum(memory[k] for k in ("params", "grads", "master", "opt_state"))
  assert state == pytest.approx(bytes_per_param * PSI, rel=0.005)
  assert round(state / 1e9, 1) == pytest.approx(paper_gb, abs=0.05)


def test_fp32_gradients_cost_what_the_default_says():
  """The default grad dtype under bf16 is fp32: 2 more bytes per parameter than Figure 1."""
  model = registry.load(ZERO_MODEL)
  req = plan.Request.of(model=ZERO_MODEL, precision="bf16", strategy="zero1", mesh="data:64",
                        global_batch=64, seq_len=128, target="a100-80g")
  e = plan.estimate(req, model, hardware.get("a100-80g"), plan.resolve_mesh(req, model, None))
  assert e.memory.grads == pytest.approx(4 * model.n_params)


HLO = """HloModule m, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ag = f32[32,16]{1,0} all-gather(%v), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[8,16]{1,0} reduce-scatter(%ag), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %rs)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %ar-start = f32[8,16]{1,0} all-reduce-start(%a), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ar-done = f32[8,16]{1,0} all-reduce-done(%ar-start)
  %cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%ar-done), channel_id=4, source_target_pairs={{0,1}}
  %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %cp-done)
  %w = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""


def test_hlo_collectives_weights_loops_and_pairs_async_ops():
  stats = hlo.collectives(HLO)
  assert stats["all-gather"] == hlo.Collective(count=3, bytes=3 * 32 * 16 * 4, ops=1)
  # reduce-scatter counts its operand (the full side).
  assert stats["reduce-scatter"] == hlo.Collective(count=3, bytes=3 * 32 * 16 * 4, ops=1)
  assert stats["all-reduce"] == hlo.Collective(count=1, bytes=8 * 16 * 4, ops=1)
  assert stats["collective-permute"] == hlo.Collective(count=1, bytes=8 * 16 * 4, ops=1)
  assert stats["all-to-all"].count == 0


def dense(preset: str):
  """A preset with plain (L×L) attention, which these figures were set with: presets run the
  target's attention ("auto": flash on GPU and TPU)."""
  return dataclasses.replace(registry.load(preset), attention="xla")


def small_request(**kw) -> plan.Request:
  base = dict(model="125m", precision="bf16", global_batch=64, seq_len=512, remat="full",
              strategy="fsdp", devices=8, target="a100-40g")
  return plan.Request.of(**{**base, **kw})


def test_search_lists_only_fitting_meshes_fastest_first():
  req = small_request(model="1b", devices=16, global_batch=32, seq_len=2048, remat="full",
                      target="tpu-v5e")
  result = plan.plan(req, search_meshes=True)
  found = result.search
  assert found, "something must fit"
  assert all(e.fits for e in found)
  assert [e.step_s for e in found] == sorted(e.step_s for e in found)
  # Some factorisations/strategies do not fit (dp replicates 1B × 16 bytes on 16 GiB).
  all_shapes = len(plan.factorizations(16)) * len(plan.STRATEGIES)
  assert len(found) < all_shapes
  assert not any(e.strategy == "dp" for e in found)
  # Every row is a factorisation of the device count.
  for e in found:
    assert e.n_devices == 16


def test_min_devices_and_fit_for_70b():
  req = plan.Request.of(model="llama2-70b", precision="bf16", global_batch=64, seq_len=4096,
                        remat="full", strategy="fsdp", devices=64, target="a100-80g")
  result = plan.plan(req)
  assert result.fits
  fsdp_min = result.min_devices["fsdp"]["devices"]
  # 70B × 18 bytes (bf16 copy, fp32 grads, master, Adam) = 1.24 TB: at least 16 × 80 GB;
  # dense attention over 4 sequences of 4096 per device then needs 32.
  assert fsdp_min == 32
  model, acc = result.model, result.target
  half = plan.estimate(req, model, acc, plan.split_ici_dcn({"fsdp": 16}, 8))
  assert not half.fits
  assert result.min_devices["dp"] is None  # 1.1 TB never fits replicated
  assert result.min_devices["overall"]["devices"] <= fsdp_min
  e = result.estimate
  assert e.collectives["all-gather"] > 0 and e.collectives["reduce-scatter"] > 0
  assert 0 < e.mfu <= 1
  assert e.binding in ("compute", "memory", "communication")


def test_cli_json_matches_table_figures(capsys):
  argv = ["--model", "125m", "--devices", "8", "--target", "a100-40g", "--global-batch", "64",
          "--seq-len", "512", "--json"]
  assert plan_cli.plan_main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["estimate"]["fits"] is True
  assert set(out["estimate"]["memory"]) >= {"params", "grads", "opt_state", "master",
                                            "activations", "total"}
  assert plan_cli.plan_main(argv[:-1] + ["--search", "--top", "3"]) == 0
  text = capsys.readouterr().out
  assert "memory per device" in text and "search:" in text and "minimum devices" in text


@pytest.mark.parametrize("kw, message", [
    (dict(target="a100-90g"), r"unknown target accelerator 'a100-90g' \(did you mean: "
                              r"a100-80g.*valid: a100-40g, .*tpu-v6e"),
    (dict(devices=0), r"devices must be >= 1, got 0"),
    (dict(mesh="data:3,fsdp:-1", devices=8), r"-1 axis cannot be inferred: 8 devices"),
    (dict(mesh="fsdp:8,tensor:5", devices=None, strategy="fsdp_tp"),
     r"param .* dim .* is not divisible by mesh axis 'tensor' \(size 5\)"),
    (dict(devices=8, global_batch=4), r"train.global_batch \(4\) is not divisible by .* "
                                      r"\(8 shards\)"),
    (dict(model=dense("llama3-70b"), global_batch=2048, seq_len=8192, remat="none",
          target="tpu-v5e"), r"cannot fit on tpu-v5e .* at any device count"),
])
def test_bad_input_is_a_clear_error(kw, message):
  with pytest.raises(ConfigError, match=message):
    plan.plan(small_request(**kw))


def test_cli_reports_errors_without_traceback(capsys):
  assert plan_cli.plan_main(["--target", "h300", "--devices", "8"]) == 2
  assert "unknown target accelerator 'h300'" in capsys.readouterr().err


def test_hardware_entries_are_complete():
  for acc in hardware.ACCELERATORS.values():
    assert acc.peak_flops > 1e14 and acc.hbm_bw > 2e11 and acc.ici_bw > acc.dcn_bw > 0
    assert 1e10 <= acc.host_bw <= 1e11  # PCIe 4.0 / 5.0 x16
    assert 0 < acc.usable_bytes < acc.hbm_bytes
    assert (acc.topology is not None) == (acc.kind == "tpu")
  assert set(hardware.names()) == {"a100-40g", "a100-80g", "h100-80g", "h100-96g-500w", "h200",
                                   "l4-24g", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"}


def test_request_is_a_plain_dataclass():
  assert dataclasses.asdict(small_request())["model"] == "125m"


def test_request_from_a_run_config_plans_what_it_would_run():
  from shardlab import config
  train = config.TrainConfig(global_batch=16, seq_len=64, precision="fp32", remat="none")
  cfg = config.Config(model=registry.load("tiny"), mesh="fsdp:8", strategy="fsdp",
                      train=train, lora=config.LoraConfig(rank=4))
  req = plan.Request.from_config(cfg, target="a100-80g")
  assert (req.train, req.lora, req.mesh, req.strategy) == (train, cfg.lora, "fsdp:8", "fsdp")
  assert plan.run_config(req, cfg.model, cfg.mesh) == cfg  # nothing lost on the way
  assert plan.plan(req).estimate.n_devices == 8


def test_a_bad_train_setting_gets_the_configs_own_error(capsys):
  # Validated once, by TrainConfig: the message names the config key.
  with pytest.raises(ConfigError, match=r"unknown train.remat 'bogus'"):
    plan.Request.of(remat="bogus")
  assert plan_cli.plan_main(["train", "--optimizer", "adam", "--devices", "8"]) == 2
  assert "unknown train.optimizer 'adam'" in capsys.readouterr().err
  # The serving mode flag is a subcommand now: refused, naming it.
  assert plan_cli.plan_main(["--inference", "--model", "tiny"]) == 2
  assert "shardlab plan serve" in capsys.readouterr().err


def _every_estimate(req: plan.Request, n: int) -> list:
  """Every valid (strategy, factorisation) on n devices, by brute force."""
  model, acc = req.model_config(), hardware.get(req.target)
  out = []
  for shape in plan.factorizations(n, req.train.seq_len):
    for strategy in plan.STRATEGIES:
      try:
        out.append(plan.estimate(req, model, acc, plan.split_ici_dcn(shape, acc.ici_domain),
                                 strategy))
      except ConfigError:
        pass
  return out


def _fits_anywhere(req: plan.Request, n: int) -> list[str]:
  return [f"{e.strategy} {e.mesh}" for e in _every_estimate(req, n) if e.fits]


def test_search_drops_duplicate_placements_and_idle_axes():
  req = small_request(model="1b", devices=16, global_batch=32, seq_len=2048, target="tpu-v5e")
  found = plan.search(req, registry.load(req.model), hardware.get(req.target), 16)
  # The same placement under two names has the same memory and traffic: one row each.
  prints = [(tuple(e.memory.as_dict().items()), tuple(e.collectives.items())) for e in found]
  assert len(set(prints)) == len(prints)
  for e in found:
    d, f, t = (e.mesh_shape[a] for a in ("data", "fsdp", "tensor"))
    c = e.mesh_shape.get("context", 1)  # 2048 tokens: context 1 or 2
    # tensor > 1 is idle unless the strategy shards heads/mlp over it; fsdp on fsdp=1 is dp
    # (unless a context axis shards the state); zero1/2 with one token shard are dp; tp's
    # fsdp axis only splits the batch, as data does; fsdp_tp without tensor is fsdp, without
    # fsdp (or context) it is tp.
    assert t == 1 or e.strategy in ("tp", "fsdp_tp", "tp_sp", "fsdp_tp_sp"), e
    assert f * c > 1 or e.strategy not in ("fsdp", "fsdp_tp"), e
    assert d * f * c > 1 or e.strategy not in ("zero1", "zero2"), e
    assert f == 1 or e.strategy != "tp", e
    assert t > 1 or e.strategy != "fsdp_tp", e
  everything = _every_estimate(req, 16)
  idle = [e for e in everything if e.fits and e.mesh_shape["tensor"] > 1 and
          e.strategy in ("dp", "zero1", "zero2", "fsdp")]
  fitting = [e for e in everything if e.fits and e not in idle]
  assert idle and len(found) < len(fitting)
  # Nothing else was lost: every other fitting candidate's figures are among the rows.
  totals = {round(e.memory.total) for e in found}
  assert all(round(e.memory.total) in totals for e in fitting)
  assert not any(round(e.memory.total) in totals for e in idle)


@pytest.mark.parametrize("batch, fewest", [(15, 3), (36, 6)])
def test_min_devices_is_not_limited_to_powers_of_two(batch, fewest):
  """125m without remat, 2048-token sequences on 16 GiB chips: 3 (6) devices is the smallest
  count with a mesh that fits; no factorisation of any smaller count fits."""
  req = small_request(model=dense("125m"), global_batch=batch, seq_len=2048, remat="none",
                      target="tpu-v5e", devices=fewest)
  mins = plan.plan(req).min_devices
  assert mins["overall"]["devices"] == fewest
  assert fewest & (fewest - 1)  # not a power of two
  for n in range(1, fewest):
    assert _fits_anywhere(req, n) == [], n
  assert f"{mins['overall']['strategy']} {mins['overall']['mesh']}" in _fits_anywhere(req, fewest)


def test_any_microbatch_count_needs_no_more_devices():
  req = small_request(model=dense("125m"), global_batch=15, seq_len=2048, remat="none",
                      target="tpu-v5e", devices=3)
  mins = plan.plan(req).min_devices
  fixed, anym = mins["overall"], mins["any_microbatches"]
  assert anym["devices"] < fixed["devices"] == 3  # accumulation: fewer sequences at once
  m = anym["microbatches"]
  assert m > 1 and req.train.global_batch % m == 0
  model, acc = req.model_config(), hardware.get(req.target)
  again = dataclasses.replace(req.with_train(microbatches=m), devices=anym["devices"],
                              strategy=anym["strategy"])
  assert plan.estimate(again, model, acc, plan.resolve_mesh(again, model, acc)).fits
  # Where the state, not the activations, sets the floor (16 A100s hold llama2-70b's 16 bytes a
  # parameter, and 512-token sequences leave room), accumulation cannot help: the answers agree.
  req70 = plan.Request.of(model="llama2-70b", global_batch=64, seq_len=512, devices=64,
                          target="a100-80g")
  mins70 = plan.plan(req70).min_devices
  assert mins70["any_microbatches"]["devices"] == mins70["overall"]["devices"] == 16


def test_too_many_microbatches_says_how_many_fit():
  """GPT-2 cannot use tensor parallelism (vocabulary 50257): 8 microbatches of a batch of 8
  leave one sequence to split, one device; a smaller count fits."""
  req = small_request(model="gpt2-774m", global_batch=8, seq_len=1024, remat="none",
                      target="tpu-v5e", microbatches=8, devices=1)
  with pytest.raises(ConfigError, match=r"at 8 microbatch\(es\) at any device count.*with "
                                        r"--microbatches \d+ it fits on \d+ devices"):
    plan.plan(req)


def test_seq_len_beyond_the_trained_context_is_a_warning(capsys):
  argv = ["--model", "125m", "--devices", "8", "--target", "a100-80g", "--global-batch", "16",
          "--seq-len", "4096"]
  assert plan_cli.plan_main(argv) == 0
  assert "warning: --seq-len 4096 exceeds 125m's trained context (max_seq_len 2048)" in \
      capsys.readouterr().out
  assert plan_cli.plan_main(argv + ["--json"]) == 0
  assert len(json.loads(capsys.readouterr().out)["warnings"]) == 1
  assert plan_cli.plan_main(argv[:-1] + ["2048", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_the_optimizer_update_is_charged_for_the_state_each_device_holds():
  """Data parallelism keeps the whole optimizer state on every device and FSDP an eighth of
  it on 8, so a dp device's update moves about 8 times the bytes (the few leaves FSDP leaves
  whole, norm scales, make it a little under 8): the time the step model adds for it, and
  what ranks dp below fsdp where the two otherwise tie (docs/auto.md)."""
  model, acc = registry.load("125m"), hardware.get("a100-80g")

  def estimate(strategy: str, mesh: str):
    req = plan.Request.of(model="125m", precision="bf16", global_batch=16, seq_len=512,
                          strategy=strategy, mesh=mesh, target=acc.name)
    return plan.estimate(req, model, acc, plan.resolve_mesh(req, model, acc))
  dp, fsdp = estimate("dp", "data:8"), estimate("fsdp", "fsdp:8")
  for e in (dp, fsdp):
    assert e.time.update_s == pytest.approx((2 * e.memory.state + e.memory.grads) / acc.hbm_bw)
  assert 7.5 < dp.time.update_s / fsdp.time.update_s <= 8
  assert dp.time.compute_s == pytest.approx(fsdp.time.compute_s)
  assert dp.step_s - dp.time.exposed_comm_s > fsdp.step_s - fsdp.time.exposed_comm_s


def test_predicted_step_is_its_parts_at_the_targets_efficiency(capsys):
  # The step time is plan/training/step_time.py's sum (matmuls at the published efficiency
  # × MATMUL_OVER_STEP, attention, memory-bound ops, exposed collectives, the optimizer's
  # update), no longer all FLOPs at the published efficiency: checked against published
  # runs in tests/test_plan_published.py.
  argv = ["--model", "125m", "--devices", "8", "--target", "a100-40g", "--global-batch", "64",
          "--seq-len", "512"]
  assert plan_cli.plan_main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  e, acc = out["estimate"], hardware.get("a100-40g")
  t = e["time"]
  assert e["binding"] == "compute" and acc.efficiency == 0.52
  assert e["efficiency"] == pytest.approx(0.52 * step_time.MATMUL_OVER_STEP)
  attention = step_time.attention_flops_per_token(
      registry.load("125m"), 512, "full") * 64 * 512 / 8
  assert t["matmul_s"] == pytest.approx((e["flops_per_device"] - attention) /
                                        (acc.peak_flops * e["efficiency"]))
  mem = e["memory"]
  assert t["update_s"] == pytest.approx((2 * mem["state"] + mem["grads"]) / acc.hbm_bw)
  assert e["step_s"] == pytest.approx(t["matmul_s"] + t["attention_s"] + t["elementwise_s"] +
                                      t["exposed_comm_s"] + t["update_s"])
  assert e["mfu"] < e["mfu_ceiling"] * e["efficiency"]
  assert 0 < e["mfu"] < e["mfu_ceiling"] <= 1
  assert out["target"]["efficiency_source"].startswith("Narayanan et al. 2021")
  assert plan_cli.plan_main(argv) == 0
  text = capsys.readouterr().out
  assert (f"{e['mfu']:.1%} predicted (matmuls at {e['efficiency']:.0%} of peak on a100-40g: "
          "52% from Narayanan et al. 2021" in text and
          f"roofline ceiling {e['mfu_ceiling']:.1%}" in text)
  for a in hardware.ACCELERATORS.values():  # every figure says where it comes from
    # (HFU: MaxText's v5p run executes 84% of the chip's peak, recompute counted)
    assert 0.2 < a.efficiency < 0.9 and a.efficiency_source != "assumption"


def _png_size(path: Path) -> tuple[int, int]:
  head = path.read_bytes()[:24]
  assert head[:8] == b"\x89PNG\r\n\x1a\n"
  return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_plot_draws_every_strategy_as_the_json_reports_it(tmp_path, capsys):
  """llama2-7b on 12 GPUs: tp fits, dp does not, and the rest cannot split d_model 4096 12
  (or 3) ways."""
  argv = ["--model", "llama2-7b", "--devices", "12", "--strategy", "tp", "--target",
          "a100-80g", "--global-batch", "48", "--seq-len", "2048"]
  assert plan_cli.plan_main(argv + ["--json", "--plot", str(tmp_path / "m.png")]) == 0
  strategies = json.loads(capsys.readouterr().out)["strategies"]
  assert _png_size(tmp_path / "m.png") == (900, 650)
  result = plan.plan(plan_cli.request_from_args(plan_cli.train_parser().parse_args(argv)),
                     search_meshes=True)
  labels = plan_plot.write(result, tmp_path / "s.png")
  assert _png_size(tmp_path / "s.png") == (1500, 650)  # the search panel beside
  assert set(labels) == set(strategies) == set(plan.STRATEGIES)
  for name, drawn in labels.items():
    got = strategies[name]
    assert drawn == ("cannot run: " + got["error"] if "error" in got else
                     "fits" if got["fits"] else "does not fit")
  assert labels["tp"] == "fits" and labels["dp"] == "does not fit"
  assert labels["fsdp"].startswith("cannot run: ") and "not divisible" in labels["fsdp"]
