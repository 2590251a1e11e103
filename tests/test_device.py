"""Which device the ranks run on (train.device, the commands' --device): one rule in longfit.launch."""

import pytest
import torch

from longfit.cli import main
from longfit.config import ConfigError, load_config
from longfit.launch import choose_device_type, init_distributed, visible_gpus


@pytest.mark.parametrize(
    "requested,ranks,gpus,expected",
    [
        ("auto", 1, 0, "cpu"),  # a CPU machine: the default run works as it always did
        ("auto", 4, 0, "cpu"),
        ("auto", 1, 1, "cuda"),
        ("auto", 8, 8, "cuda"),
        ("cuda", 2, 4, "cuda"),
        ("cpu", 2, 8, "cpu"),  # gloo ranks on a GPU machine
    ],
)
def test_the_device_each_rank_gets(requested, ranks, gpus, expected):
    assert choose_device_type(requested, ranks, gpus) == expected


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_too_few_gpus_for_the_ranks_names_both_ways_out(requested):
    with pytest.raises(ConfigError) as e:
        choose_device_type(requested, 2, 1)
    message = str(e.value)
    assert message.startswith(f"train.device={requested}: 2 processes on this node need one GPU each but 1 is visible")
    assert "--nproc 1" in message and "train.device=cpu" in message


def test_cuda_without_a_gpu_says_so_and_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--device=cuda: torch sees no CUDA GPU on this machine; use --device=cpu"):
        choose_device_type("cuda", 1, 0, "--device")


def test_the_config_key_takes_only_the_three_choices():
    assert load_config().train.device == "auto"
    with pytest.raises(ConfigError, match="train.device: 'gpu' is not one of 'auto', 'cpu', 'cuda'"):
        load_config(None, ["train.device=gpu"])


def test_one_process_on_the_cpu_joins_no_process_group():
    assert init_distributed("cpu") == (0, 1, torch.device("cpu"))
    assert not torch.distributed.is_initialized()


def test_the_train_command_checks_the_device_before_torchrun_starts(tmp_path, capsys):
    out = tmp_path / "run"
    ranks = visible_gpus() + 2  # more than this machine has, GPU or not, and more than one: torchrun's path
    argv = ["train", f"output_dir={out}", "train.device=cuda", f"parallel.cp={ranks}", "--nproc", str(ranks)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("longfit: error: train.device=cuda: ") and "train.device=cpu" in err
    assert "torch.distributed" not in err and not out.exists()


def test_bench_cp_applies_the_rule_to_its_largest_degree(capsys):
    ranks = visible_gpus() + 1
    argv = ["bench", "cp", "--device", "cuda", "--cp", f"1,{ranks}", "--seq-len", "256", "--short-len", "64"]
    assert main(argv) == 2
    assert "longfit: error: --device=cuda: " in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", [["eval", "--lengths", "64"], ["bench", "memory", "--lengths", "64"]])
def test_one_process_commands_refuse_cuda_without_a_gpu(command, tmp_path, capsys):
    assert main([*command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longfit: error: --device=cuda: torch sees no CUDA GPU") and "--device=cpu" in err


@pytest.mark.parametrize("cpu_offload, device, backend", [
    (False, "cuda", "nccl"),
    (True, "cuda", "cuda:nccl,cpu:gloo"),  # FSDP2's CPU-offloaded gradients: the clip all-reduces CPU tensors
    (False, "cpu", "gloo"),
    (True, "cpu", "gloo"),
])
def test_ranks_that_reduce_cpu_tensors_get_gloo_beside_nccl(monkeypatch, cpu_offload, device, backend):
    """Two torchrun ranks as `train` starts them (issue #33: with parallel.cpu_offload on GPUs the first clip
    failed, "No backend type associated with device type cpu"). The rendezvous and the group are recorded."""
    import torch.distributed as dist

    from longfit import launch

    created = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(launch, "choose_device_type", lambda requested, ranks, gpus: device)
    monkeypatch.setattr(dist, "rendezvous", lambda url: iter([(dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: created.append((backend, kwargs)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    cfg = load_config(None, [f"parallel.cpu_offload={str(cpu_offload).lower()}"])
    rank, world, got = init_distributed(device, cpu_collectives=cfg.parallel.cpu_offload)
    assert (rank, world, got.type) == (1, 2, device)
    assert [b for b, _ in created] == [backend]
    assert created[0][1].get("device_id") == (torch.device("cuda", 1) if device == "cuda" else None)
