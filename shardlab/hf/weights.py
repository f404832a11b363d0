"""Hugging Face weights ↔ shardlab params, one tensor (or one shard of one) at a time, for
any family: what goes where is its adapter's tensor table (shardlab/hf/adapter.py), the
engine here knows no family.

Import builds every param with jax.make_array_from_callback on its target sharding: each
device's callback reads only its own box of the HF tensors (layer by layer for the stacked
`blocks`), so the whole model is never in one host's memory and each process reads only
the shards its devices hold. Export fetches one layer of one param at a time and streams
it into safetensors files. A fused HF tensor (several params side by side, Phi-3's qkv_proj)
is split on import, each param reading only its part, and concatenated again on export.
"""

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np

from shardlab.data import chat
from shardlab.hf import config as hf_config
from shardlab.hf import families
from shardlab.hf import files as hf_files
from shardlab.hf.adapter import CONFIG_FILE, STACKED, Adapter, Mapping
from shardlab.errors import ConfigError
from shardlab.training.state import Abstract, Shardings
from shardlab.runtime import units

PREFIX = "hf:"  # --init-from hf:HF_DIR
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some older checkpoints carry


def _extent(group: str, size: dict[str, int]) -> int:
  return math.prod(size[c] for c in group)


def hf_shape(mapping: Mapping, size: dict[str, int]) -> tuple[int, ...]:
  """The whole HF tensor's shape (every part of a fused one)."""
  shape = [_extent(group, size) for group in mapping.hf_dims]
  if mapping.fused:
    shape[mapping.axis] = sum(_extent(group, size) for group in mapping.parts)
  return tuple(shape)


def part_start(mapping: Mapping, size: dict[str, int]) -> int:
  """Where the param's part of a fused HF tensor starts along its `axis` (0: not fused)."""
  return sum(_extent(group, size) for group in mapping.parts[:mapping.part])


def read_box(reader: hf_files.Reader, name: str, mapping: Mapping, size: dict[str, int],
             box: dict[str, slice]) -> np.ndarray:
  """The box of param letters `box` (unit-step slices) cut from HF tensor `name` (from the
  param's part of it, if fused), in the param's dim order. Only the outer letter of each
  flattened HF dim narrows the read; inner letters are cut after the reshape."""
  hf_box, shape, inner = [], [], []
  start = part_start(mapping, size)
  for k, group in enumerate(mapping.hf_dims):
    outer, at = box[group[0]], start if k == mapping.axis else 0
    rest = math.prod(size[c] for c in group[1:])
    hf_box.append(slice(at + outer.start * rest, at + outer.stop * rest))
    shape += [outer.stop - outer.start] + [size[c] for c in group[1:]]
    inner += [slice(None)] + [box[c] for c in group[1:]]
  block = reader.read(name, tuple(hf_box)).reshape(shape)[tuple(inner)]
  order = "".join(mapping.hf_dims)
  return block.transpose([order.index(c) for c in mapping.dims])


def to_hf_layout(value: np.ndarray, mapping: Mapping) -> np.ndarray:
  """A whole param (one layer of it if stacked) in the HF tensor's layout."""
  moved = value.transpose([mapping.dims.index(c) for c in "".join(mapping.hf_dims)])
  shape, pos = [], 0
  for group in mapping.hf_dims:
    shape.append(math.prod(moved.shape[pos:pos + len(group)]))
    pos += len(group)
  return moved.reshape(shape)


def _at(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def tensor_table(family: Adapter, m) -> dict[str, list[Mapping]]:
  """HF name (as the table spells it) -> the mappings that make the tensor: one param's, or
  every part of a fused one, in order. A table that leaves a fused tensor's part unmapped,
  or maps one tensor twice, is the adapter's mistake: refused, never written half-filled."""
  table: dict[str, list[Mapping]] = {}
  for mapping in family.tensors(m):
    table.setdefault(mapping.hf, []).append(mapping)
  for name, group in table.items():
    group.sort(key=lambda g: g.part)
    first = group[0]
    if [(g.parts, g.axis, g.part) for g in group] != [
        (first.parts, first.axis, k) for k in range(max(len(first.parts), 1))]:
      raise ConfigError(
          f"{type(family).__name__}.tensors maps {name} to "
          f"{', '.join('.'.join(g.param) for g in group)}: an HF tensor is one param's, or "
          f"fused from each of its parts once (shardlab.hf.adapter.fuse)")
  return table


def check_tensors(reader: hf_files.Reader, m, hf_dir, family: Adapter | None = None) -> None:
  """Every tensor the model needs is there with the shape config.json implies, and nothing
  is left over (a leftover would mean weights this model would silently drop)."""
  family = family or families.for_model(m)
  size, expected = family.sizes(m), {}
  for group in tensor_table(family, m).values():
    for name in group[0].hf_names(m.n_layers):
      expected[name] = hf_shape(group[0], size)
  problems = [f"  {name}: missing" for name in expected if name not in reader.tensors]
  problems += [f"  {name}: shape {reader.tensors[name].shape} in "
               f"{reader.tensors[name].file.name}, but config.json implies {shape}"
               for name, shape in expected.items()
               if name in reader.tensors and reader.tensors[name].shape != shape]
  unread = family.unread(m)
  extra = sorted(n for n in reader.tensors if n not in expected and n not in unread
                 and not n.endswith(IGNORED_SUFFIXES))
  problems += [f"  {name}: not part of a {family.label} model with this config" for name in extra]
  if problems:
    raise ConfigError(f"the weights in {hf_dir} do not match its config.json "
                      f"({len(problems)} problems):\n" + "\n".join(problems[:20]) +
                      ("\n  ..." if len(problems) > 20 else ""))


def load_params(hf_dir: str | Path, model, abstract: Abstract, sh: Shardings):
  """Params of the HF model in `hf_dir`, each born on `sh.state.params` in the abstract
  state's dtype. `model` (the run's model config) must compute what config.json does."""
  hf, where = hf_config.read(hf_dir), str(Path(hf_dir) / CONFIG_FILE)
  hf_model = hf_config.to_model(hf, model.name, where, families.for_dir(hf, model, where))
  family = families.for_model(model)
  family.check_matches(hf_model, model, hf_dir)
  tensors = family.reader(hf_files.Reader(hf_dir), model)
  check_tensors(tensors, model, hf_dir, family)
  size, params = family.sizes(model), {}
  for mapping in family.tensors(model):
    target = _at(abstract.state.params, mapping.param)
    names = mapping.hf_names(model.n_layers)
    letters = ("L" if mapping.stacked else "") + mapping.dims

    def shard(index, mapping=mapping, names=names, letters=letters, target=target):
      box = {c: slice(*s.indices(n)[:2]) for c, s, n in zip(letters, index, target.shape)}
      if mapping.stacked:  # one layer at a time: never more than this device's shard
        out = np.stack([read_box(tensors, names[i], mapping, size, box)
                        for i in range(box["L"].start, box["L"].stop)])
      else:
        out = read_box(tensors, names[0], mapping, size, box)
      return out.astype(target.dtype)

    _set(params, mapping.param, jax.make_array_from_callback(
        target.shape, _at(sh.state.params, mapping.param), shard))
  return params


# Traced layer index: one compile per param shape, not one per layer.
_layer = jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False))


