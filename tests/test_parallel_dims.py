"""ParallelDims validation, the single-process path, batch sharding and the torchrun launcher."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from longfit.config import Config, ConfigError, load_config
from longfit.data.packing import PackedBatch
from longfit.launch import Launch, default_rendezvous_id, launch_torchrun, strip_launch_options, torchrun_command
from longfit.memory.loss import CausalLMLoss, batch_loss_sum
from longfit.models.loading import resolve_model_config
from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
from longfit.parallel.comm import (
    all_reduce_max,
    all_reduce_sum,
    barrier,
    group_rank,
    group_size,
)
from longfit.parallel.dims import ParallelDims
from longfit.parallel.parallelize import parallelize
from longfit.parallel.sharding import unshard_sequence


def test_dp_shard_is_derived_from_the_world_size():
    dims = ParallelDims(dp_shard=-1, cp=2, world_size=8)
    assert (dims.dp_shard, dims.cp, dims.fsdp_size, dims.dp_size) == (4, 2, 8, 4)
    assert ParallelDims.from_config(Config(), 1, num_attention_heads=4) == ParallelDims(1, 1, 1)


@pytest.mark.parametrize(
    "dp_shard,cp,world,expected",
    [
        (2, 2, 3, ["world size 3 != parallel.dp_shard (2) x parallel.cp (2) = 4", "--nproc-per-node 4", "parallel.cp in [1, 3]"]),
        (3, 2, 4, ["= 6", "--nproc-per-node 6", "parallel.dp_shard=2"]),
        (-1, 4, 6, ["parallel.cp=4 does not divide the world size 6", "--nproc-per-node 4", "[1, 2, 3, 6]"]),
        (0, 1, 1, ["parallel.dp_shard=0"]),
        (-1, 0, 1, ["parallel.cp=0: must be >= 1"]),
    ],
)
def test_world_size_mismatch_names_the_fix(dp_shard, cp, world, expected):
    with pytest.raises(ConfigError) as error:
        ParallelDims(dp_shard, cp, world)
    for text in expected:
        assert text in str(error.value)


def _dims(seq_len: int, cp: int, method: str, heads: int = 4) -> ParallelDims:
    cfg = Config(seq_len=seq_len)
    cfg.parallel.cp, cfg.parallel.cp_method = cp, method
    return ParallelDims.from_config(cfg, cp, num_attention_heads=heads)


def test_sequence_and_head_rules_name_the_fix():
    """llama-tiny's numbers: 4 attention heads (2 key/value heads, which Ulysses repeats as needed)."""
    with pytest.raises(ConfigError, match=r"seq_len=100 must be divisible by 2 x parallel.cp = 8 .*seq_len=96"):
        _dims(100, 4, "ring")
    with pytest.raises(ConfigError, match=r"seq_len=1001 must be divisible by 2 x parallel.cp = 8 .*seq_len=1000"):
        _dims(1001, 4, "ring")
    with pytest.raises(ConfigError, match=r"seq_len=102 must be divisible by parallel.cp = 4 .*seq_len=100"):
        _dims(102, 4, "ulysses")
    assert _dims(100, 4, "ulysses").sequence_granule == 4  # Ulysses needs cp, not 2 x cp
    with pytest.raises(ConfigError, match=r"splits the 4 attention heads over parallel.cp=8 .*\[2, 4\].*cp_method=ring"):
        _dims(64, 8, "ulysses")
    _dims(64, 8, "ring")
    with pytest.raises(ConfigError, match="cp_method='tree'"):
        ParallelDims(-1, 1, 1, cp_method="tree")


def _tp_dims(tp: int, cp: int = 1, world: int | None = None, method: str = "ring", seq_len: int = 64,
             heads: int = 4, kv_heads: int = 2, intermediate: int = 128, model_type: str = "llama", *overrides: str):
    """ParallelDims of llama-tiny's numbers (or these); the model's structure that of `model_type`'s default config
    shrunk (its experts, if any, among them)."""
    from transformers import AutoConfig

    cfg = load_config(None, [f"seq_len={seq_len}", f"parallel.tp={tp}", f"parallel.cp={cp}",
                             f"parallel.cp_method={method}", *overrides])
    text = AutoConfig.for_model(model_type, hidden_size=16 * heads, intermediate_size=intermediate, num_hidden_layers=2,
                                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, vocab_size=384)
    return ParallelDims.from_config(cfg, world or tp * cp, heads, num_key_value_heads=kv_heads,
                                    intermediate_size=intermediate, text_config=text)


