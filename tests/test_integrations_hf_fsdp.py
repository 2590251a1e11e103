"""apply_longfit under `accelerate launch` with an FSDP2 config (#55): longfit shards the Trainer's model.

Parity: the SFTTrainer script of tests/test_integrations_hf.py launched by `accelerate launch` with
examples/accelerate_fsdp2.yaml on gloo ranks (tests/accelerate_sft_worker.py) gives the losses of every step and every
gradient (gathered whole from FSDP2's shards) before every update of the same script on one process: FSDP2 over
cp=2 ranks, over dp_shard=2 ranks (the one process accumulating the two ranks' micro-batches), and cp=2 x dp_shard=2;
full fine-tuning and LoRA; fp32 element-wise, bf16 (FSDP2's mixed precision as Accelerate sets it) within
tests/test_bf16.py's bound. Refusals: DeepSpeed, FSDP1, Accelerate's activation checkpointing and the parallelism
axes longfit has no place for, each one line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from test_integrations_hf import assert_grads_close, sft_run  # noqa: E402

from longfit.config import ConfigError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FSDP2_CONFIG = os.path.join(HERE, "..", "examples", "accelerate_fsdp2.yaml")
WORKER = os.path.join(HERE, "accelerate_sft_worker.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_launch(tmp_path, processes: int, *worker_args: str) -> dict:
    """tests/accelerate_sft_worker.py under `accelerate launch` with the FSDP2 example config; rank 0's record."""
    out = tmp_path / "launched" / "out.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP2_CONFIG, "--num_processes",
         str(processes), "--main_process_port", str(free_port()), WORKER, str(out), *worker_args],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def check_fsdp2_parity(tmp_path, processes: int, settings: tuple[str, ...], steps: int = 2, lora: bool = False,
                       shards: int = 2) -> None:
    """`processes` FSDP2 ranks == one process (losses, every gradient before every update, fp32). Under dp_shard > 1
    the one process accumulates the dp_shard ranks' micro-batches in one step (the same rows, in the same order), of
    one packed row each: the 6 packed rows of the dataset then make whole steps (Accelerate evens out a last partial
    one by repeating rows, which one process does not)."""
    cp = next((int(s.split("=")[1]) for s in settings if s.startswith("parallel.cp=")), 1)
    dp_shard = processes // cp
    batch = 2 if dp_shard == 1 else 1
    launched = accelerate_launch(tmp_path, processes, "--steps", str(steps), "--batch", str(batch),
                                 *(["--lora"] if lora else []), *settings)
    assert (launched["launch"], launched["fsdp_size"], launched["cp"], launched["sharded"]) == ("fsdp2", processes, cp, True)
    options = {"lora": lora, "per_device_train_batch_size": batch, "gradient_accumulation_steps": dp_shard}
    losses, grads, _, _ = sft_run(0, 1, str(tmp_path / "one"), "llama-tiny", steps, (), options=options)
    assert launched["losses"] == pytest.approx(losses, rel=1e-5)
    assert_grads_close(launched["grads"], grads)


# slow (about 60 s each on 2 cores: an accelerate launch of two gloo ranks and one process)
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_fsdp2_cp2_matches_one_process(tmp_path, one_thread, lora):
    check_fsdp2_parity(tmp_path, 2, ("parallel.cp=2",), lora=lora)


@pytest.mark.slow
def test_sft_fsdp2_dp_shard2_matches_one_process_accumulating(tmp_path, one_thread):
    check_fsdp2_parity(tmp_path, 2, ())


@pytest.mark.slow
def test_sft_fsdp2_cp2_x_dp_shard2_matches_one_process_accumulating(tmp_path, one_thread):
    check_fsdp2_parity(tmp_path, 4, ("parallel.cp=2",))