def export_params(params, model, hf_dir: str | Path, dtype: str = "float32",
                  max_shard_bytes: int = 4 * units.GiB) -> list[Path]:
  """Writes config.json and safetensors weights (sharded with an index past
  `max_shard_bytes`) that transformers' from_pretrained loads (the class the model's
  adapter names: LlamaForCausalLM, MixtralForCausalLM, ...)."""
  np_dtype = {"float32": np.dtype(np.float32), "bfloat16": hf_files.DTYPES["BF16"],
              "float16": np.dtype(np.float16)}.get(dtype)
  if np_dtype is None:
    raise ConfigError(f"unknown export dtype {dtype!r}; valid: bfloat16, float16, float32")
  out = Path(hf_dir)
  out.mkdir(parents=True, exist_ok=True)
  family = families.for_model(model)
  size, entries, sources = family.sizes(model), [], {}
  for group in tensor_table(family, model).values():
    for layer, name in enumerate(group[0].hf_names(model.n_layers)):
      shape, layer = hf_shape(group[0], size), layer if group[0].stacked else None
      for expert in range(shape[0]) if STACKED in name else (None,):
        entry = name if expert is None else name.replace(STACKED, str(expert))
        entries.append((entry, np_dtype, shape if expert is None else shape[1:]))
        sources[entry] = (group, layer, expert)

  def produce(name: str) -> np.ndarray:
    group, layer, expert = sources[name]
    parts = []
    for mapping in group:  # a fused tensor: its params concatenated (one layer of each)
      value = _at(params, mapping.param)
      if layer is not None:
        value = _layer(value, layer)
      parts.append(to_hf_layout(np.asarray(jax.device_get(value)), mapping))
    value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=group[0].axis)
    return (value if expert is None else value[expert]).astype(np_dtype)

  nbytes = {n: math.prod(s) * d.itemsize for n, d, s in entries}
  groups = hf_files.plan_files(((n, nbytes[n]) for n, _, _ in entries), max_shard_bytes)
  by_name = {e[0]: e for e in entries}
  files, weight_map = [], {}
  for k, group in enumerate(groups):
    file = (hf_files.SINGLE_FILE if len(groups) == 1
            else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors")
    hf_files.write(out / file, [by_name[n] for n in group], produce)
    files.append(out / file)
    weight_map.update({n: file for n in group})
  stale = [out / hf_files.INDEX_FILE] if len(groups) == 1 else [out / hf_files.SINGLE_FILE]
  for path in stale:  # a leftover from an earlier export would shadow or confuse this one
    path.unlink(missing_ok=True)
  if len(groups) > 1:
    hf_files.write_index(out, weight_map, sum(nbytes.values()))
  config = family.to_hf(model, dtype)
  (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
  (out / GENERATION_FILE).write_text(
      json.dumps(family.generation_config(model), indent=2) + "\n")
  return files


GENERATION_FILE = "generation_config.json"


# transformers 5 saves a tokenizer's chat template in its own file, not in its config.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", chat.CONFIG_FILE, chat.TEMPLATE_FILE,
                   "special_tokens_map.json", GENERATION_FILE)


def copy_tokenizer(source: str | Path, hf_dir: str | Path) -> list[str]:
  """Copies the tokenizer and generation files of an HF directory (weights are not text)."""
  copied = []
  for name in TOKENIZER_FILES:
    if (Path(source) / name).exists():
      shutil.copy2(Path(source) / name, Path(hf_dir) / name)
      copied.append(name)
  return copied