def test_tensor_parallel_degrees_and_rules_name_the_fix():
    dims = ParallelDims(dp_shard=-1, cp=2, world_size=8, tp=2)
    assert (dims.dp_shard, dims.cp, dims.tp, dims.fsdp_size, dims.dp_size) == (2, 2, 2, 4, 2)
    assert ParallelDims(dp_shard=1, cp=1, world_size=2, tp=2).fsdp_enabled  # FSDP2 casts the DTensors
    with pytest.raises(ConfigError, match=r"!= parallel.dp_shard \(3\) x parallel.cp \(1\) x parallel.tp \(2\) = 6"):
        ParallelDims(dp_shard=3, cp=1, world_size=4, tp=2)
    with pytest.raises(ConfigError, match=r"parallel.cp x parallel.tp = 2 x 2 = 4 does not divide the world size 6"):
        ParallelDims(dp_shard=-1, cp=2, world_size=6, tp=2)
    # sequence: each cp rank's tokens split over tp; the ring's two chunks need no more with tp=2
    assert _tp_dims(2, 2).sequence_granule == 4 and _tp_dims(4, 1, method="ulysses").sequence_granule == 4
    with pytest.raises(ConfigError, match=r"seq_len=66 must be divisible by 8 .*parallel.tp=4.*seq_len=64"):
        _tp_dims(4, 2, 8, "ring", 66)
    # heads: tp divides the query heads, and the key/value heads or is a multiple of them (replicated)
    assert _tp_dims(4, kv_heads=2).tp == 4
    with pytest.raises(ConfigError, match=r"parallel.tp=8 splits the 4 attention heads .*\[2, 4\]"):
        _tp_dims(8, seq_len=64)
    with pytest.raises(ConfigError, match=r"must divide the 6 key/value heads .*\[2, 3, 6, 12\]"):
        _tp_dims(4, heads=12, kv_heads=6)
    with pytest.raises(ConfigError, match=r"each tp rank's 2 attention heads \(4 / parallel.tp=2\) over parallel.cp=4"):
        _tp_dims(2, 4, method="ulysses")
    _tp_dims(2, 2, method="ulysses")
    with pytest.raises(ConfigError, match=r"intermediate size 100"):
        _tp_dims(8, heads=8, kv_heads=8, intermediate=100)
    _tp_dims(2, model_type="gemma3_text")  # read from its structure: per-head q/k norms, four norms a layer
    _tp_dims(2, model_type="qwen3_moe")  # experts: each one's intermediate width split (parallel/tp.py)
    with pytest.raises(ConfigError, match=r"parallel.tp=2: layer 0's mlp: LoRA on a mixture of experts under tensor "
                                          r"parallelism is not implemented: set parallel.tp=1"):
        _tp_dims(2, 1, None, "ring", 64, 4, 2, 128, "qwen3_moe", "lora.enabled=true")
    with pytest.raises(ConfigError, match=r"lora.dropout=0.1 with parallel.tp=2"):
        _tp_dims(2, 1, None, "ring", 64, 4, 2, 128, "llama", "lora.enabled=true", "lora.dropout=0.1")
    with pytest.raises(ConfigError, match=r"QLoRA.*set parallel.tp=1"):
        _tp_dims(2, 1, None, "ring", 64, 4, 2, 128, "llama", "lora.enabled=true", "lora.quantize_base=true")
    with pytest.raises(ConfigError, match=r"lora.target_modules \['lm_head'\]"):
        _tp_dims(2, 1, None, "ring", 64, 4, 2, 128, "llama", "lora.enabled=true", "lora.target_modules=[q_proj,lm_head]")


def test_every_entry_point_refuses_a_bad_layout_before_building(tmp_path):
    """The trainer (before torchrun starts any rank) and the planner apply ParallelDims' rules."""
    from longfit.cli import main
    from longfit.plan import plan_config

    with pytest.raises(ConfigError, match="seq_len=66 must be divisible by 2 x parallel.cp = 4"):
        plan_config(load_config(None, ["seq_len=66", "parallel.cp=2"]), world_size=2)
    with pytest.raises(ConfigError, match="parallel.tp=8 splits the 4 attention heads"):
        plan_config(load_config(None, ["parallel.tp=8"]), world_size=8)
    cpu = "train.device=cpu"  # the layout's rules, not the GPUs this machine may lack
    assert main(["train", f"output_dir={tmp_path / 'run'}", cpu, "seq_len=66", "parallel.cp=2", "--nproc", "2"]) == 2
    assert main(["train", f"output_dir={tmp_path / 'run'}", cpu, "parallel.cp=2", "--nproc", "3"]) == 2
    assert not (tmp_path / "run").exists()


