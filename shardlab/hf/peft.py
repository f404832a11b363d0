"""A run's LoRA adapters ↔ PEFT's LoRA format (`adapter_config.json` +
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(base, DIR)` loads.

Both sides compute W·x + (alpha / r)·B·A·x, so r = lora.rank and lora_alpha = lora.alpha
carry over unchanged. A target's tensors come from the family's table (shardlab/hf/adapter.py):
the weight lora_weights names maps to an HF `Linear` (out, in), so A (in dims × R) is
lora_A.weight (R, in) and B (R × out dims) lora_B.weight (out, R), under the module's name
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`). A target whose weight
is fused with others in one HF tensor (Phi-3's qkv_proj, GPT-2's c_attn) or stored (in, out)
(GPT-2's Conv1D) has no such module: refused, naming it (export those with --merge-lora).

Here: the target table, adapter_config.json, and reading an adapter (`--init-from hf:DIR`);
writing one (`convert to-hf --peft`) is shardlab/hf/peft_export.py.
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np

from shardlab.errors import ConfigError
from shardlab.hf import families
from shardlab.hf import files as hf_files
from shardlab.hf import weights
from shardlab.hf.adapter import CONFIG_FILE, Mapping
from shardlab.parallel import lora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PEFT's wrapper around the HF model, in every key
# adapter_config.json field -> the one value shardlab computes, and why (anything else is
# refused): the update must be exactly (alpha / r)·B·A on each targeted weight.
REQUIRED = {"use_dora": (False, "DoRA rescales the adapted weight"),
            "use_rslora": (False, "rsLoRA scales by alpha/sqrt(r), shardlab by alpha/rank"),
            "fan_in_fan_out": (False, "the targets are Linear (out, in) weights"),
            "bias": ("none", "shardlab's adapters train no biases"),
            "lora_bias": (False, "shardlab's adapters have no bias"),
            "modules_to_save": (None, "every non-adapter weight is the base's"),
            "layers_to_transform": (None, "every layer has the targets' adapters"),
            "rank_pattern": ({}, "one rank for every target"),
            "alpha_pattern": ({}, "one alpha for every target"),
            "target_parameters": (None, "adapters sit on modules, not parameters"),
            "trainable_token_indices": (None, "the embeddings are the base's"),
            "layer_replication": (None, "the layers are the base's"),
            "alora_invocation_tokens": (None, "the adapters apply to every token")}


@dataclasses.dataclass(frozen=True)
class Target:
  """A LoRA target's adapter ↔ its PEFT tensors: `a` lora_A, `b` lora_B (stacked per layer
  like the weight)."""
  name: str  # shardlab's ("q")
  module: str  # the HF module, {i} per layer ("model.layers.{i}.self_attn.q_proj")
  a: Mapping
  b: Mapping


def rank_letter(family, m) -> str:
  return next(c for c in "RSTUWXYZ" if c not in family.sizes(m))


def targets(m, names) -> list[Target]:
  """The PEFT tensors of LoRA targets `names` of model `m`, or a ConfigError naming a target
  PEFT has no module for."""
  family, r = families.for_model(m), None
  offered = getattr(m, "lora_weights", {})
  table = family.tensors(m)
  out = []
  for name in names:
    found = [w for w in table if name in offered and w.param[-1] == offered[name]]
    if not found:
      raise ConfigError(f"model {m.name!r} ({m.arch}) has no LoRA target {name!r} in its "
                        f"Hugging Face table; its targets: {', '.join(offered) or 'none'}")
    for w in found:
      r = r or rank_letter(family, m)
      out.append(_target(name, w, r, m))
  return out


def _target(name: str, w: Mapping, r: str, m) -> Target:
  out_g, in_g = (w.hf_dims + ("", ""))[:2]
  n_in = len(in_g)
  why = (f"it is part of the fused HF tensor {w.hf}" if w.fused else
         f"its HF tensor {w.hf} has dims {w.hf_dims}, not a Linear's (out, in)"
         if len(w.hf_dims) != 2 or not w.hf.endswith(".weight") or
         sorted(w.dims[:n_in]) != sorted(in_g) or sorted(w.dims[n_in:]) != sorted(out_g)
         else None)
  if why:
    raise ConfigError(f"LoRA target {name!r} of {m.arch} has no PEFT module: {why}; PEFT "
                      f"export and import cover targets that are one Linear each (llama, "
                      f"mistral, qwen2, qwen3, qwen3_moe, gemma2, gemma3); export this run "
                      f"with `convert to-hf --merge-lora`")
  module = w.hf[:-len(".weight")]
  path = w.param[:-1] + (lora.PREFIX + name,)
  return Target(name, module,
                Mapping(path + ("a",), f"{KEY_PREFIX}{module}.lora_A.weight", (r, in_g),
                        w.dims[:n_in] + r),
                Mapping(path + ("b",), f"{KEY_PREFIX}{module}.lora_B.weight", (out_g, r),
                        r + w.dims[n_in:]))


def target_modules(m, found: list[Target]) -> list[str] | str:
  """adapter_config.json's target_modules: the modules' last names (PEFT matches a module
  whose name ends in one), or, where such a name also ends an untargeted module, a regex
  of the targeted ones (PEFT full-matches a string)."""
  others = {w.hf.rsplit(".", 1)[0] for w in families.for_model(m).tensors(m)}
  others -= {t.module for t in found}
  short = sorted({t.module.rsplit(".", 1)[-1] for t in found})
  if not any(o.rsplit(".", 1)[-1] in short for o in others):
    return short
  return "|".join(re.escape(t.module).replace(r"\{i\}", r"\d+") for t in found)


def adapter_config(cfg, found: list[Target], base: str | None) -> dict:
  alpha = cfg.lora.alpha
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
          "r": cfg.lora.rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
          "target_modules": target_modules(cfg.model, found), "lora_dropout": 0.0,
          "init_lora_weights": True, "inference_mode": True,
          **{k: v for k, (v, _) in REQUIRED.items()}}


KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


class _AdapterReader(hf_files.Reader):
  """The tensors of one adapter_model.safetensors (Reader reads a model's file names)."""

  def __init__(self, path: Path):
    self.tensors, self._maps = hf_files._header(path), {}


def is_adapter(hf_dir) -> bool:
  return (Path(hf_dir) / ADAPTER_CONFIG).is_file()


def load_params(hf_dir, cfg, abstract, sh):
  """Params for `--init-from hf:DIR`: the HF model's; where DIR holds a PEFT adapter, the
  base model's (DIR's own config.json and weights if it has them, else those of its
  base_model_name_or_path) plus the adapter as the run's LoRA params."""
  d = Path(hf_dir)
  if not is_adapter(d):
    return weights.load_params(d, cfg.model, abstract, sh)
  config, where = read_config(d), str(d / ADAPTER_CONFIG)
  reader = _reader(d)
  check(config, reader, cfg, where)
  base = d if (d / CONFIG_FILE).is_file() else base_dir(config, where)
  params = weights.load_params(base, cfg.model, abstract, sh)
  found = targets(cfg.model, cfg.lora.target_names)
  size = {**families.for_model(cfg.model).sizes(cfg.model),
          found[0].a.hf_dims[0]: cfg.lora.rank}
  for mapping in [m for t in found for m in (t.a, t.b)]:
    like = weights._at(abstract.state.params, mapping.param)
    names = mapping.hf_names(cfg.model.n_layers)

    def shard(index, mapping=mapping, names=names, like=like):
      letters = ("L" if mapping.stacked else "") + mapping.dims
      box = {c: slice(*s.indices(n)[:2]) for c, s, n in zip(letters, index, like.shape)}
      if mapping.stacked:
        out = np.stack([weights.read_box(reader, names[i], mapping, size, box)
                        for i in range(box["L"].start, box["L"].stop)])
      else:
        out = weights.read_box(reader, names[0], mapping, size, box)
      return out.astype(like.dtype)

    weights._set(params, mapping.param, jax.make_array_from_callback(
        like.shape, weights._at(sh.state.params, mapping.param), shard))
  return params


def read_config(d: Path) -> dict:
  path = d / ADAPTER_CONFIG
  try:
    config = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path} is not a readable JSON file ({type(e).__name__}: {e})") from None
  if not isinstance(config, dict):
    raise ConfigError(f"{path} holds {type(config).__name__}, not a PEFT adapter config")
  return config


