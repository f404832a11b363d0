"""`shardlab data`: tokenize a text source once into shards + an index, and train a small
BPE tokenizer (docs/data.md)."""

import argparse
import sys

from shardlab.cli.args import run_command
from shardlab.errors import ConfigError
from shardlab.runtime import units

EPILOG = """examples:
  shardlab data train-bpe stdlib runs/bpe/tokenizer.json --vocab-size 2048
  shardlab data prepare stdlib runs/data/stdlib --tokenizer runs/bpe/tokenizer.json
  shardlab data prepare corpus.jsonl runs/data/web --tokenizer ./Llama-3.2-1B --text-field text
  python train.py --set data.corpus=runs/data/stdlib --set model.vocab_size=2048"""


def data_parser(prog: str = "shardlab data") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description="Prepare tokenized training data.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True, metavar="{prepare,train-bpe}")
  q = sub.add_parser("prepare", help="SRC (text file/dir, .jsonl, or stdlib) → OUT: token "
                                     "shards + index.json, tokenized in parallel")
  q.add_argument("source")
  q.add_argument("out")
  q.add_argument("--tokenizer", default="bytes",
                 help="bytes | a tokenizer.json | a SentencePiece .model | an HF model dir")
  q.add_argument("--text-field", default="text", help="the text of a .jsonl record")
  q.add_argument("--held-out-fraction", type=float, default=0.02,
                 help="every ⌈1/f⌉-th document goes to the held-out split (default 0.02)")
  q.add_argument("--workers", type=int, default=0, help="tokenizing processes (0: per core)")
  q.add_argument("--shard-tokens", type=int, default=2**27, help="tokens per shard file")
  q.add_argument("--max-bytes", type=int, help="read at most this much text")
  q = sub.add_parser("train-bpe", help="SRC → a byte-level BPE tokenizer.json")
  q.add_argument("source")
  q.add_argument("out")
  q.add_argument("--vocab-size", type=int, default=2048)
  q.add_argument("--max-bytes", type=int, default=8 * units.MiB,
                 help="train on at most this much text (default 8 MiB)")
  return p


def _stdlib_files(source: str):
  if source != "stdlib":
    return None
  from shardlab.config import DataConfig
  from shardlab.data import corpus
  return corpus._files(DataConfig())[0]


def _run(args) -> None:
  from shardlab.data import tokenizer, tokens

  say = lambda text: print(text, file=sys.stderr, flush=True)
  files = _stdlib_files(args.source)
  if args.command == "train-bpe":
    if args.vocab_size < 257:
      raise ConfigError(f"--vocab-size must be > 256 (the byte alphabet), got {args.vocab_size}")
    docs = tokens.documents(args.source, max_bytes=args.max_bytes, stdlib_files=files)
    out = tokenizer.train_bpe(docs, args.vocab_size, args.out)
    print(f"wrote a byte-level BPE tokenizer (vocab {args.vocab_size}) to {out}")
    return
  if not 0 < args.held_out_fraction < 0.5:
    raise ConfigError(f"--held-out-fraction must be in (0, 0.5), got {args.held_out_fraction}")
  index = tokens.prepare(args.source, args.out, args.tokenizer, args.text_field,
                         args.held_out_fraction, args.workers, args.shard_tokens,
                         args.max_bytes, say, files)
  counts = {s: sum(f["n_tokens"] for f in fs) for s, fs in index["splits"].items()}
  print(f"wrote {counts['train']:,} train and {counts['held_out']:,} held-out tokens "
        f"({sum(len(f) for f in index['splits'].values())} shards, vocab "
        f"{index['vocab_size']}) to {args.out}\ntrain on it with: python train.py --set "
        f"data.corpus={args.out} --set model.vocab_size={index['vocab_size']}")


def data_main(argv=None, prog: str = "shardlab data") -> int:
  return run_command(_run, data_parser(prog).parse_args(argv))
