"""Text in, text out for `generate` and the end-of-run sample: prompts encoded with the
run's tokenizer (bytes by default), samples drawn over its whole vocabulary, cut at EOS and
decoded."""

import numpy as np

from shardlab import generate
from shardlab.errors import ConfigError
from shardlab.training import feed, tokenizer as tokenizer_lib


def tokenizer_of(cfg):
  return feed.tokenizer_for(cfg.data)


def sampling(tokenizer, **settings) -> generate.Sampling:
  return generate.Sampling(vocab=tokenizer.vocab_size, **settings)


def encode(tokenizer, prompt: str) -> np.ndarray:
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    return generate.prompt_bytes(prompt)  # refuses text that is not UTF-8, naming the byte
  ids = tokenizer.encode(prompt)
  if not ids:
    raise ConfigError(f"the prompt {prompt!r} encodes to no tokens with {tokenizer.spec}")
  return np.asarray(ids, np.int32)


def decode(tokenizer, tokens_RxN) -> list[str]:
  """Each row decoded, up to (not including) its first EOS."""
  out = []
  for row in np.asarray(tokens_RxN):
    if tokenizer.eos_id is not None and tokenizer.eos_id in row:
      row = row[:int(np.argmax(row == tokenizer.eos_id))]
    out.append(tokenizer.decode(row.tolist()))
  return out


def texts(gen, params, tokenizer, prompts: list[str], s: generate.Sampling):
  """([num_samples continuations] per prompt, ServingReport)."""
  tokens, report = gen.generate(params, [encode(tokenizer, p) for p in prompts], s)
  return [decode(tokenizer, t) for t in tokens], report


def uncached_texts(gen, params, tokenizer, prompt: str, s: generate.Sampling) -> list[str]:
  return decode(tokenizer, gen.tokens(params, encode(tokenizer, prompt), s, use_cache=False))
