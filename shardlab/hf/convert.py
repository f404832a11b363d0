"""Whole-directory conversions: a Hugging Face model dir ↔ a shardlab checkpoint dir, for any
family with an adapter (shardlab/hf/adapter.py).

Both run on whatever mesh is given (default: every device on `fsdp`), so the params are
spread over the devices and only one tensor (or one shard of one) passes through host
memory at a time.
"""

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from shardlab.training import checkpoint
from shardlab import config as config_lib
from shardlab.hf import weights as hf
from shardlab.hf import config as hf_config
from shardlab.models import registry
from shardlab.parallel import lora
from shardlab.training import run as run_lib
from shardlab.training import state as state_lib
from shardlab.config import CheckpointConfig, Config, TrainConfig
from shardlab.errors import ConfigError
from shardlab.runtime import units

DEFAULT_MESH = "fsdp:-1"
DEFAULT_STRATEGY = "fsdp"
MODEL_TOML = "model.toml"
T = TypeVar("T")


def _placement(cfg: Config) -> tuple[state_lib.Abstract, state_lib.Shardings]:
  p = run_lib.place(cfg)
  return p.abstract, p.shardings


def hf_model_config(hf_dir: str | Path):
  """The model config of the HF directory's config.json, by the adapter that claims it."""
  path = Path(hf_dir)
  return hf_config.to_model(hf_config.read(path), f"hf-{path.absolute().name}",
                            str(path / hf_config.CONFIG_FILE))


def import_checkpoint(hf_dir: str | Path, out_dir: str | Path, mesh: str = DEFAULT_MESH,
                      strategy: str = DEFAULT_STRATEGY, precision: str = "fp32",
                      optimizer: str = "adamw", overwrite: bool = False) -> Config:
  """Writes the HF model in `hf_dir` as a step-0 shardlab checkpoint in `out_dir` (fresh
  optimizer state, so it also serves as a --checkpoint-dir to fine-tune from); returns the
  run config saved with it."""
  cfg = Config(model=hf_model_config(hf_dir), mesh=mesh, strategy=strategy,
               train=TrainConfig(precision=precision, optimizer=optimizer),
               checkpoint=CheckpointConfig(dir=str(out_dir), async_save=False))
  out = Path(out_dir)
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ConfigError(f"output directory {str(out_dir)!r} is not empty; pass --overwrite to "
                      f"replace what is there, or choose another directory")
  checkpoint.prepare(out_dir, fresh=True, overwrite=True, flag="output directory")
  abstract, sh = _placement(cfg)
  params = hf.load_params(hf_dir, cfg.model, abstract, sh)
  opt_state = jax.jit(abstract.optimizer.init, out_shardings=sh.state.opt_state)(params)
  step = jax.device_put(jnp.int32(0), sh.state.step)
  train_state = state_lib.TrainState(step, params, opt_state)
  progress = {"step": 0, "seed": cfg.train.seed, "data_position": 0,
              "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
              "source": f"{hf.PREFIX}{Path(hf_dir).absolute()}"}
  ckpt = checkpoint.Checkpointer(cfg.checkpoint)
  try:
    ckpt.save(train_state, config_lib.to_dict(cfg), progress, force=True)
    ckpt.wait()
  finally:
    ckpt.close()
  # Orbax reads only the step dirs, so the model TOML can sit beside them for train.py.
  (out / MODEL_TOML).write_text(hf_config.to_toml(cfg.model))
  return cfg


