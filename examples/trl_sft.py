"""TRL's SFTTrainer made a longfit run by one call (README: "Use it from TRL / Trainer").

    python examples/trl_sft.py --max-steps 3
    torchrun --nproc-per-node 2 examples/trl_sft.py parallel.cp=2 memory.tiled_mlp=true
    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 examples/trl_sft.py parallel.cp=2

Under torchrun every rank holds the whole model (Accelerate's DDP); under the FSDP2 config longfit shards it over
the ranks (docs/jobs/trl.md).
"""
import argparse

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from longfit.integrations.hf import apply_longfit
from longfit.models.source import local_model_dir


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("settings", nargs="*", help="longfit settings, e.g. parallel.cp=2")
    cli.add_argument("--model", help="a local model directory (default: SmolLM2-135M-Instruct, see README)")
    cli.add_argument("--max-steps", type=int, default=20)
    cli.add_argument("--max-length", type=int, default=4096)
    opts = cli.parse_args()

    path = opts.model or local_model_dir("smollm2-135m")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    texts = [f"Note {i}: the key {i * 7919 % 100000:05d} opens door {i}. " * (20 + i % 30) for i in range(64)]
    args = SFTConfig(output_dir="runs/trl_sft", max_length=opts.max_length, packing=True, per_device_train_batch_size=1,
                     max_steps=opts.max_steps, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                     use_cpu=not torch.cuda.is_available())
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": texts}))
    apply_longfit(trainer, *opts.settings)
    trainer.train()
    # The ranks leave together, their process groups torn down while Python still runs: a gloo group left to the
    # interpreter's exit can abort its rank after a finished run (torch's #190489).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":  # not needed by longfit (#55: a script without it trains too)
    main()
