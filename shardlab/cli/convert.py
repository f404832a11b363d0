"""`shardlab convert`: Hugging Face model directories ↔ shardlab checkpoints (Llama, Mixtral,
and any family whose adapter is registered: shardlab/hf/adapter.py)."""

import argparse
import sys
from pathlib import Path

from shardlab.runtime import devices
from shardlab.bounds import Float
from shardlab.cli.args import run_command
from shardlab.errors import ConfigError
from shardlab.runtime import units

EPILOG = """examples:
  shardlab convert from-hf ./TinyLlama-1.1B ./ckpt/tinyllama
  python train.py --model ./ckpt/tinyllama/model.toml --init-from ./ckpt/tinyllama
  python train.py --model ./ckpt/tinyllama/model.toml --init-from hf:./TinyLlama-1.1B
  shardlab convert to-hf ./runs/ft ./llama-ft --tokenizer-from ./TinyLlama-1.1B
  shardlab convert to-hf ./runs/lora ./llama-lora --merge-lora
  shardlab convert to-hf ./runs/lora ./llama-adapter --peft
  shardlab convert hf-config ./TinyLlama-1.1B > tinyllama.toml"""


def convert_parser(prog: str = "shardlab convert") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, description="Import and export Hugging Face weights (safetensors): Llama, "
      "Mixtral, and any family with a registered adapter.",
      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True, metavar="{from-hf,to-hf,hf-config}")

  def placement(q):
    q.add_argument("--mesh", default="fsdp:-1",
                   help="mesh the params are spread over while converting (default fsdp:-1)")
    q.add_argument("--strategy", default="fsdp", help="dp | fsdp | tp | fsdp_tp | ...")
    q.add_argument("--simulate-devices", type=devices.SIMULATED, metavar="N",
                   help="run on N simulated CPU devices (%(type)s; default: the real devices)")

  text = "HF_DIR (config.json + safetensors) → shardlab checkpoint"
  q = sub.add_parser("from-hf", help=text, description=text)
  q.add_argument("hf_dir", help="a Hugging Face model directory (config.json + *.safetensors)")
  q.add_argument("out_dir", help="the checkpoint directory to write (train.py --init-from)")
  placement(q)
  q.add_argument("--precision", default="fp32",
                 help="fp32 | bf16 | bf16-params (bf16-params stores bf16 weights)")
  q.add_argument("--optimizer", default="adamw",
                 help="adamw | adafactor | sgd: the (fresh) optimizer state saved alongside")
  q.add_argument("--overwrite", action="store_true", help="replace what OUT_DIR holds")

  text = "newest checkpoint in CKPT_DIR → HF_DIR for transformers"
  q = sub.add_parser("to-hf", help=text, description=text)
  q.add_argument("ckpt_dir", help="a checkpoint directory (train.py --checkpoint-dir)")
  q.add_argument("hf_dir", help="the Hugging Face model directory to write")
  placement(q)
  q.add_argument("--dtype", default="auto",
                 help="auto (the stored param dtype) | float32 | bfloat16 | float16")
  q.add_argument("--max-shard-gb", type=Float(gt=0), default=4.0,
                 help="split the weights into files of at most this many GiB (default 4; "
                      "%(type)s)")
  q.add_argument("--tokenizer-from", metavar="HF_DIR",
                 help="copy tokenizer and generation files from this HF directory")
  q.add_argument("--overwrite", action="store_true",
                 help="replace a non-empty HF_DIR (the new export is written beside it and "
                      "renamed into place, so nothing of the old one is left)")
  q.add_argument("--strict", action="store_true",
                 help="refuse a damaged newest step instead of exporting the newest intact one")
  q.add_argument("--merge-lora", action="store_true",
                 help="for a checkpoint trained with LoRA: merge the adapters into the base "
                      "weights (W + alpha/rank·A·B) and export the merged model")
  q.add_argument("--peft", action="store_true",
                 help="for a checkpoint trained with LoRA: write only the adapters, as a PEFT "
                      "adapter (adapter_config.json + adapter_model.safetensors) for "
                      "peft.PeftModel.from_pretrained over the base model (default: off)")
  q.add_argument("--base-model", metavar="NAME_OR_DIR",
                 help="with --peft: the base_model_name_or_path adapter_config.json names "
                      "(default: the run's train.py --init-from hf:DIR as an absolute path, "
                      "else none)")

  text = "print the model TOML (for train.py --model) of an HF config"
  q = sub.add_parser("hf-config", help=text, description=text)
  q.add_argument("hf_dir", help="a Hugging Face model directory (its config.json)")
  return p


def _run(args) -> None:
  from shardlab.hf import config as hf_config
  from shardlab.hf import convert as hf_convert

  if args.command == "hf-config":
    print(hf_config.to_toml(hf_convert.hf_model_config(args.hf_dir)), end="")
    return
  if args.simulate_devices is not None:
    devices.simulate(args.simulate_devices)
  if args.command == "from-hf":
    cfg = hf_convert.import_checkpoint(args.hf_dir, args.out_dir, args.mesh, args.strategy,
                                       args.precision, args.optimizer, args.overwrite)
    toml = Path(args.out_dir) / hf_convert.MODEL_TOML
    print(f"wrote {cfg.model.name} ({cfg.model.n_params / 1e6:,.2f}M params) as a shardlab "
          f"checkpoint (step 0) to {args.out_dir}\nfine-tune it with: python train.py "
          f"--model {toml} --init-from {args.out_dir}")
    return
  if args.peft or args.base_model is not None:
    _run_peft(args)
    return
  files, copied = hf_convert.export_checkpoint(
      args.ckpt_dir, args.hf_dir, args.mesh, args.strategy, args.dtype,
      int(args.max_shard_gb * units.GiB), args.overwrite, args.tokenizer_from, args.strict,
      args.merge_lora)
  if args.tokenizer_from and not copied:
    print(f"warning: no tokenizer files in {args.tokenizer_from}", file=sys.stderr)
  print(f"wrote config.json and {len(files)} safetensors file(s) to {args.hf_dir}"
        + (f" (+ {', '.join(copied)})" if copied else ""))


def _run_peft(args) -> None:
  from shardlab.hf import peft_export

  if not args.peft:
    raise ConfigError("--base-model names the base of a PEFT adapter; pass --peft with it")
  if args.merge_lora:
    raise ConfigError("--peft and --merge-lora exclude each other: --peft writes the "
                      "adapters alone, --merge-lora the model with them merged in")
  config, copied = peft_export.export_adapter(
      args.ckpt_dir, args.hf_dir, args.mesh, args.strategy, args.dtype, args.overwrite,
      args.strict, args.base_model, args.tokenizer_from)
  if args.tokenizer_from and not copied:
    print(f"warning: no tokenizer files in {args.tokenizer_from}", file=sys.stderr)
  if not config["base_model_name_or_path"]:
    print("warning: adapter_config.json names no base model (the run did not start from "
          "--init-from hf:DIR); pass --base-model NAME_OR_DIR", file=sys.stderr)
  print(f"wrote a PEFT LoRA adapter (r {config['r']}, lora_alpha {config['lora_alpha']}, "
        f"target_modules {config['target_modules']}) to {args.hf_dir}"
        + (f" (+ {', '.join(copied)})" if copied else ""))


def convert_main(argv=None, prog: str = "shardlab convert") -> int:
  return run_command(_run, convert_parser(prog).parse_args(argv))
