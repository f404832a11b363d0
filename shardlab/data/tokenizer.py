"""Tokenizers for training data and generation: bytes (the default, vocab 256, nothing to
install), a Hugging Face `tokenizer.json` (the `tokenizers` library) or a SentencePiece
`.model` (the `sentencepiece` library); both libraries are the `data` extra.

`data.tokenizer` names one: "bytes", a tokenizer.json or .model file, or a directory holding
one (a Hugging Face model directory). Every tokenizer has encode(text) -> ids, decode(ids)
-> text, vocab_size, and eos_id / bos_id (None when it has none).
"""

import json
from pathlib import Path

import numpy as np

from shardlab.errors import ConfigError

BYTES = "bytes"
HF_FILE, SP_FILE = "tokenizer.json", "tokenizer.model"
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class ByteTokenizer:
  """UTF-8 bytes as ids 0-255; no special tokens (documents are told apart by segment ids)."""
  vocab_size, eos_id, bos_id, spec = 256, None, None, BYTES

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A `tokenizers` tokenizer.json; eos/bos from tokenizer_config.json beside it, else the
  first of the usual special-token names it knows."""

  def __init__(self, path: Path):
    tokenizers = _library("tokenizers")
    try:  # the library raises a plain Exception for a file it cannot parse
      self.spec, self.inner = str(path), tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
      raise _damaged(path, "a Hugging Face tokenizer.json", e) from None
    self.vocab_size = _checked_vocab(path, self.inner.get_vocab_size(with_added_tokens=True))
    named = _configured(path.parent)
    self.eos_id = self._id(named.get("eos_token"), EOS_NAMES)
    self.bos_id = self._id(named.get("bos_token"), BOS_NAMES)

  def _id(self, configured, names) -> int | None:
    for name in ([configured] if configured else []) + list(names):
      found = self.inner.token_to_id(name)
      if found is not None:
        return found
    return None

  def encode(self, text: str) -> list[int]:
    return self.inner.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Parallel in Rust, over all cores."""
    return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self.inner.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer:

  def __init__(self, path: Path):
    sentencepiece = _library("sentencepiece")
    try:  # OSError or RuntimeError for a file that is not a serialized ModelProto
      self.spec = str(path)
      self.inner = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:
      raise _damaged(path, "a SentencePiece .model", e) from None
    self.vocab_size = _checked_vocab(path, self.inner.get_piece_size())
    self.eos_id = self.inner.eos_id() if self.inner.eos_id() >= 0 else None
    self.bos_id = self.inner.bos_id() if self.inner.bos_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self.inner.encode(text)

  def decode(self, ids) -> str:
    return self.inner.decode([int(i) for i in ids])


def _library(name: str):
  try:
    return __import__(name)
  except ImportError:
    raise ConfigError(f"data.tokenizer needs the {name!r} library: pip install "
                      f"'shardlab[data]' (or pip install {name})") from None


def _damaged(path: Path, kind: str, error: Exception) -> ConfigError:
  text = str(error).strip()
  reason = text.splitlines()[0][:300] if text else type(error).__name__
  return ConfigError(f"data.tokenizer {str(path)!r} cannot be read as {kind}: {reason}; the "
                     f"file is damaged, truncated or of another kind (valid: 'bytes', a "
                     f"tokenizer.json, a SentencePiece .model, or a directory holding one)")


def _checked_vocab(path: Path, size: int) -> int:
  if size < 1:
    raise ConfigError(f"data.tokenizer {str(path)!r} has an empty vocabulary; valid: a "
                      f"tokenizer with at least one token")
  return size


def _configured(directory: Path) -> dict:
  """eos_token / bos_token names from a tokenizer_config.json, if there is one; one that
  cannot be read, or names them as something other than a string, is refused by name."""
  path = directory / "tokenizer_config.json"
  if not path.exists():
    return {}
  try:
    config = json.loads(path.read_bytes())
  except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or not UTF-8
    raise ConfigError(f"{path} (beside data.tokenizer) cannot be read: {e}; fix or remove "
                      f"it") from None
  if not isinstance(config, dict):
    raise ConfigError(f"{path} (beside data.tokenizer) must hold a JSON object, got "
                      f"{type(config).__name__}; fix or remove it")
  plain = lambda v: v.get("content") if isinstance(v, dict) else v
  out = {k: plain(config.get(k)) for k in ("eos_token", "bos_token")}
  for key, name in out.items():
    if name is not None and not isinstance(name, str):
      raise ConfigError(f"{path}: {key} = {name!r} is not valid; valid: a token string, "
                        f"{{\"content\": TOKEN}} or null")
  return out


def find(spec: str) -> Path | None:
  """The tokenizer file `spec` names (a file, or a directory holding one); None for bytes."""
  if spec == BYTES:
    return None
  path = Path(spec)
  if path.is_dir():
    for name in (HF_FILE, SP_FILE):
      if (path / name).is_file():
        return path / name
    raise ConfigError(f"data.tokenizer {spec!r} is a directory without {HF_FILE} or "
                      f"{SP_FILE}; valid: 'bytes', a tokenizer.json, a SentencePiece .model, "
                      f"or a directory holding one")
  if not path.is_file():
    raise ConfigError(f"data.tokenizer {spec!r} does not exist; valid: 'bytes', a "
                      f"tokenizer.json, a SentencePiece .model, or a directory holding one")
  return path


def load(spec: str):
  """The tokenizer `spec` names (see the module docstring)."""
  path = find(spec)
  if path is None:
    return ByteTokenizer()
  if path.suffix == ".json":
    return HFTokenizer(path)
  if path.suffix == ".model":
    return SentencePieceTokenizer(path)
  raise ConfigError(f"data.tokenizer {spec!r}: unknown kind of file {path.name!r}; valid: "
                    f"'bytes', a tokenizer.json (Hugging Face tokenizers), a SentencePiece "
                    f".model")


def train_bpe(texts, vocab_size: int, out: str | Path) -> Path:
  """Trains a byte-level BPE tokenizer.json on `texts` (an iterable of strings) with an
  <|endoftext|> token; a few seconds on the embedded corpus. Returns the file written."""
  tokenizers = _library("tokenizers")
  model = tokenizers.Tokenizer(tokenizers.models.BPE())
  model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  model.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  model.train_from_iterator(texts, trainer)
  out = Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  model.save(str(out))
  return out


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype that holds every id (uint16 for vocabularies ≤ 65536)."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
