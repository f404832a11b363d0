"""`shardlab data prepare --format chat`: a .jsonl of conversations tokenized with the chat
template (data/chat.py) into the prepared layout of data/tokens.py, plus per shard
`<split>-NNNNN.mask.npy` (uint8, one per token: 1 on assistant tokens), which packing
(data/packing.py) cuts into rows with the same slices as the tokens.

No EOS is appended: the template writes each turn's end token, and the ids equal
transformers' `apply_chat_template`. Conversations are tokenized in this process (Jinja
rendering is Python); a conversation is one document, so packing never lets two attend to
each other.
"""

import dataclasses
import shlex
import shutil
import time
from pathlib import Path

import numpy as np

from shardlab.errors import ConfigError
from shardlab.data import chat, outdir, tokens
from shardlab.data import tokenizer as tokenizer_lib


class _ChatWriter(tokens._Writer):
  """A split's shards, each with its loss mask beside it."""

  def __init__(self, *args):
    super().__init__(*args)
    self.masks, self.assistant_tokens = [], 0

  def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
    self.masks.append(mask)  # before the tokens: adding them may flush the shard
    self.assistant_tokens += int(mask.sum())
    super().add(ids)

  def flush(self) -> None:
    if not self.docs:
      return
    mask = np.concatenate(self.masks).astype(np.uint8)
    self.masks = []
    super().flush()
    if self.out is None:
      self.shards[-1] = dataclasses.replace(self.shards[-1], loss_mask=mask)
      return
    name = self.files[-1]["tokens"].removesuffix(".npy") + ".mask.npy"
    np.save(self.out / name, mask)
    self.files[-1]["mask"] = name


def _template_and_tokenizer(tokenizer_spec: str):
  tok = tokenizer_lib.load(tokenizer_spec)
  if not isinstance(tok, tokenizer_lib.HFTokenizer):
    raise ConfigError(f"chat data needs a Hugging Face tokenizer with a chat template; "
                      f"--tokenizer {tokenizer_spec!r} is {type(tok).__name__}; give a "
                      f"tokenizer directory with tokenizer.json and tokenizer_config.json")
  return chat.ChatTemplate(tokenizer_lib.find(tokenizer_spec).parent), tok


def tokenize(source: str, tokenizer_spec: str, held_out_fraction: float,
             out: Path | None = None, shard_tokens: int = 2**27,
             field: str = chat.MESSAGES_FIELD, say=None) -> dict:
  """Tokenizes the conversations of `source` (every ⌈1/fraction⌉-th to the held-out split);
  returns {split: writer}, in memory when `out` is None."""
  template, tok = _template_and_tokenizer(tokenizer_spec)
  dtype = tokenizer_lib.token_dtype(tok.vocab_size)
  writers = {s: _ChatWriter(s, out, shard_tokens, dtype) for s in tokens.SPLITS}
  start, n, total = time.perf_counter(), 0, 0
  for where, messages in chat.conversations(source, field):
    ids, mask = chat.encode(template, tok, messages, where)
    held = int((n + 1) * held_out_fraction) > int(n * held_out_fraction)
    writers["held_out" if held else "train"].add(ids.astype(dtype), mask)
    n, total = n + 1, total + len(ids)
  for w in writers.values():
    w.flush()
  if say:
    trained = sum(w.assistant_tokens for w in writers.values())
    say(f"tokenized {n:,} conversations, {total:,} tokens ({trained:,} in assistant turns) "
        f"in {time.perf_counter() - start:.1f} s")
  return writers


def prepare(source: str, out: str | Path, tokenizer_spec: str,
            field: str = chat.MESSAGES_FIELD, held_out_fraction: float = 0.02,
            shard_tokens: int = 2**27, say=None, overwrite: bool = False) -> dict:
  """Writes the shards, masks, index.json and the tokenizer's files under `out` (new or
  empty; with `overwrite`, an earlier prepare's output is replaced: data/outdir.py);
  returns the index."""
  out = Path(out)
  if shard_tokens < 1:
    raise ConfigError(f"--shard-tokens must be >= 1, got {shard_tokens}")
  template, tok = _template_and_tokenizer(tokenizer_spec)  # checked before `out` is touched
  outdir.claim(out, overwrite, shlex.join(
      ["shardlab", "data", "prepare", str(source), str(out), "--format", "chat",
       "--tokenizer", tokenizer_spec, "--messages-field", field, "--held-out-fraction",
       str(held_out_fraction), "--shard-tokens", str(shard_tokens)]))
  try:
    writers = tokenize(source, tokenizer_spec, held_out_fraction, out, shard_tokens, field,
                       say)
    path = tokenizer_lib.find(tokenizer_spec)
    for name in (path.name, chat.CONFIG_FILE, chat.TEMPLATE_FILE):  # eos, template go along
      if (path.parent / name).is_file():
        shutil.copy2(path.parent / name, out / name)
    index = tokens.write_index(out, source, path.name, tok, writers, "conversations",
                               held_out_fraction, chat={
        "messages_field": field,
        "assistant_spans": "markers" if template.markers else "prefix",
        "assistant_tokens": {s: w.assistant_tokens for s, w in writers.items()}})
  except ConfigError:
    shutil.rmtree(out, ignore_errors=True)  # nothing usable: a rerun may use the name
    raise
  return index


FORMATS = ("auto", "text", "chat")


def wanted(fmt: str, source: str, field: str = chat.MESSAGES_FIELD) -> bool:
  """Whether `data prepare --format fmt` reads `source` as conversations: `chat`, or `auto`
  and a .jsonl whose first record has a `field` list."""
  if fmt not in FORMATS:
    raise ConfigError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
  if fmt == "chat" and not (Path(source).suffix == ".jsonl" and Path(source).is_file()):
    raise ConfigError(f"--format chat reads a .jsonl file of conversations (one "
                      f"{{{field!r}: [{{'role': ..., 'content': ...}}, ...]}} per line); "
                      f"{source!r} is not one")
  return fmt == "chat" or (fmt == "auto" and chat.is_chat(source, field))


def summary(index: dict, out) -> str:
  counts = {s: sum(f["n_tokens"] for f in fs) for s, fs in index["splits"].items()}
  trained = index["chat"]["assistant_tokens"]
  return (f"wrote {counts['train']:,} train and {counts['held_out']:,} held-out tokens of "
          f"conversations ({trained['train']:,} and {trained['held_out']:,} in assistant "
          f"turns, which the loss reads; assistant spans by {index['chat']['assistant_spans']}"
          f") to {out}\nfine-tune the model the tokenizer belongs to on it with: shardlab "
          f"train --model MODEL.toml --init-from hf:DIR --set data.corpus={out} "
          f"(docs/fine-tuning.md)")
