"""Checkpoints: exact resume, restore onto other meshes, params-only init, bad input."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from shardlab.training import checkpoint
from shardlab import config
from shardlab.sharding import mesh
from shardlab.sharding import rules
from shardlab.training import state
from shardlab.training import loop as train
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.training import run as run_lib

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=8", "model.n_kv_heads=8",
         "model.head_dim=8", "model.mlp_dim=128", "train.seq_len=32", "train.global_batch=16",
         "train.steps=8", "train.log_every=1", "train.eval_batches=1", "train.warmup_steps=2",
         "data.max_bytes=400000"]


def small_config(tmp_path, name="run", **overrides) -> config.Config:
  cfg = config.Config(model=registry.load("tiny"), mesh="cpu-8", strategy="fsdp_tp")
  extra = [f"{k.replace('__', '.')}={v!r}" if isinstance(v, str) else f"{k.replace('__', '.')}={v}"
           for k, v in overrides.items()]
  cfg = config.apply_overrides(cfg, SMALL + extra)
  return dataclasses.replace(cfg, metrics_file=str(tmp_path / f"{name}.jsonl"))


def losses(cfg) -> list[float]:
  with open(cfg.metrics_file) as f:
    records = [json.loads(line) for line in f]
  return [r["loss"] for r in records if "loss" in r]  # not the closing eval_loss record


def final_params(directory, cfg):
  """The newest checkpoint's params as numpy, restored onto one device."""
  abstract = run_lib.abstract_state(cfg)
  one = mesh.build(mesh.parse_inline("data:1"), devices=jax.devices()[:1])
  sh = state.shardings(abstract, rules.strategy("dp"), one)
  params, step = checkpoint.restore_params(directory, abstract, sh)
  return step, jax.tree.map(np.asarray, params)


def test_exact_resume_is_bitwise(tmp_path, capsys):
  straight = small_config(tmp_path, "straight", checkpoint__dir=str(tmp_path / "a"))
  train.train(straight, quiet=True)

  resumed = small_config(tmp_path, "resumed", checkpoint__dir=str(tmp_path / "b"))
  first = train.train(resumed, quiet=True, stop_after=4)
  assert first["steps_done"] == 4 and "held_out_loss" not in first
  second = train.train(resumed)
  assert "resuming from the checkpoint at step 4" in capsys.readouterr().out
  assert second["steps_done"] == 8

  assert losses(resumed) == losses(straight)  # 8 records each, bit for bit
  step_a, params_a = final_params(tmp_path / "a", straight)
  step_b, params_b = final_params(tmp_path / "b", resumed)
  assert step_a == step_b == 8
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)


def test_checkpoint_layout_and_keep(tmp_path):
  cfg = small_config(tmp_path, checkpoint__dir=str(tmp_path / "c"), checkpoint__every=2,
                     checkpoint__keep=2)
  train.train(cfg, quiet=True)
  steps = sorted(int(p.name) for p in (tmp_path / "c").iterdir() if p.name.isdigit())
  assert steps == [6, 8]
  saved = json.loads((tmp_path / "c" / "8" / "config" / "metadata").read_text())
  assert saved["model"]["d_model"] == 64 and saved["strategy"] == "fsdp_tp"
  progress = json.loads((tmp_path / "c" / "8" / "progress" / "metadata").read_text())
  assert progress["step"] == progress["data_position"] == 8
  assert checkpoint.saved_config(tmp_path / "c") == saved


# Each hop restores the previous hop's checkpoint under a new mesh and strategy.
HOPS = [("fsdp", "fsdp:8", None), ("fsdp_tp", "fsdp:4,tensor:2", None),
        ("tp", "tensor:8", None), ("dp", "data:1", 1)]


def test_restore_onto_other_meshes(tmp_path):
  base = small_config(tmp_path)
  directory, previous = tmp_path / "hops", None
  for strategy, mesh_text, n_devices in HOPS:
    devices = jax.devices()[:n_devices] if n_devices else None
    m = mesh.build(mesh.parse_inline(mesh_text), devices=devices)
    cfg = dataclasses.replace(base, strategy=strategy, mesh=mesh_text,
                              checkpoint=config.CheckpointConfig(dir=str(directory)))
    abstract = run_lib.abstract_state(cfg)
    sh = state.shardings(abstract, rules.strategy(strategy), m)
    ckpt = checkpoint.Checkpointer(cfg.checkpoint)
    if previous is None:
      st = state.init_state(abstract, sh)
    else:
      st, progress = ckpt.restore(abstract, sh)
      assert progress["step"] == int(st.step)
      # Identical values, now laid out by this hop's rules.
      jax.tree.map(np.testing.assert_array_equal, previous,
                   jax.tree.map(np.asarray, (st.params, st.opt_state)))
      jax.tree.map(lambda a, s: pytest.approx(0) if a.sharding == s else
                   pytest.fail(f"{a.sharding} != {s}"), st.params, sh.state.params)
    # Training continues on this mesh.
    from shardlab.data.corpus import global_batch, load
    corpus = load(cfg.data, cfg.train.seq_len)
    train_step = run_lib.make_steps(cfg, abstract, sh)[0]
    st, metrics = train_step(st, global_batch(corpus.train, 0, int(st.step), 16, 32, sh.batch))
    assert np.isfinite(float(metrics["loss"]))
    previous = jax.tree.map(np.asarray, (st.params, st.opt_state))
    ckpt.save(st, config.to_dict(cfg), {"step": int(st.step)}, force=True)
    ckpt.wait()
    ckpt.close()