@pytest.fixture
def tiny_loss_module():
    import copy

    from transformers import AutoModelForCausalLM

    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    return CausalLMLoss(model)


def packed_batch(L: int = 32) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 384, (2, L), generator=g)
    labels = torch.roll(input_ids, -1, 1)
    labels[0, 11] = labels[:, -1] = -100
    labels[1, : L // 2] = -100
    position_ids = torch.cat([torch.arange(12), torch.arange(L - 12), torch.arange(L)]).view(2, L)
    cu_seqlens = torch.tensor([0, 12, L, 2 * L], dtype=torch.int32)
    return PackedBatch(input_ids, labels, position_ids, cu_seqlens, int((labels != -100).sum()))


def test_one_process_path_is_plain_training(tiny_loss_module):
    """World size 1: no groups, collectives are no-ops, and parallelize changes no number."""
    dims = ParallelDims(-1, 1, 1)
    mesh = dims.build_mesh("cpu")
    assert (mesh.mesh, mesh.fsdp_mesh, mesh.cp_group, mesh.dp_group, mesh.world_group) == (None,) * 5
    assert (group_size(None), group_rank(None)) == (1, 0)
    x = torch.tensor([3.0])
    assert all_reduce_sum(x, None) is x and all_reduce_max(x, None).item() == 3.0
    barrier(None)

    batch = packed_batch()
    import copy

    reference = copy.deepcopy(tiny_loss_module)
    expected = batch_loss_sum(reference, batch)
    expected.backward()
    cfg = Config(seq_len=32)
    cfg.memory.activation_checkpointing = True
    module = parallelize(tiny_loss_module, dims, cfg, mesh)
    shard = shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout("ring"))
    assert shard is batch
    assert global_valid_tokens(shard.labels, mesh.world_group).item() == batch.num_label_tokens
    loss = batch_loss_sum(module, shard)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_shard_batch_splits_tokens_and_keeps_cu_seqlens(method):
    batch, cp = packed_batch(), 4
    layout = cp_layout(method)
    assert layout == {"ring": "zigzag", "ulysses": "contiguous"}[method]
    shards = [shard_batch(batch, rank, cp, layout) for rank in range(cp)]
    for field in ("input_ids", "labels", "position_ids"):
        pieces = [getattr(s, field) for s in shards]
        assert all(p.shape == (2, 8) for p in pieces)
        torch.testing.assert_close(unshard_sequence(pieces, 1, layout), getattr(batch, field))
    assert all(s.cu_seqlens is batch.cu_seqlens for s in shards)
    assert [s.num_label_tokens for s in shards] == [int((s.labels != -100).sum()) for s in shards]
    assert sum(s.num_label_tokens for s in shards) == batch.num_label_tokens
    assert global_valid_tokens([s.labels for s in shards], None).item() == batch.num_label_tokens


def test_launch_options_are_stripped_from_the_worker_command():
    argv = ["train", "--nproc", "4", "--config", "a.yaml", "--nproc=4", "--max-restarts", "2", "seq_len=64", "--nnodes=1"]
    assert strip_launch_options(argv) == ["train", "--config", "a.yaml", "seq_len=64"]
    command = torchrun_command(Launch(nproc=4, max_restarts=2), argv, "unused")
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[3:10] == ["--standalone", "--nproc-per-node", "4", "--max-restarts", "2", "-m", "longfit"]
    assert command[10:] == ["train", "--config", "a.yaml", "seq_len=64"]


def test_several_nodes_meet_in_a_c10d_rendezvous_named_after_the_run():
    launch = Launch(nproc=2, nnodes=3, rdzv_endpoint="node001:29500")
    command = torchrun_command(launch, ["train", "--nnodes", "3", "seq_len=64"], default_rendezvous_id("runs/a"))
    rendezvous = command[3:command.index("--nproc-per-node")]
    assert rendezvous == ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node001:29500",
                          "--rdzv-id", default_rendezvous_id("runs/a")]
    assert launch.world_size == 6 and command[-2:] == ["train", "seq_len=64"]
    assert default_rendezvous_id("runs/a") == default_rendezvous_id(str(Path("runs/a").absolute()))
    assert default_rendezvous_id("runs/a") != default_rendezvous_id("runs/b")
    named = torchrun_command(Launch(nproc=1, nnodes=2, node_rank=1, rdzv_endpoint="h:1", rdzv_id="job7"), [], "x")
    assert named[named.index("--rdzv-id") + 1] == "job7" and named[named.index("--node-rank") + 1] == "1"


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001"], "--rdzv-endpoint node001: give HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:29500", "--node-rank", "2"], "--node-rank 2: give this node's index, 0 to 1"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["--nnodes", "0"], "--nnodes 0"),
])
def test_launch_options_are_checked_before_torchrun_starts(argv, message, capsys):
    from longfit.cli import main

    assert main(["train", *argv]) == 2
    assert f"longfit: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("nproc", ["0", "-1"])
