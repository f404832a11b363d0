"""`convert to-hf --peft`: a LoRA run's adapters as a PEFT adapter directory (the format
and the target table: shardlab/hf/peft.py)."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from shardlab.errors import ConfigError
from shardlab.hf import convert as hf_convert
from shardlab.hf import families
from shardlab.hf import files as hf_files
from shardlab.hf import weights
from shardlab.hf.peft import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, base_of, targets
from shardlab.models import registry
from shardlab.training import checkpoint


def export_adapter(ckpt_dir, out_dir, mesh: str = hf_convert.DEFAULT_MESH,
                   strategy: str = hf_convert.DEFAULT_STRATEGY, dtype: str = "auto",
                   overwrite: bool = False, strict: bool = False, base_model: str | None = None,
                   tokenizer_from=None) -> tuple[dict, list[str]]:
  """Writes the LoRA adapters of the newest intact checkpoint in `ckpt_dir` as a PEFT
  adapter directory `out_dir` (replaced whole, as to-hf's output); returns
  (adapter_config.json's contents, tokenizer files copied). The base model it names is
  `base_model`, else the run's `--init-from hf:DIR`, else none."""
  if jax.process_count() > 1:
    raise ConfigError(f"to-hf --peft runs in a single process (this run has "
                      f"{jax.process_count()}); run it on one host")
  out = hf_convert._check_output(Path(ckpt_dir), Path(out_dir), overwrite)

  def read(restore, step):
    cfg = registry.run_config_from_dict(restore("config"), f"checkpoint {ckpt_dir}/{step}")
    if not cfg.lora.rank:
      raise ConfigError(f"the checkpoint in {ckpt_dir}/{step} has no LoRA adapters "
                        f"(lora.rank 0); export the model with `convert to-hf` without --peft")
    found = targets(cfg.model, cfg.lora.target_names)  # refused before any device work
    cfg = dataclasses.replace(cfg, mesh=mesh, strategy=strategy)
    abstract, sh = hf_convert._placement(cfg)
    return cfg, found, abstract, restore("params", abstract.state.params, sh.state.params)

  (cfg, found, abstract, params), _ = checkpoint.restore_newest(
      ckpt_dir, read, "--strict" if strict else None)
  if dtype == "auto":
    stored = np.dtype(weights._at(abstract.state.params, found[0].a.param).dtype)
    dtype = "float32" if stored == np.float32 else "bfloat16"
  np_dtype = {"float32": np.dtype(np.float32), "bfloat16": hf_files.DTYPES["BF16"],
              "float16": np.dtype(np.float16)}.get(dtype)
  if np_dtype is None:
    raise ConfigError(f"unknown export dtype {dtype!r}; valid: auto, bfloat16, float16, "
                      f"float32")
  init_from = cfg.checkpoint.init_from or ""
  if base_model is None and init_from.startswith(weights.PREFIX):
    base_model = base_of(init_from[len(weights.PREFIX):])
  size = {**families.for_model(cfg.model).sizes(cfg.model),
          found[0].a.hf_dims[0]: cfg.lora.rank}
  sources, entries = {}, []
  for t in found:
    for mapping in (t.a, t.b):
      for layer, name in enumerate(mapping.hf_names(cfg.model.n_layers)):
        sources[name] = (mapping, layer if mapping.stacked else None)
        entries.append((name, np_dtype, weights.hf_shape(mapping, size)))

  def produce(name: str) -> np.ndarray:
    mapping, layer = sources[name]
    value = weights._at(params, mapping.param)
    value = value if layer is None else weights._layer(value, layer)
    return weights.to_hf_layout(np.asarray(jax.device_get(value)), mapping).astype(np_dtype)

  config = adapter_config(cfg, found, base_model)

  def write(directory: Path) -> list[str]:
    hf_files.write(directory / ADAPTER_FILE, sorted(entries), produce)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return weights.copy_tokenizer(tokenizer_from, directory) if tokenizer_from else []

  return config, hf_convert._replace_dir(out, write)
