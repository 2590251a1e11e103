"""One `longfit bench trl` measurement in a fresh process: `python -m longfit.bench.trl_worker SPEC RESULT`.

An SFTTrainer (TRL's defaults: padding-free packing, its gradient checkpointing, its fused chunked LM head) on
`steps` + 1 rows of one document of `length` random tokens each, with transformers' SDPA attention ("trl") or
after `apply_longfit(trainer, *sets)` (any other configuration). The first step allocates AdamW's state and is not
measured; the peak (bench.meter: RSS above the bytes in use after it) and the step times cover the others.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def measure(spec: dict) -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os
    from longfit.models.loading import load_model, load_tokenizer

    return_freed_memory_to_os()
    model = load_model(spec["model"], seed=0)
    if spec["config"] == "trl":
        model.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, model.config.vocab_size, (spec["length"],), generator=generator).tolist()
            for _ in range(spec["steps"] + 1)]
    meter = MemoryMeter(torch.device("cpu"))
    times: list[float] = []
    cpu_times: list[float] = []  # the process's CPU seconds: robust to other processes sharing the cores

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                meter.start()
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step > 1:
                times.append(time.perf_counter() - self.started)
                cpu_times.append(time.process_time() - self.cpu_started)

    with tempfile.TemporaryDirectory(prefix="longfit-bench-trl-") as tmp:
        args = SFTConfig(output_dir=tmp, max_length=spec["length"], packing=True, per_device_train_batch_size=1,
                         max_steps=spec["steps"] + 1, learning_rate=1e-5, logging_steps=1, save_strategy="no",
                         report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
                             processing_class=load_tokenizer(spec["model"]))
        if spec["config"] != "trl":
            from longfit.integrations.hf import apply_longfit

            apply_longfit(trainer, f"model={spec['model']}", *spec["sets"])
        trainer.add_callback(Measure())
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return dict(peak_bytes=meter.peak(), baseline_bytes=meter.base, step_s=times, step_cpu_s=cpu_times, losses=losses)


def main() -> None:
    spec_path, result_path = map(Path, sys.argv[1:3])
    result = measure(json.loads(spec_path.read_text()))
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
