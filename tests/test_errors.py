"""Bad input gets a ConfigError naming the field, the value and what would be valid."""

import dataclasses

import jax
import pytest

from shardlab import config
from shardlab.data import corpus as data
from shardlab.sharding import mesh
from shardlab.sharding import rules
from shardlab.training import state
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.training import run as run_lib


def tiny(**train):
  cfg = config.Config(model=registry.load("tiny"))
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def test_mesh_product_differs_from_device_count():
  with pytest.raises(ConfigError, match=r"has 6 devices .* but 8 are available"):
    mesh.build(mesh.parse_inline("fsdp:3,tensor:2"))


def test_two_inferred_axes():
  with pytest.raises(ConfigError, match=r"more than one -1 axis \(ici.fsdp, ici.tensor\)"):
    mesh.parse_inline("fsdp:-1,tensor:-1")


def test_an_axis_given_twice():
  with pytest.raises(ConfigError, match=r"mesh 'fsdp:2,fsdp:4': axis 'fsdp' is given twice"):
    mesh.parse_inline("fsdp:2,fsdp:4")


def test_inferred_axis_that_cannot_divide():
  with pytest.raises(ConfigError, match=r"-1 axis cannot be inferred: 8 devices .* \(3\)"):
    mesh.build(mesh.parse_inline("fsdp:-1,tensor:3"))


def test_unknown_mesh_axis_suggests():
  with pytest.raises(ConfigError, match=r"unknown mesh axis .*'tensr' \(did you mean: tensor\?\)"):
    mesh.parse_inline("data:2,tensr:4")


def test_unknown_mesh_preset_lists_presets():
  with pytest.raises(ConfigError, match=r"unknown mesh preset 'cpu-9'.*valid: .*cpu-8"):
    mesh.load("cpu-9")


def test_unknown_strategy():
  with pytest.raises(ConfigError, match=r"unknown strategy 'fdsp' \(did you mean: fsdp"):
    rules.strategy("fdsp")


def test_unknown_model():
  with pytest.raises(ConfigError, match=r"unknown model 'llama2-8b'.*valid: .*llama2-7b"):
    registry.load("llama2-8b")


def test_unknown_config_key_suggests_close_names():
  with pytest.raises(ConfigError, match=r"'train.learning_rate'.*did you mean"):
    config.apply_overrides(tiny(), ["train.learning_rate=1e-3"])
  with pytest.raises(ConfigError, match=r"'train.stesp' \(did you mean: train.steps"):
    config.apply_overrides(tiny(), ["train.stesp=3"])


def test_bad_config_values():
  with pytest.raises(ConfigError, match=r"train.steps must be int, got 'many'"):
    config.apply_overrides(tiny(), ["train.steps=many"])
  with pytest.raises(ConfigError, match=r"unknown train.optimizer 'adam'.*adamw"):
    config.apply_overrides(tiny(), ["train.optimizer=adam"])
  with pytest.raises(ConfigError, match=r"n_heads \(4\) must be a multiple of .*n_kv_heads \(3\)"):
    config.apply_overrides(tiny(), ["model.n_kv_heads=3"])


def test_unknown_rule_table_and_logical_axis():
  with pytest.raises(ConfigError, match=r"unknown logical axis in rules.params 'mpl'.*mlp"):
    rules.strategy("fsdp", {"params": {"mpl": "tensor"}})
  with pytest.raises(ConfigError, match=r"unknown rules table 'param'"):
    rules.strategy("fsdp", {"param": {"mlp": "tensor"}})


def test_dimension_not_divisible_names_param_and_axis():
  cfg = config.apply_overrides(tiny(), ["model.mlp_dim=101"])
  abstract = run_lib.abstract_state(cfg)
  m = mesh.build(mesh.parse_inline("fsdp:4,tensor:2"))
  with pytest.raises(ConfigError, match=r"param blocks.mlp.\w+ dim \d \(mlp, size 101\) "
                                        r"is not divisible by mesh axis 'tensor' \(size 2\)"):
    state.shardings(abstract, rules.strategy("tp"), m)


def test_global_batch_not_divisible_by_batch_axes():
  cfg = tiny(global_batch=12)
  abstract = run_lib.abstract_state(cfg)
  sh = state.shardings(abstract, rules.strategy("dp"), mesh.build(mesh.parse_inline("data:8")))
  with pytest.raises(ConfigError, match=r"train.global_batch \(12\) is not divisible by the "
                                        r"batch-sharding mesh axes data×fsdp \(8 shards\)"):
    run_lib.make_steps(cfg, abstract, sh)[0]


def test_microbatch_not_divisible_by_batch_axes():
  cfg = tiny(global_batch=32, microbatches=8)
  abstract = run_lib.abstract_state(cfg)
  sh = state.shardings(abstract, rules.strategy("dp"), mesh.build(mesh.parse_inline("data:8")))
  with pytest.raises(ConfigError, match=r"microbatch .* = 4\) is not divisible"):
    run_lib.make_steps(cfg, abstract, sh)[0]


def test_corpus_missing_or_empty(tmp_path):
  with pytest.raises(ConfigError, match=r"data.corpus '.*nope' does not exist"):
    data.load(config.DataConfig(corpus=str(tmp_path / "nope")), 128)
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ConfigError, match=r"data.corpus '.*empty.txt' is empty or too small: 0 bytes"):
    data.load(config.DataConfig(corpus=str(tmp_path / "empty.txt")), 128)
  (tmp_path / "dir").mkdir()
  with pytest.raises(ConfigError, match=r"is empty or too small: 0 bytes in 0 file"):
    data.load(config.DataConfig(corpus=str(tmp_path / "dir")), 128)


