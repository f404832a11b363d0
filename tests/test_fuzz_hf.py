"""The Hugging Face readers fuzzed: safetensors files (header and body), the shard index and
config.json (shardlab/hf/files.py, hf/config.py and the family adapters). Each input is
accepted, and then reads back whole, or refused by a ConfigError naming the file."""

import json
import math
import struct
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, strategies as st

from fuzz_harness import ODD, _count_inputs, damaged, mutations, outcome, write  # noqa: F401
from shardlab import cli
from shardlab.hf import config as hf_config
from shardlab.hf import families
from shardlab.hf import files as hf_files
from shardlab.models.llama_config import LlamaConfig

MODEL = LlamaConfig(name="small", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=8, mlp_dim=64, rope_theta=500000.0)
F32 = np.dtype(np.float32)
ENTRIES = [("a", F32, (2, 3)), ("b", F32, (4,))]


def _safetensors() -> bytes:
  """A valid two-tensor file, as shardlab's writer (the reference layout) writes it."""
  with tempfile.TemporaryDirectory() as d:
    path = Path(d) / "valid.safetensors"
    shapes = {name: shape for name, _, shape in ENTRIES}
    hf_files.write(path, ENTRIES, lambda n: np.ones(shapes[n], F32))
    return path.read_bytes()


VALID = _safetensors()
HEADER = json.loads(VALID[8:8 + struct.unpack("<Q", VALID[:8])[0]])


def _read_all(directory):
  """Opens the directory and reads every tensor: what an accepted file must allow."""
  reader = hf_files.Reader(directory)
  return {name: reader.read(name) for name in reader.tensors}


@given(raw=damaged(VALID))
def test_safetensors_bytes(tmp_path_factory, raw):
  d = tmp_path_factory.mktemp("st")
  write(d / hf_files.SINGLE_FILE, raw)
  outcome(lambda: _read_all(d), hf_files.SINGLE_FILE)


@given(entry=st.one_of(mutations(HEADER["a"]), ODD), length=st.sampled_from(
    [None, 0, 7, 2**31, 2**63, 2**64 - 1]))
def test_safetensors_header(tmp_path_factory, entry, length):
  """A header whose entry holds wrong types, huge or negative sizes and offsets, or whose
  length field claims more bytes than the file holds."""
  header = json.dumps({**HEADER, "a": entry}).encode()
  body = VALID[8 + struct.unpack("<Q", VALID[:8])[0]:]
  raw = struct.pack("<Q", len(header) if length is None else length) + header + body
  d = tmp_path_factory.mktemp("st")
  write(d / hf_files.SINGLE_FILE, raw)
  outcome(lambda: _read_all(d), hf_files.SINGLE_FILE)


@given(index=st.one_of(mutations({"weight_map": {"a": "m-1.safetensors"}, "metadata": {}}),
                       st.builds(lambda v: {"weight_map": {"a": v}}, ODD)),
       raw=st.one_of(st.none(), damaged(b'{"weight_map": {"a": "m-1.safetensors"}}')))
def test_safetensors_index(tmp_path_factory, index, raw):
  d = tmp_path_factory.mktemp("idx")
  write(d / "m-1.safetensors", VALID)
  write(d / hf_files.INDEX_FILE, json.dumps(index) if raw is None else raw)
  outcome(lambda: _read_all(d), hf_files.INDEX_FILE, "m-1.safetensors")


def test_header_claiming_more_than_the_file_is_refused_before_reading(tmp_path):
  """A header length of 2**40 in a 200-byte file: refused from the file's size, naming it."""
  write(tmp_path / hf_files.SINGLE_FILE, struct.pack("<Q", 2**40) + VALID[8:])
  assert outcome(lambda: _read_all(tmp_path), hf_files.SINGLE_FILE) is None
  write(tmp_path / hf_files.SINGLE_FILE, VALID[:-4])  # the last tensor's bytes cut short
  try:
    _read_all(tmp_path)
  except Exception as e:
    assert "tensor 'b'" in str(e) and "data_offsets" in str(e), e
  else:
    raise AssertionError("a truncated file was accepted")


def test_truncated_file_in_convert_from_hf_exits_2(tmp_path, capsys):
  from shardlab.hf import weights as hf_weights
  import jax
  params = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), _abstract_params())
  hf_weights.export_params(params, MODEL, tmp_path / "hf")
  path = tmp_path / "hf" / hf_files.SINGLE_FILE
  path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
  code = cli.main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
  err = capsys.readouterr().err
  assert code == 2 and "Traceback" not in err and str(path) in err, err


def _abstract_params():
  from shardlab import config
  from shardlab.training import run as run_lib
  cfg = config.Config(model=MODEL, mesh="fsdp:8", strategy="fsdp",
                      train=config.TrainConfig(precision="fp32"))
  return run_lib.abstract_state(cfg).state.params


CONFIG = families.for_model(MODEL).to_hf(MODEL, "float32")


def _model_ok(m) -> None:
  for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
            "mlp_dim"):
    assert type(getattr(m, f)) is int and getattr(m, f) >= 1, (f, getattr(m, f))
  assert math.isfinite(m.rope_theta) and m.rope_theta > 0
  assert math.isfinite(m.norm_eps) and m.norm_eps > 0


def _to_model(d):
  where = str(d / hf_config.CONFIG_FILE)
  return hf_config.to_model(hf_config.read(d), "x", where)


@given(fields=mutations(CONFIG))
def test_config_json_fields(tmp_path_factory, fields):
  d = tmp_path_factory.mktemp("cfg")
  write(d / hf_config.CONFIG_FILE, json.dumps(fields))
  m = outcome(lambda: _to_model(d), hf_config.CONFIG_FILE)
  if m is not None:
    _model_ok(m)


@given(rope=st.one_of(mutations(CONFIG["rope_parameters"]), ODD),
       key=st.sampled_from(["rope_parameters", "rope_scaling"]))
def test_config_json_rope(tmp_path_factory, rope, key):
  d = tmp_path_factory.mktemp("cfg")
  write(d / hf_config.CONFIG_FILE, json.dumps({**CONFIG, key: rope}))
  m = outcome(lambda: _to_model(d), hf_config.CONFIG_FILE)
  if m is not None:
    _model_ok(m)


@given(raw=damaged(json.dumps(CONFIG).encode()))
def test_config_json_bytes(tmp_path_factory, raw):
  d = tmp_path_factory.mktemp("cfg")
  write(d / hf_config.CONFIG_FILE, raw)
  m = outcome(lambda: _to_model(d), hf_config.CONFIG_FILE)
  if m is not None:
    _model_ok(m)