def test_init_from_loads_params_only(tmp_path, capsys):
  source = small_config(tmp_path, checkpoint__dir=str(tmp_path / "src"))
  train.train(source, quiet=True)
  _, saved = final_params(tmp_path / "src", source)

  tuned = small_config(tmp_path, "tuned", checkpoint__init_from=str(tmp_path / "src"),
                       checkpoint__dir=str(tmp_path / "tuned"), train__steps=1)
  tuned = dataclasses.replace(tuned, strategy="tp", mesh="tensor:8")
  train.train(tuned)
  assert "initialised params from" in capsys.readouterr().out
  # One step from the loaded params with fresh Adam moments: the first update of Adam is
  # lr·sign-like, so params moved, but only by about one learning rate.
  step, after = final_params(tmp_path / "tuned", tuned)
  assert step == 1
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after),
                                                          jax.tree.leaves(saved)))
  assert 0 < moved < 0.05


def test_shape_mismatch_lists_leaves(tmp_path):
  source = small_config(tmp_path, checkpoint__dir=str(tmp_path / "src"), train__steps=1)
  train.train(source, quiet=True)
  wider = config.apply_overrides(source, ["model.mlp_dim=256"])
  with pytest.raises(ConfigError, match=r"does not match this model \(3 params leaves differ\)"
                                        r"(.|\n)*blocks.mlp.down_FxD: checkpoint \(2, 128, 64\), "
                                        r"model \(2, 256, 64\)"):
    train.train(wider, quiet=True)


def test_missing_empty_and_damaged_checkpoints(tmp_path):
  cfg = small_config(tmp_path)
  abstract = run_lib.abstract_state(cfg)
  sh = state.shardings(abstract, rules.strategy("fsdp_tp"), mesh.build(mesh.load("cpu-8")))
  with pytest.raises(ConfigError, match=r"checkpoint directory '.*nowhere' does not exist"):
    checkpoint.restore_params(tmp_path / "nowhere", abstract, sh)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match=r"holds no complete checkpoint \(found: nothing\)"):
    checkpoint.restore_params(tmp_path / "empty", abstract, sh)

  source = small_config(tmp_path, checkpoint__dir=str(tmp_path / "src"), train__steps=1)
  train.train(source, quiet=True)
  for f in (tmp_path / "src" / "1" / "params").rglob("*"):
    if f.is_file() and f.parent.name == "d":  # the array data files
      f.write_bytes(b"garbage")
  with pytest.raises(ConfigError, match=r"checkpoint .*src/1 could not be read"):
    checkpoint.restore_params(tmp_path / "src", abstract, sh)


def test_fresh_refuses_to_overwrite(tmp_path):
  cfg = small_config(tmp_path, checkpoint__dir=str(tmp_path / "c"), train__steps=2)
  train.train(cfg, quiet=True)
  with pytest.raises(ConfigError, match=r"--fresh: checkpoint directory .* is not empty; pass "
                                        r"--overwrite"):
    train.train(cfg, quiet=True, fresh=True)
  assert (tmp_path / "c" / "2").is_dir()  # untouched
  summary = train.train(cfg, quiet=True, fresh=True, overwrite=True)
  assert summary["steps_done"] == 2


def test_to_hf_needs_overwrite_and_replaces_the_export_whole(tmp_path, capsys, monkeypatch):
  from shardlab import cli
  from shardlab.hf import weights as hf

  source = small_config(tmp_path, checkpoint__dir=str(tmp_path / "src"), train__steps=1)
  train.train(source, quiet=True)
  out = tmp_path / "exported"
  to_hf = lambda *extra: cli.main(["convert", "to-hf", str(tmp_path / "src"), str(out), *extra])
  assert to_hf("--max-shard-gb", "0.0002") == 0  # three shards and an index
  (out / "notes.txt").write_text("mine")
  first = sorted(p.name for p in out.iterdir())
  assert "model.safetensors.index.json" in first and len(first) == 7  # + generation_config
  capsys.readouterr()

  assert to_hf() == 2
  assert (f"error: output directory '{out}' is not empty; pass --overwrite to replace what "
          f"is there") in capsys.readouterr().err
  assert sorted(p.name for p in out.iterdir()) == first
  assert cli.main(["convert", "to-hf", str(tmp_path / "src"), str(tmp_path), "--overwrite"]) == 2
  assert f"output directory '{tmp_path}' holds the checkpoint" in capsys.readouterr().err

  real = hf.export_params

  def fails_after_writing(*args, **kwargs):
    real(*args, **kwargs)
    raise OSError("disk full")

  monkeypatch.setattr(hf, "export_params", fails_after_writing)
  with pytest.raises(OSError, match="disk full"):
    to_hf("--overwrite")
  assert sorted(p.name for p in out.iterdir()) == first  # the old export, untouched
  monkeypatch.setattr(hf, "export_params", real)

  assert to_hf("--overwrite") == 0  # one file now: no shard or index of the old one is left
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                   "model.safetensors"]
  assert sorted(p.name for p in tmp_path.iterdir() if "exported" in p.name) == ["exported"]
  _, expected = final_params(tmp_path / "src", source)
  abstract = run_lib.abstract_state(source)
  sh = state.shardings(abstract, rules.strategy("dp"),
                       mesh.build(mesh.parse_inline("data:1"), devices=jax.devices()[:1]))
  exported = hf.load_params(out, source.model, abstract, sh)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, exported), expected)