def test_simulating_devices_after_backend_started():
  from shardlab.runtime import devices
  jax.devices()
  devices.simulate(8)  # what is already running: fine
  with pytest.raises(ConfigError, match=r"cannot simulate 4 devices: the JAX backend already "
                                        r"started with 8 cpu device"):
    devices.simulate(4)


@pytest.mark.parametrize("preset,expected", [(None, "16 --xla_cpu_multi_thread_eigen=false"),
                                             ("5", "5 --xla_cpu_multi_thread_eigen=false")])
def test_simulating_devices_sizes_xla_cpu_threads(preset, expected):
  """4 devices get a pool of 16 threads (XLA:CPU's collectives deadlock on a full pool) and
  one thread each for ops, unless the user set the pool size."""
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
  if preset:
    env["PJRT_NPROC"] = preset
  code = ("import os; from shardlab.runtime import devices; devices.simulate(4); "
          "print(os.environ['PJRT_NPROC'], os.environ['XLA_FLAGS'].strip())")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == expected


def test_cli_values_reach_the_config_as_typed():
  from shardlab.cli import train as train_cli
  args = train_cli.train_parser().parse_args([
      "--checkpoint-dir", "runs/a\\b", "--set", "data.corpus=2024", "--set", "train.lr=1e-3",
      "--set", "rules.params.mlp=none", "--steps", "7"])
  cfg = train_cli.config_from_args(args)
  assert cfg.checkpoint.dir == "runs/a\\b"  # not escaped on the way
  assert cfg.data.corpus == "2024"  # a string field takes the text, not the TOML integer
  assert cfg.train.lr == 1e-3 and cfg.train.steps == 7
  assert cfg.rules == {"params": {"mlp": "none"}}
  with pytest.raises(ConfigError, match=r"train.steps must be int, got 'x'"):
    config.apply_overrides(cfg, ["train.steps=x"])


def test_unknown_architecture_in_a_model_file(tmp_path):
  (tmp_path / "m.toml").write_text('arch = "mamba"\nvocab_size = 256\n')
  # Every registered architecture is valid (the suite's test files register one more).
  valid = ", ".join(sorted(registry.ARCHITECTURES))
  with pytest.raises(ConfigError, match=rf"unknown model.arch 'mamba'.*valid: {valid}$"):
    registry.load(str(tmp_path / "m.toml"))


def test_gradient_dtype_must_fit_the_precision_policy():
  cfg = tiny(precision="fp32", grad_dtype="bf16")
  abstract = run_lib.abstract_state(cfg)
  sh = state.shardings(abstract, rules.strategy("dp"), mesh.build(mesh.parse_inline("data:8")))
  with pytest.raises(ConfigError, match=r"train.grad_dtype 'bf16' with precision 'fp32'"):
    run_lib.make_steps(cfg, abstract, sh)
  with pytest.raises(ConfigError, match=r"unknown train.grad_dtype 'fp16'"):
    config.TrainConfig(grad_dtype="fp16")


def test_nonfinite_and_checkpoint_options_are_checked():
  with pytest.raises(ConfigError, match=r"unknown train.nonfinite 'ignore'.*valid: skip, stop"):
    config.apply_overrides(tiny(), ["train.nonfinite=ignore"])
  with pytest.raises(ConfigError, match=r"train.max_skipped must be >= 1, got 0"):
    config.apply_overrides(tiny(), ["train.max_skipped=0"])
  with pytest.raises(ConfigError, match=r"checkpoint.strict must be bool, got 'yes'"):
    config.apply_overrides(tiny(), ["checkpoint.strict=yes"])


@pytest.mark.parametrize("field, value, message", [
    ("lr", -1.0, r"train.lr must be > 0, got -1.0"),
    ("clip_norm", -1.0, r"train.clip_norm must be > 0, got -1.0"),
    ("b2", 1.5, r"train.b2 must be in \[0, 1\), got 1.5"),
    ("warmup_steps", -1, r"train.warmup_steps must be >= 0, got -1"),
    ("min_lr_ratio", 2.0, r"train.min_lr_ratio must be in \[0, 1\], got 2.0"),
    ("seed", -1, r"train.seed must be in \[0, 2\*\*63\), got -1"),
    ("seed", 10**20, r"train.seed must be in \[0, 2\*\*63\), got 100000000000000000000"),
    ("scan_unroll", 0, r"train.scan_unroll must be >= 1, got 0"),
])
def test_train_values_out_of_range(field, value, message):
  with pytest.raises(ConfigError, match=message):
    config.TrainConfig(**{field: value})


def test_model_file_errors_name_the_file_and_the_fields(tmp_path):
  path = tmp_path / "half.toml"
  path.write_text("vocab_size = 256\nd_model = 64\n")
  with pytest.raises(ConfigError, match=r"model file '.*half.toml': missing model.n_layers, "
                                        r"model.n_heads, .*model.mlp_dim"):
    registry.load(str(path))
  with pytest.raises(ConfigError, match=r"model.rope_theta and model.norm_eps must be > 0"):
    dataclasses.replace(registry.load("tiny"), rope_theta=-1.0)


@pytest.mark.parametrize("override, message", [
    ({"params": "tensor"}, r"rules.params must be a table of logical axis = mesh axes"),
    ({"params": {"mlp": 5}}, r"rules.params.mlp must be a mesh axis name, a list of them"),
])
def test_malformed_rule_overrides(override, message):
  with pytest.raises(ConfigError, match=message):
    rules.strategy("fsdp", override)


def test_plan_names_an_unknown_strategy_before_asking_for_a_mesh():
  from shardlab.plan.training import planner
  with pytest.raises(ConfigError, match=r"unknown strategy 'nosuch'"):
    planner.Request.of(model="tiny", strategy="nosuch")
