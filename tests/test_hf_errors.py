"""Hugging Face import/export without torch: bad input gets clear errors, and weights
written by shardlab's own safetensors writer come back bit for bit (fp32 and bf16)."""

import json
import math
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from shardlab import cli
from shardlab import config
from shardlab.hf import weights as hf
from shardlab.hf import config as hf_config
from shardlab.hf import files as hf_files
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules
from shardlab.training import state
from shardlab.errors import ConfigError
from shardlab.models.llama_config import LlamaConfig
from shardlab.models import registry
from shardlab.training import run as run_lib

MODEL = LlamaConfig(name="small", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=8, mlp_dim=64, rope_theta=500000.0)


def placement(model=MODEL, strategy="fsdp_tp", mesh_text="fsdp:4,tensor:2"):
  cfg = config.Config(model=model, mesh=mesh_text, strategy=strategy,
                      train=config.TrainConfig(precision="fp32"))
  abstract = run_lib.abstract_state(cfg)
  m = mesh_lib.build(mesh_lib.parse_inline(mesh_text))
  return abstract, state.shardings(abstract, rules.strategy(strategy), m)


def random_params(model=MODEL) -> dict:
  abstract, _ = placement(model)
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32),
                      abstract.state.params)


@pytest.fixture
def hf_dir(tmp_path):
  directory = tmp_path / "hf"
  hf.export_params(random_params(), MODEL, directory)
  return directory


def edit_config(directory, **changes):
  path = directory / "config.json"
  data = json.loads(path.read_text())
  data.update(changes)
  path.write_text(json.dumps(data))


def load(directory, model=MODEL):
  abstract, sh = placement(model)
  return hf.load_params(directory, model, abstract, sh)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_exact(hf_dir, tmp_path, dtype):
  params = random_params()
  hf.export_params(params, MODEL, tmp_path / dtype, dtype=dtype, max_shard_bytes=20_000)
  assert hf_config.to_model(json.loads((tmp_path / dtype / "config.json").read_text()),
                            "small") == MODEL
  loaded = jax.tree.map(np.asarray, load(tmp_path / dtype))
  wanted = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
                        if dtype == "bfloat16" else x, params)
  jax.tree.map(np.testing.assert_array_equal, loaded, wanted)


def test_q_proj_layout(hf_dir):
  """q_proj.weight is (H·E, D), rows head-major: param q[d, h, e] = W[h·E + e, d]."""
  w = hf_files.Reader(hf_dir).read("model.layers.1.self_attn.q_proj.weight")
  q = np.asarray(load(hf_dir)["blocks"]["attn"]["q_DxHxE"][1])
  np.testing.assert_array_equal(q[5, 3, 2], w[3 * MODEL.head_dim + 2, 5])


def test_each_device_reads_only_its_box(hf_dir, monkeypatch):
  """Under fsdp × tensor every param is split at least 4 ways, so no read of an HF tensor
  may return more than a quarter of it: shards are read, never whole tensors."""
  reads, original = [], hf_files.Reader.read

  def read(self, name, box=None):
    out = original(self, name, box)
    reads.append((name, out.size, math.prod(self.tensors[name].shape)))
    return out

  monkeypatch.setattr(hf_files.Reader, "read", read)
  load(hf_dir)
  assert len(reads) >= 8 * 9 * MODEL.n_layers  # every device, every block param, every layer
  too_big = [r for r in reads if r[1] * 4 > r[2]]
  assert not too_big, too_big[:3]