# slow (about 100 s on 2 cores)
@pytest.mark.slow
def test_sft_fsdp2_cp2_bf16_within_the_bf16_bound(tmp_path, one_thread):
    """bf16=True under FSDP2: Accelerate's mixed precision (parameters gathered in bf16, gradients reduced in bf16,
    the root's outputs bf16), with no autocast. The first step's loss and every gradient against the fp32 truth (the
    same script on one process in fp32) within tests/test_bf16.py's rule, the reference being the script's bf16 on one
    process (DDP's regime: CPU autocast over fp32 weights); FSDP2's residual stream is bf16 too, so the references'
    ceiling is test_bf16_dist's 2^-3."""
    from test_bf16 import Step, assert_bf16_close, bf16_errors

    def first_step(losses, grads) -> Step:
        return Step(torch.tensor(losses[0]), {name: grad.float() for name, grad in grads[0].items()})

    launched = accelerate_launch(tmp_path, 2, "--steps", "1", "--bf16", "parallel.cp=2")
    assert launched["dtype"] == torch.bfloat16 and launched["sharded"]
    truth = sft_run(0, 1, str(tmp_path / "fp32"), "llama-tiny", 1, ())
    reference = sft_run(0, 1, str(tmp_path / "bf16"), "llama-tiny", 1, (), bf16=True)
    got, references, exact = first_step(launched["losses"], launched["grads"]), [first_step(*reference[:2])], first_step(*truth[:2])
    for tensor, (ref, err) in bf16_errors(got, references, exact).items():
        print(f"{tensor}: {err:.2e} (reference {ref:.2e})")
    # Accelerate's policy returns the root's outputs in bf16 (output_dtype): TRL's log-probabilities, whose mean is
    # the loss, come rounded to bf16 (a relative step of 2^-8)
    assert_bf16_close(got, references, exact, "FSDP2 cp=2 bf16", extra={"loss": 2.0**-8}, ceiling=2.0**-3)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from test_integrations_hf import sft_trainer

    return sft_trainer(str(tmp_path_factory.mktemp("launches")), "llama-tiny", 1)


@pytest.mark.parametrize("environment, fix", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "distributed_type: FSDP and fsdp_version: 2 instead"),  # ZeRO-3 or any
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "set fsdp_version: 2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
     "set it to false"),
])
def test_refused_launches(trainer, monkeypatch, environment, fix):
    """What `accelerate launch` sets from its config (on the CPU, where Accelerate keeps no FSDP plugin), each refused
    in one line before anything is built."""
    from longfit.integrations.hf import apply_longfit

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=fix) as refused:
        apply_longfit(trainer, "model=llama-tiny")
    assert "\n" not in str(refused.value)


def test_accelerate_parallelism_config_degrees():
    """Accelerate's ParallelismConfig under FSDP2: its dp_shard x cp ranks are longfit's (cp becomes parallel.cp); the
    axes longfit has no place for inside a Trainer are refused, naming the fix."""
    from accelerate import ParallelismConfig

    from longfit.integrations.hf import accelerate_degrees

    assert accelerate_degrees(None, 2) == {}
    assert accelerate_degrees(ParallelismConfig(dp_shard_size=2, cp_size=2), 4) == {"parallel.cp": "2"}
    assert accelerate_degrees(ParallelismConfig(dp_shard_size=4), 4) == {}
    for config, world, fix in [
        (ParallelismConfig(dp_shard_size=2, tp_size=2), 4, "set tp_size: 1"),
        (ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), 4, "set dp_shard_size instead"),
        (ParallelismConfig(cp_size=2), 4, "make their product the number of processes"),
    ]:
        with pytest.raises(ConfigError, match=fix):
            accelerate_degrees(config, world)


def test_parallelism_config_without_fsdp2_is_refused(trainer):
    from accelerate import ParallelismConfig

    from longfit.integrations.hf import apply_longfit

    state = trainer.accelerator.state
    before = state.parallelism_config
    state.parallelism_config = ParallelismConfig(cp_size=2)
    try:
        with pytest.raises(ConfigError, match="needs an FSDP2 launch"):
            apply_longfit(trainer, "model=llama-tiny")
    finally:
        state.parallelism_config = before