def test_nproc_below_one_is_refused(nproc, capsys):
    from longfit.cli import main

    assert main(["train", "--nproc", nproc]) == 2
    assert f"longfit: error: --nproc {nproc}" in capsys.readouterr().err


WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    from longfit.launch import init_distributed, shutdown_distributed
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims

    rank, world, device = init_distributed("cpu")
    dims = ParallelDims(-1, 2, world)
    mesh = dims.build_mesh(device.type)
    result = dict(
        rank=rank, world=world, device=str(device), cp_rank=mesh.cp_rank, dp_rank=mesh.dp_rank,
        world_sum=all_reduce_sum(torch.tensor(rank + 1.0), mesh.world_group).item(),
        cp_sum=all_reduce_sum(torch.tensor(rank + 1.0), mesh.cp_group).item(),
        dp_sum=all_reduce_sum(torch.tensor(rank + 1.0), mesh.dp_group).item(),
        mesh=str(mesh.mesh), fsdp_mesh=str(mesh.fsdp_mesh),
    )
    open(f"{sys.argv[1]}/rank{rank}.json", "w").write(json.dumps(result))
    shutdown_distributed()
    """
)


@pytest.mark.timeout(180)
def test_init_distributed_and_mesh_under_torchrun(tmp_path):
    """4 real torchrun workers (dp_shard=2 x cp=2, gloo): groups are the mesh's rows and columns."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script), str(tmp_path)],
        check=True, timeout=170,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, result in enumerate(results):
        assert (result["rank"], result["world"], result["device"]) == (r, 4, "cpu")
        assert (result["dp_rank"], result["cp_rank"]) == divmod(r, 2)  # cp varies fastest
        assert result["world_sum"] == 1 + 2 + 3 + 4
        assert result["cp_sum"] == {0: 1 + 2, 1: 3 + 4}[r // 2]  # ranks {0, 1} and {2, 3}
        assert result["dp_sum"] == {0: 1 + 3, 1: 2 + 4}[r % 2]  # ranks {0, 2} and {1, 3}
        assert "dp_shard=2, cp=2" in result["mesh"] and "dp_shard_cp=4" in result["fsdp_mesh"]


@pytest.mark.timeout(120)
def test_launch_torchrun_runs_the_cli_on_every_worker(capfd, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # launch_torchrun sets it for its workers
    assert launch_torchrun(Launch(nproc=2), ["--nproc", "2", "--help"], "unused") == 0
    out, err = capfd.readouterr()
    assert out.count("usage: longfit") == 2 and "OMP_NUM_THREADS" not in err  # torchrun's banner: longfit sets it


@pytest.mark.timeout(240)
@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_cp_bench_writes_its_table(tmp_path):
    """One small degree (the full cp = 1, 2, 4 sweep is benchmarks/results/cp_cpu.md)."""
    from longfit.cli import main

    out = tmp_path / "cp.md"
    argv = ["--seq-len", "256", "--short-len", "64", "--cp", "2", "--steps", "1", "--budget-mb", "4096",
            "--output", str(out), "--set", "memory.tiled_mlp=false", "--device", "cpu"]
    assert main(["bench", "cp", *argv]) == 0
    text = out.read_text()
    assert "Command: `longfit bench cp --seq-len 256 --short-len 64 --cp 2" in text
    (row,) = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 2 | 1 |")]
    peak, activation, step, cpu, largest = (float(row[i]) for i in (2, 4, 6, 9, 11))
    assert peak > 0 and activation > 0 and step > 0 and cpu > 0 and largest > 256
    assert main(["bench", "cp", "--seq-len", "510", "--short-len", "128", "--cp", "2", "--device", "cpu"]) == 2  # 510 % (2 x cp) != 0
