"""Save random weights of Qwen3-30B-A3B's shape, with fewer decoder layers, as a checkpoint folder both our engine
and transformers load (one tensor per expert, as the published checkpoint stores them), with the default model's
tokenizer. Each layer has the real model's attention, router and 128 experts of width 768; a token runs 8 of
them. The full 48 layers in bf16 are 61 GB, past these machines' memory; 8 layers are 11 GB.

    .venv/bin/python benchmarks/random_moe_checkpoint.py /tmp/qwen3-moe-8l --layers 8
    qwenbatch bench throughput --model /tmp/qwen3-moe-8l --workload random --num-prompts 16 --input-len 256 \\
        --output-len 64 --dtype bfloat16 --baseline transformers --repeats 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import copy_default_tokenizer  # benchmarks/ is on sys.path when this script runs
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from qwenbatch.loader.dummy import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if (args.folder / "config.json").is_file():
        print(f"{args.folder} already holds a checkpoint")
        return
    shape = {k: v for k, v in SHAPES["qwen3-30b-a3b"].items() if k != "architectures"}
    shape["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(str(args.folder), max_shard_size="2GB")
    copy_default_tokenizer(args.folder)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters to {args.folder}")


if __name__ == "__main__":
    main()
