"""`shardlab generate`: sample text from a trained checkpoint."""

import argparse
import dataclasses
import sys
import time

from shardlab import generate
import shardlab.cli.text as text_io
from shardlab.bounds import Int
from shardlab.cli.args import DefaultsHelp, add_simulate_devices, setup_devices
from shardlab.errors import ConfigError


def generate_parser(prog: str = "shardlab generate") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, formatter_class=DefaultsHelp,
      description="Sample text from a checkpoint with a KV cache, sharded with the rules it "
                  "was trained with (or another mesh and strategy).",
      epilog='Example: shardlab generate --checkpoint runs/tiny/ckpt --prompt "def " '
             "--max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0")
  p.add_argument("--checkpoint", required=True, help="a checkpoint directory (train.py "
                                                     "--checkpoint-dir): its newest intact step")
  p.add_argument("--strict", action="store_true",
                 help="refuse a damaged newest step instead of falling back to an older one")
  p.add_argument("--prompt", action="append", metavar="TEXT",
                 help="text to continue (encoded with the run's tokenizer: UTF-8 bytes by "
                      "default); give it several times to batch "
                      "prompts (those of one length share a prefill and decode loop); "
                      "default 'def '")
  bound = generate.BOUNDS
  p.add_argument("--max-new-tokens", type=bound["max_new_tokens"], default=200,
                 help="tokens to generate (bytes for a byte-level run; %(type)s); a sample "
                      "ends at EOS")
  p.add_argument("--temperature", type=bound["temperature"], default=0.8,
                 help="divides the logits before sampling; %(type)s")
  p.add_argument("--top-k", type=bound["top_k"], default=40,
                 help="sample among the k likeliest; %(type)s")
  p.add_argument("--seed", type=bound["seed"], default=0, help="the sampling seed; %(type)s")
  p.add_argument("--num-samples", type=bound["num_samples"], default=1,
                 help="samples per prompt; %(type)s")
  p.add_argument("--mesh", help="default: the checkpoint's")
  p.add_argument("--strategy", help="default: the checkpoint's")
  add_simulate_devices(p)
  p.add_argument("--prefill-chunk", type=Int(min=1), default=generate.PREFILL_CHUNK,
                 help="prompt tokens per prefill call (%(type)s; attention's scores and the "
                      "logits grow with it)")
  p.add_argument("--no-cache", action="store_true",
                 help="recompute the whole sequence for every token (slow; for checking)")
  p.add_argument("--quiet", action="store_true",
                 help="print only the samples (no header, no speed and memory report)")
  return p


def generate_main(argv=None, prog: str = "shardlab generate") -> int:
  args = generate_parser(prog).parse_args(argv)
  prompts = args.prompt or ["def "]
  try:
    for prompt in prompts:  # before any loading: a bad prompt fails at once
      text_io.prompt_bytes(prompt)
    setup_devices(args.simulate_devices)
    sampling = generate.Sampling(max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_k=args.top_k,
                                 seed=args.seed, num_samples=args.num_samples)
    gen, params, cfg, step = generate.from_checkpoint(args.checkpoint, args.mesh,
                                                      args.strategy, args.strict,
                                                      prefill_chunk=args.prefill_chunk)
    tokenizer = text_io.tokenizer_of(cfg)
    sampling = dataclasses.replace(sampling, vocab=tokenizer.vocab_size,
                                   eos_ids=text_io.eos_ids(tokenizer, cfg))
    start = time.perf_counter()
    if args.no_cache:
      texts = [text_io.uncached_texts(gen, params, tokenizer, p, sampling) for p in prompts]
      report = None
    else:
      texts, report = text_io.texts(gen, params, tokenizer, prompts, sampling)
    seconds = time.perf_counter() - start
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not args.quiet:
    print(f"# {cfg.model.name} at step {step} from {args.checkpoint}; {cfg.strategy} on "
          f"{cfg.mesh}; {len(prompts)} prompt(s) × {sampling.num_samples} × "
          f"{sampling.max_new_tokens} tokens in {seconds:.1f} s (compile included)",
          file=sys.stderr)
  many = len(prompts) * sampling.num_samples > 1
  for p, (prompt, samples) in enumerate(zip(prompts, texts)):
    for i, text in enumerate(samples):
      if many and not args.quiet:
        print(f"--- prompt {p} sample {i}", file=sys.stderr)
      print(prompt + text)
  if report is not None and not args.quiet:
    print("\n".join(f"# {line}" for line in report.lines()), file=sys.stderr)
  return 0