def export_checkpoint(ckpt_dir: str | Path, hf_dir: str | Path, mesh: str = DEFAULT_MESH,
                      strategy: str = DEFAULT_STRATEGY, dtype: str = "auto",
                      max_shard_bytes: int = 4 * units.GiB, overwrite: bool = False,
                      tokenizer_from: str | Path | None = None, strict: bool = False,
                      merge_lora: bool = False) -> tuple[list[Path], list[str]]:
  """Writes the newest intact checkpoint in `ckpt_dir` (a damaged newer step is skipped with
  a warning, or refused if `strict`) as a Hugging Face directory (with the tokenizer
  files of `tokenizer_from`, if given); returns (weight files, tokenizer files). A non-empty
  `hf_dir` needs `overwrite`, and is then replaced whole (see _replace_dir). A LoRA run's
  adapters are merged into the weights they adapt (W + scale·A·B, in fp32) only if
  `merge_lora`; otherwise its export is refused."""
  if jax.process_count() > 1:  # each layer is fetched whole into this host's memory
    raise ConfigError(f"to-hf runs in a single process (this run has {jax.process_count()}); "
                      f"run it on one host, e.g. with --simulate-devices on a CPU machine")
  out = _check_output(Path(ckpt_dir), Path(hf_dir), overwrite)

  def read(restore, step):
    try:
      cfg = registry.run_config_from_dict(restore("config"), f"checkpoint {ckpt_dir}/{step}")
    except (TypeError, KeyError) as e:
      raise ConfigError(f"the config saved in {ckpt_dir}/{step} is not a shardlab run "
                        f"config ({e})") from None
    cfg = dataclasses.replace(cfg, mesh=mesh, strategy=strategy)
    if cfg.lora.rank and not merge_lora:
      raise ConfigError(f"the checkpoint in {ckpt_dir}/{step} was trained with LoRA adapters "
                        f"(lora.rank {cfg.lora.rank}, targets {cfg.lora.targets}); pass "
                        f"--merge-lora to export the base weights with the adapters merged in, or "
                        f"--peft to export the adapters alone as a PEFT adapter")
    abstract, sh = _placement(cfg)
    params = restore("params", abstract.state.params, sh.state.params)
    if cfg.lora.rank:
      params = lora.merge_params(params, cfg.model.lora_weights, cfg.lora.scale)
    return cfg, abstract, params

  (cfg, abstract, params), _ = checkpoint.restore_newest(ckpt_dir, read,
                                                         "--strict" if strict else None)
  if dtype == "auto":
    stored = np.dtype(abstract.policy.param_dtype)
    dtype = "float32" if stored == np.float32 else "bfloat16"

  def write(directory: Path) -> tuple[list[Path], list[str]]:
    files = hf.export_params(params, cfg.model, directory, dtype, max_shard_bytes)
    copied = hf.copy_tokenizer(tokenizer_from, directory) if tokenizer_from else []
    return [out / f.name for f in files], copied

  return _replace_dir(out, write)


def _check_output(ckpt_dir: Path, out: Path, overwrite: bool) -> Path:
  """Refuses, before any work, an output that is a file, holds the checkpoint, or is not
  empty without `overwrite`."""
  if out.exists() and not out.is_dir():
    raise ConfigError(f"output directory {str(out)!r} exists and is not a directory")
  inside = ckpt_dir.resolve() == out.resolve() or out.resolve() in ckpt_dir.resolve().parents
  if inside:
    raise ConfigError(f"output directory {str(out)!r} holds the checkpoint {str(ckpt_dir)!r}; "
                      f"export to another directory")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ConfigError(f"output directory {str(out)!r} is not empty; pass --overwrite to "
                      f"replace what is there, or choose another directory")
  return out.resolve()  # "." or "a/..": a real name, so the temp dir lands beside it


def _replace_dir(out: Path, write: Callable[[Path], T]) -> T:
  """Runs `write` into a new directory beside `out`, then swaps it in by rename: a failed
  export leaves `out` as it was, and no file of an older export (a shard of another count,
  a stale index) survives in the new one."""
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{time.time_ns()}"
  tmp.mkdir()
  old = out.parent / f".{out.name}.old-{os.getpid()}-{time.time_ns()}"
  try:
    result = write(tmp)
    if out.exists():
      out.rename(old)
    tmp.rename(out)
  except BaseException:
    if old.exists() and not out.exists():  # the swap failed halfway: put the old one back
      old.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  shutil.rmtree(old, ignore_errors=True)
  return result