def _reader(d: Path) -> hf_files.Reader:
  if not (d / ADAPTER_FILE).is_file():
    bin_hint = (" (adapter_model.bin is not read: save it with safe_serialization=True)"
                if (d / "adapter_model.bin").exists() else "")
    raise ConfigError(f"{d} has {ADAPTER_CONFIG} but no {ADAPTER_FILE}{bin_hint}")
  return _AdapterReader(d / ADAPTER_FILE)


def base_of(hf_dir) -> str | None:
  """The base model an `--init-from hf:DIR` run adapted, as adapter_config.json names it: DIR
  (absolute), or, for an adapter directory without a config.json, the base it names."""
  d = Path(hf_dir)
  if is_adapter(d) and not (d / CONFIG_FILE).is_file():
    try:
      return read_config(d).get("base_model_name_or_path")
    except ConfigError:
      return None
  return str(d.absolute())


def base_dir(config: dict, where: str) -> Path:
  """The base model directory an adapter directory without a config.json names."""
  base = config.get("base_model_name_or_path")
  if not base:
    raise ConfigError(f"{where}: base_model_name_or_path is {base!r} and the directory holds "
                      f"no {CONFIG_FILE}; put the adapter files in the base model's "
                      f"directory, or set base_model_name_or_path to that directory")
  if not (Path(base) / CONFIG_FILE).is_file():
    raise ConfigError(f"{where}: base_model_name_or_path {base!r} is not a local directory "
                      f"with a {CONFIG_FILE} (nothing is downloaded); copy the adapter "
                      f"files into the base model's directory and --init-from hf: that one")
  return Path(base)


