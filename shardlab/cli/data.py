"""`shardlab data`: tokenize a text source once into shards + an index, and train a small
BPE tokenizer (docs/data.md)."""

import argparse
import signal
import sys
import threading
from pathlib import Path

from shardlab.cli.args import run_command
from shardlab.bounds import Int
from shardlab.config import BOUNDS
from shardlab.runtime import units

EPILOG = """examples:
  shardlab data train-bpe stdlib runs/bpe/tokenizer.json --vocab-size 2048
  shardlab data prepare stdlib runs/data/stdlib --tokenizer runs/bpe/tokenizer.json
  shardlab data prepare corpus.jsonl runs/data/web --tokenizer ./Llama-3.2-1B --text-field text
  python train.py --set data.corpus=runs/data/stdlib --set model.vocab_size=2048"""


def data_parser(prog: str = "shardlab data") -> argparse.ArgumentParser:
  from shardlab.data import tokens  # prepare()'s own ranges
  p = argparse.ArgumentParser(prog=prog, description="Prepare tokenized training data.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True, metavar="{prepare,train-bpe}")
  text = ("SRC (text file/dir, .jsonl, .parquet, .arrow, a datasets save_to_disk dir, or "
          "stdlib) → OUT: token shards + index.json, tokenized in parallel")
  q = sub.add_parser("prepare", help=text, description=text)
  q.add_argument("source", help="what to read (see the formats above)")
  q.add_argument("out", help="the directory to write the shards to (train.py's data.corpus)")
  q.add_argument("--tokenizer", default="bytes",
                 help="bytes | a tokenizer.json | a SentencePiece .model | an HF model dir")
  q.add_argument("--text-field", default="text",
                 help="the text of a .jsonl record, or the text column of a Parquet, Arrow "
                      "or datasets source (default text)")
  q.add_argument("--held-out-fraction", type=BOUNDS["data.held_out_fraction"], default=0.02,
                 help="every ⌈1/f⌉-th document goes to the held-out split (default 0.02; "
                      "%(type)s)")
  q.add_argument("--workers", type=tokens.WORKERS, default=0,
                 help="tokenizing processes (default %(default)s; %(type)s)")
  q.add_argument("--shard-tokens", type=tokens.SHARD_TOKENS, default=2**27,
                 help="tokens per shard file (default 2**27 = %(default)s; %(type)s)")
  q.add_argument("--max-bytes", type=BOUNDS["data.max_bytes"],
                 help="read at most this much text (%(type)s; default: all of it)")
  q.add_argument("--overwrite", action="store_true",
                 help="replace OUT if an earlier prepare wrote it, finished or interrupted "
                      "(default: refuse an OUT that is not empty)")
  q.add_argument("--format", default="auto", choices=("auto", "text", "chat"),
                 help="chat: a .jsonl of conversations rendered with the tokenizer's chat "
                      "template, the loss on assistant turns only (docs/fine-tuning.md); "
                      "auto: chat when the first .jsonl record has --messages-field "
                      "(default auto)")
  q.add_argument("--messages-field", default="messages",
                 help="the conversation (a list of role/content messages) of a chat .jsonl "
                      "record (default messages)")
  text = "SRC → a byte-level BPE tokenizer.json"
  q = sub.add_parser("train-bpe", help=text, description=text)
  q.add_argument("source", help="a text file or directory, a .jsonl, or stdlib")
  q.add_argument("out", help="the tokenizer.json to write")
  q.add_argument("--vocab-size", type=Int(gt=256, note="the byte alphabet"),
                 default=2048, help="tokens in the vocabulary (default %(default)s; %(type)s)")
  q.add_argument("--max-bytes", type=BOUNDS["data.max_bytes"], default=8 * units.MiB,
                 help="train on at most this much text (default 8 MiB = %(default)s; "
                      "%(type)s)")
  return p


def _stdlib_files(source: str):
  if source != "stdlib":
    return None
  from shardlab.config import DataConfig
  from shardlab.data import corpus
  return corpus._files(DataConfig())[0]


def _run(args) -> None:
  from shardlab.data import sources, tokenizer, tokens

  say = lambda text: print(text, file=sys.stderr, flush=True)
  files = _stdlib_files(args.source)
  if args.command == "train-bpe":
    docs = sources.documents(args.source, max_bytes=args.max_bytes, stdlib_files=files)
    out = tokenizer.train_bpe(docs, args.vocab_size, args.out)
    print(f"wrote a byte-level BPE tokenizer (vocab {args.vocab_size}) to {out}")
    return
  from shardlab.data import chat_tokens
  if chat_tokens.wanted(args.format, args.source, args.messages_field):
    index = chat_tokens.prepare(args.source, args.out, args.tokenizer, args.messages_field,
                                args.held_out_fraction, args.shard_tokens, say,
                                args.overwrite)
    return print(chat_tokens.summary(index, args.out))
  index = tokens.prepare(args.source, args.out, args.tokenizer, args.text_field,
                         args.held_out_fraction, args.workers, args.shard_tokens,
                         args.max_bytes, say, files, args.overwrite)
  counts = {s: sum(f["n_tokens"] for f in fs) for s, fs in index["splits"].items()}
  print(f"wrote {counts['train']:,} train and {counts['held_out']:,} held-out tokens "
        f"({sum(len(f) for f in index['splits'].values())} shards, vocab "
        f"{index['vocab_size']}) to {args.out}\ntrain on it with: python train.py --set "
        f"data.corpus={args.out} --set model.vocab_size={index['vocab_size']}")


class _Terminated(KeyboardInterrupt):
  pass


def _terminate(signum, frame):
  raise _Terminated


def data_main(argv=None, prog: str = "shardlab data") -> int:
  """Ctrl-C or SIGTERM ends a command with one line (the workers are stopped on the way
  out, data/workers.py); an interrupted prepare's output is refused until --overwrite."""
  args = data_parser(prog).parse_args(argv)
  main = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _terminate) if main else None
  try:
    return run_command(_run, args)
  except KeyboardInterrupt as e:
    from shardlab.data import outdir
    unfinished = args.command == "prepare" and (Path(args.out) / outdir.MARKER).is_file()
    left = f"; {args.out} is unfinished: rerun with --overwrite to replace it" if unfinished else ""
    print(f"interrupted{left}", file=sys.stderr)
    return 143 if isinstance(e, _Terminated) else 130
  finally:
    if main:
      signal.signal(signal.SIGTERM, previous)