def test_missing_files(hf_dir, tmp_path):
  with pytest.raises(ConfigError, match=r"'.*nowhere' does not exist"):
    load(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match=r"empty has no config.json"):
    load(tmp_path / "empty")
  (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
  with pytest.raises(ConfigError, match=r"has neither model.safetensors nor "
                                        r"model.safetensors.index.json \(found: config.json, generation_config.json, "
                                        r"pytorch_model.bin\).*only .safetensors"):
    load(hf_dir)


def test_index_naming_a_missing_shard(tmp_path):
  files = hf.export_params(random_params(), MODEL, tmp_path, max_shard_bytes=20_000)
  assert len(files) > 2
  files[1].unlink()
  with pytest.raises(ConfigError, match=rf"names shard file\(s\) that do not exist: "
                                        rf"{files[1].name}"):
    load(tmp_path)


def test_an_architecture_no_family_reads(hf_dir):
  # DeepSeek-V3 has no adapter (multi-head latent attention, its own MoE router).
  edit_config(hf_dir, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
  with pytest.raises(ConfigError, match=r"unsupported architecture 'DeepseekV3ForCausalLM'; "
                                        r"supported: LlamaForCausalLM"):
    load(hf_dir)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_scaling(hf_dir, field):
  edit_config(hf_dir, **{field: {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}})
  with pytest.raises(ConfigError, match=rf"unsupported {field} type 'yarn'; .*supports "
                                        r"'default', 'linear', 'llama3'"):
    load(hf_dir)


def test_llama3_rope_scaling_missing_a_field(hf_dir):
  edit_config(hf_dir, rope_scaling={"rope_type": "llama3", "factor": 8.0})
  with pytest.raises(ConfigError, match=r"rope_scaling of type 'llama3' lacks "
                                        r"'low_freq_factor'"):
    load(hf_dir)


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu"), ("attention_bias", True)])
def test_fields_the_model_cannot_represent(hf_dir, field, value):
  edit_config(hf_dir, **{field: value})
  with pytest.raises(ConfigError, match=rf"{field}={value!r} is not supported"):
    load(hf_dir)


def test_config_weight_shape_mismatch(hf_dir):
  edit_config(hf_dir, intermediate_size=96)
  model = hf_config.to_model(hf_config.read(hf_dir), "small")
  with pytest.raises(ConfigError, match=r"do not match its config.json \(6 problems\)"
                                        r"(.|\n)*model.layers.0.mlp.down_proj.weight: shape "
                                        r"\(32, 64\) in model.safetensors, but config.json "
                                        r"implies \(32, 96\)"):
    load(hf_dir, model)


def test_missing_and_extra_tensors(hf_dir, tmp_path):
  reader, bad = hf_files.Reader(hf_dir), tmp_path / "bad"
  bad.mkdir()
  shutil.copy(hf_dir / "config.json", bad)
  keep = [n for n in reader.tensors if n != "model.norm.weight"]
  entries = [(n, np.dtype(np.float32), reader.tensors[n].shape) for n in keep]
  entries.append(("model.extra.bias", np.dtype(np.float32), (3,)))
  hf_files.write(bad / "model.safetensors", entries,
                 lambda n: reader.read(n) if n in reader.tensors else np.zeros(3, np.float32))
  with pytest.raises(ConfigError, match=r"model.norm.weight: missing(.|\n)*model.extra.bias: "
                                        r"not part of a Llama model"):
    load(bad)


def test_model_differs_from_hf_config(hf_dir):
  other = LlamaConfig(**{**MODEL.__dict__, "mlp_dim": 128, "rope_theta": 1e4})
  with pytest.raises(ConfigError, match=r"--model 'small' does not match(.|\n)*model.mlp_dim "
                                        r"= 128, but intermediate_size = 64(.|\n)*"
                                        r"model.rope_theta = 10000.0, but rope_theta = 500000"):
    load(hf_dir, other)


def test_hf_config_toml_loads_as_the_model(hf_dir, tmp_path, capsys):
  assert cli.main(["convert", "hf-config", str(hf_dir)]) == 0
  (tmp_path / "m.toml").write_text(capsys.readouterr().out)
  loaded = registry.load(str(tmp_path / "m.toml"))
  assert loaded == LlamaConfig(**{**MODEL.__dict__, "name": "m"})


def test_cli_errors(hf_dir, tmp_path, capsys):
  assert cli.main(["convert", "from-hf", str(tmp_path / "nowhere"), str(tmp_path / "o")]) == 2
  assert "does not exist" in capsys.readouterr().err
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "f").write_text("x")
  assert cli.main(["convert", "from-hf", str(hf_dir), str(tmp_path / "busy")]) == 2
  assert "is not empty; pass --overwrite" in capsys.readouterr().err
  assert cli.main(["convert", "to-hf", str(tmp_path / "nockpt"), str(tmp_path / "o")]) == 2
  assert "checkpoint directory" in capsys.readouterr().err
  with pytest.raises(ConfigError, match=r"unknown export dtype 'int8'; valid: bfloat16"):
    hf.export_params(random_params(), MODEL, tmp_path / "x", dtype="int8")
