"""Text in, text out for `generate` and the end-of-run sample: prompts encoded with the
run's tokenizer (bytes by default), samples drawn over its whole vocabulary, the decode loop
stopped once every sample has drawn an EOS (eos_ids), text decoded up to each sample's
first EOS."""

import numpy as np

from shardlab import generate
from shardlab.errors import ConfigError
from shardlab.models import protocol
from shardlab.data import feed, tokenizer as tokenizer_lib


def tokenizer_of(cfg):
  return feed.tokenizer_for(cfg.data)


def eos_ids(tokenizer, cfg) -> tuple[int, ...]:
  """The ids that end a sample: none for bytes; the tokenizer's EOS, and for a model
  imported with --init-from hf:DIR also its config's eos ids (a Llama 3 lists several, e.g.
  <|end_of_text|> and <|eot_id|>). A model trained from scratch keeps only the tokenizer's:
  its configured ids are defaults that mean nothing to this tokenizer."""
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    return ()
  ids = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  if (cfg.checkpoint.init_from or "").startswith("hf:"):
    ids += [i for i in protocol.get(cfg.model, "eos_ids") if i < tokenizer.vocab_size]
  return tuple(dict.fromkeys(ids))


def sampling(tokenizer, cfg, **settings) -> generate.Sampling:
  return generate.Sampling(vocab=tokenizer.vocab_size, eos_ids=eos_ids(tokenizer, cfg),
                           **settings)


def prompt_bytes(prompt: str) -> np.ndarray:
  """The prompt's UTF-8 bytes as tokens; text that is not UTF-8 (bytes a terminal passed
  through undecoded) is refused, naming the first bad byte."""
  try:
    return np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32)
  except UnicodeEncodeError as e:
    raw = prompt.encode("utf-8", "surrogateescape")
    raise ConfigError(f"the prompt is not valid UTF-8 text: byte {raw[e.start]:#04x} at "
                      f"position {e.start} ({raw[:40]!r}); give UTF-8 text") from None


def encode(tokenizer, prompt: str) -> np.ndarray:
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    return prompt_bytes(prompt)  # refuses text that is not UTF-8, naming the byte
  ids = tokenizer.encode(prompt)
  if not ids:
    raise ConfigError(f"the prompt {prompt!r} encodes to no tokens with {tokenizer.spec}")
  return np.asarray(ids, np.int32)


def decode(tokenizer, tokens_RxN, eos: tuple[int, ...] = ()) -> list[str]:
  """Each row decoded, up to (not including) its first EOS."""
  out = []
  for row in np.asarray(tokens_RxN):
    hit = np.isin(row, eos)
    out.append(tokenizer.decode(row[:int(hit.argmax()) if hit.any() else len(row)].tolist()))
  return out


def texts(gen, params, tokenizer, prompts: list[str], s: generate.Sampling):
  """([num_samples continuations] per prompt, ServingReport)."""
  tokens, report = gen.generate(params, [encode(tokenizer, p) for p in prompts], s)
  return [decode(tokenizer, t, s.eos_ids) for t in tokens], report


def uncached_texts(gen, params, tokenizer, prompt: str, s: generate.Sampling) -> list[str]:
  tokens = gen.tokens(params, encode(tokenizer, prompt), s, use_cache=False)
  return decode(tokenizer, tokens, s.eos_ids)