def adapted(config: dict, reader, m, where: str) -> list[str]:
  """The shardlab targets the adapter file holds tensors for (every other tensor refused)."""
  modules = {}
  for name in m.lora_weights if hasattr(m, "lora_weights") else ():
    try:
      for t in targets(m, [name]):
        modules.update({t.module.format(i=i): name for i in range(m.n_layers)})
    except ConfigError:
      continue  # a target PEFT has no module for: its tensors are refused as unknown
  found, unknown = {}, []
  for key in sorted(reader.tensors):
    hit = KEY.fullmatch(key)
    if hit and hit.group(1) in modules:
      found[modules[hit.group(1)]] = True
    else:
      unknown.append(key)
  if unknown:
    raise ConfigError(f"{where}: {ADAPTER_FILE} holds tensors that are no LoRA A or B of "
                      f"a {m.arch} target ({', '.join(unknown[:5])}"
                      f"{', ...' if len(unknown) > 5 else ''}); modules_to_save, biases and "
                      f"other adapter types are not read")
  return [t for t in m.lora_weights if t in found]


def check(config: dict, reader, cfg, where: str) -> None:
  """Refuses an adapter unless the run's lora section computes what it does, naming the
  field that differs and the setting that fits."""
  if config.get("peft_type") != "LORA":
    raise ConfigError(f"{where}: peft_type = {config.get('peft_type')!r}; shardlab reads "
                      f"'LORA' adapters only")
  for key, (expected, why) in REQUIRED.items():
    value = config.get(key)
    if not (value in (expected, None) or (not expected and not value)):
      raise ConfigError(f"{where}: {key} = {value!r} is not supported ({why}); valid: "
                        f"{expected!r}")
  r, alpha = config.get("r"), config.get("lora_alpha")
  if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
    raise ConfigError(f"{where}: r = {r!r} and lora_alpha = {alpha!r}; a LoRA adapter has "
                      f"an integer r >= 1 and a lora_alpha > 0")
  names = adapted(config, reader, cfg.model, where)
  fits = f"--set lora.rank={r} --set lora.alpha={alpha} --set lora.targets={','.join(names)}"
  lc = cfg.lora
  diffs = ([f"lora.rank = {lc.rank}, but r = {r}"] if lc.rank != r else []) + (
      [f"lora.alpha = {lc.alpha}, but lora_alpha = {alpha}"] if lc.alpha != alpha else []) + (
      [f"lora.targets = {lc.targets!r}, but the adapter adapts {','.join(names)} "
       f"(target_modules {config.get('target_modules')!r})"]
      if sorted(lc.target_names) != sorted(names) else [])
  if diffs:
    raise ConfigError(f"{where}: the run's LoRA settings do not match the adapter: " +
                      "; ".join(diffs) + f"; run with {fits}")
  problems = []
  for t in targets(cfg.model, names):
    size = {**families.for_model(cfg.model).sizes(cfg.model), t.a.hf_dims[0]: r}
    for mapping in (t.a, t.b):
      shape = weights.hf_shape(mapping, size)
      for name in mapping.hf_names(cfg.model.n_layers):
        have = reader.tensors[name].shape if name in reader.tensors else None
        if have != shape:
          problems.append(f"  {name}: " + ("missing" if have is None else
                                           f"shape {have}, but the model implies {shape}"))
  if problems:
    raise ConfigError(f"{where}: {ADAPTER_FILE} does not match the model "
                      f"({len(problems)} problems):\n" + "\n".join(problems[:20]))


def files_dir(hf_dir, names) -> str:
  """`hf_dir`, or for a PEFT adapter directory holding none of `names` (the tokenizer's
  files), the local base model directory it names, where that one holds one."""
  if is_adapter(hf_dir) and not any((Path(hf_dir) / n).is_file() for n in names):
    base = base_of(hf_dir)
    if base and any((Path(base) / n).is_file() for n in names):
      return base
  return str(hf_dir)
