"""One rank of an SFTTrainer run with apply_longfit under `accelerate launch` (tests/test_integrations_hf_fsdp.py).

    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 tests/accelerate_sft_worker.py \
        OUT.pt --model llama-tiny --steps 2 [--bf16] [--lora] [--accumulation 2] [--batch 1] [--documents JSONL] \
        parallel.cp=2 [--then --model ... ]

Each `--then` starts another run in the same launch, one after the other (the launch's interpreters, imports and
process group are paid once for several comparisons). A run is test_integrations_hf.sft_trainer's (packed
padding-free rows of the same documents, the same seeds; --documents: a JSONL's texts tokenized as `longfit train`
reads them).
Before every optimizer step each rank gathers every gradient whole (FSDP2's DTensor shards: full_tensor()); rank 0
writes a record per run to OUT.pt (a list): the losses, those gradients, the launch mode apply_longfit saw, whether
the model and every gradient were FSDP2's (an FSDPModule, DTensor gradients) and the dtype a projection computed in.
With --save-steps, --kill-after and --resume (a shared --output-dir) it saves through the Trainer, exits at once
after a save, resumes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_options(argv: list[str]) -> argparse.Namespace:
    cli = argparse.ArgumentParser()
    cli.add_argument("--model", default="llama-tiny")
    cli.add_argument("--steps", type=int, default=2)
    cli.add_argument("--bf16", action="store_true")
    cli.add_argument("--lora", action="store_true")
    cli.add_argument("--accumulation", type=int, default=1)
    cli.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    cli.add_argument("--documents", help="a JSONL of texts to train on, read as `longfit train` reads them")
    cli.add_argument("--router-aux-loss-coef", type=float, help="SFTConfig's (default: the config's; 0.0 off)")
    cli.add_argument("--output-dir", help="the Trainer's, shared by the ranks (default: one a rank and run, by OUT)")
    cli.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps")
    cli.add_argument("--kill-after", type=int, default=0, help="every rank exits at once after the save at step N")
    cli.add_argument("--resume", action="store_true", help="resume from the output directory's last checkpoint")
    cli.add_argument("settings", nargs="*")
    return cli.parse_intermixed_args(argv)


def runs_of(argv: list[str]) -> list[argparse.Namespace]:
    """The runs of the command line after OUT: their options, separated by `--then`."""
    runs, current = [], []
    for arg in argv + ["--then"]:
        if arg == "--then":
            runs.append(run_options(current))
            current = []
        else:
            current.append(arg)
    return runs


def train(opts: argparse.Namespace, output_dir: str) -> dict:
    """One run on this rank: its record (module docstring)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    from longfit.integrations.hf import apply_longfit, launch_mode
    from longfit.models.structure import decoder_layers
    from test_integrations_hf import document_rows, sft_trainer

    saving = {"save_strategy": "steps", "save_steps": opts.save_steps} if opts.save_steps else {}
    if opts.router_aux_loss_coef is not None:
        saving["router_aux_loss_coef"] = opts.router_aux_loss_coef
    trainer = sft_trainer(opts.output_dir or output_dir, opts.model, opts.steps, opts.bf16, lora=opts.lora,
                          gradient_accumulation_steps=opts.accumulation, per_device_train_batch_size=opts.batch,
                          rows=document_rows(opts.documents) if opts.documents else None, **saving)
    run = apply_longfit(trainer, f"model={opts.model}", *opts.settings)
    dtypes: list = []  # of a projection's output: bf16 where FSDP2's mixed precision gathers bf16 weights
    decoder_layers(trainer.model)[0].self_attn.o_proj.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    grads: list[dict] = []
    sharded: list[bool] = []

    class GatherGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            step = {}
            sharded.append(isinstance(model, FSDPModule))
            for name, param in model.named_parameters():  # the same order on every rank: full_tensor is collective
                if param.grad is not None:
                    grad = param.grad
                    sharded.append(isinstance(grad, DTensor))
                    step[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
            grads.append(step)

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == opts.kill_after:
                torch.distributed.barrier()  # every rank's shards written
                os._exit(0)

    trainer.add_callback(GatherGrads())
    if opts.kill_after:
        trainer.add_callback(Kill())
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "grads": grads, "launch": launch_mode(trainer), "fsdp_size": run.dims.fsdp_size,
            "cp": run.dims.cp, "sharded": all(sharded), "dtype": dtypes[0]}


def main() -> None:
    import torch

    from longfit.launch import shutdown_distributed

    out, *argv = sys.argv[1:]
    rank = int(os.environ["RANK"])
    records = [train(opts, os.path.join(os.path.dirname(out), f"rank{rank}-run{index}"))
               for index, opts in enumerate(runs_of(argv))]
    if rank == 0:
        torch.save(records, out)
    # Every rank done, then the groups torn down while Python still runs: a gloo group left to the interpreter's exit
    # can abort its rank ("terminate called without an active exception", torch's #65513 and #190489).
    shutdown_distributed()


if __name__ == "__main__":
    main()
