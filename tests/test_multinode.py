"""Beyond one torchrun agent: several nodes (agents on 127.0.0.1 meeting in a c10d rendezvous), elastic restarts
after a worker is killed, and checkpoints resumed on another number of ranks. Every run is a real
`longfit train` process tree on gloo, compared with one process trained straight through."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from longfit.config import load_config
from longfit.plan.preflight import preflight, tightest_machine

pytestmark = pytest.mark.timeout(600)

GiB = 1 << 30


def common_args(model_dir, data, out, *extra) -> list[str]:
    return [
        f"model={model_dir}", f"data.path={data}", f"output_dir={out}", "seq_len=128", "train.device=cpu",
        "train.steps=6", "train.save_every=2", "train.warmup_steps=1", "train.lr=1e-2", "memory.tiled_mlp=false",
        "eval.retrieval=false", "train.export=false", *extra,
    ]


def start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "longfit", "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=500)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


def run(*argv: str) -> str:
    return finish(start(*argv))


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def data_line(stdout: str) -> str:
    """The end-of-run count of rows, documents and target tokens the run has packed since its step 0."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("data ") and "target tokens" in line]
    return line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, corpus, tmp_path_factory) -> tuple[dict[int, float], str]:
    """One process, two rows per step, six steps: its losses and its data line."""
    out = tmp_path_factory.mktemp("reference") / "run"
    stdout = run(*common_args(tiny_model_dir, corpus, out, "train.micro_batch=2"))
    return losses(out), data_line(stdout)


def assert_same_run(out: Path, stdout: str, reference) -> None:
    expected, expected_data = reference
    got = losses(out)
    assert sorted(got) == sorted(expected)
    assert [got[s] for s in sorted(got)] == pytest.approx([expected[s] for s in sorted(expected)], rel=1e-4)
    assert data_line(stdout) == expected_data  # no document packed twice or skipped


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_two_agents_with_cp_across_them_train_the_losses_of_one_process(tiny_model_dir, corpus, tmp_path, reference):
    """Two `longfit train --nnodes 2` agents, one rank each, meet at one endpoint; cp=2 spans them."""
    out = tmp_path / "two-nodes"
    argv = [*common_args(tiny_model_dir, corpus, out, "parallel.cp=2", "train.grad_accum=2"),
            "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    first, second = start(*argv), start(*argv)
    outputs = [finish(first), finish(second)]
    (stdout,) = [text for text in outputs if "done:" in text]  # rank 0's agent prints, the other stays quiet
    assert "layout  2 ranks: dp_shard 1 x cp 2" in stdout
    assert_same_run(out, stdout, reference)


def rank_of_first_attempt(root: psutil.Process, rank: str) -> psutil.Process | None:
    for process in root.children(recursive=True):
        try:
            env = process.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == rank and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return process
    return None


def kill_rank_after(process: subprocess.Popen, out: Path, step: int, rank: str = "1") -> None:
    """SIGKILL worker `rank` of torchrun's first attempt once metrics.jsonl has recorded `step`."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and step in losses_so_far(metrics):
            worker = rank_of_first_attempt(psutil.Process(process.pid), rank)
            assert worker is not None
            worker.send_signal(signal.SIGKILL)
            return
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach step {step}")


def losses_so_far(metrics: Path) -> set[int]:
    steps = set()
    for line in metrics.read_text().splitlines():
        try:
            steps.add(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return steps


@pytest.mark.parametrize("killed_rank,killed_after,resumed_from", [
    pytest.param("1", 3, "step_00000002", marks=pytest.mark.slow),  # 17 s
    pytest.param("0", 3, "step_00000002", marks=pytest.mark.slow),  # the lock's holder, its successor taking over (CI)
    pytest.param("1", 1, None, marks=pytest.mark.slow),  # before the first checkpoint: from step 0, said
])
def test_sigkilled_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(
        tiny_model_dir, corpus, tmp_path, reference, killed_rank, killed_after, resumed_from):
    out = tmp_path / "elastic"
    process = start(*common_args(tiny_model_dir, corpus, out, "parallel.cp=2", "train.grad_accum=2"),
                    "--nproc", "2", "--max-restarts", "1")
    kill_rank_after(process, out, killed_after, killed_rank)
    stdout = finish(process)
    assert "torchrun restarted the workers after one failed (restart 1 of 1)" in stdout
    if resumed_from:
        assert f"resuming from {out / 'checkpoints' / resumed_from}" in stdout
    else:
        assert "stopped before its first checkpoint: training again from step 0" in stdout
    if killed_rank == "0":
        assert "warning: took over the stale lock of a run that is no longer running" in stdout
    assert_same_run(out, stdout, reference)
    assert not (out / ".lock").exists()


def layout(ranks: int) -> list[str]:
    """Two rows per step on `ranks` ranks with cp=2: grad_accum makes up for the data-parallel degree."""
    return ["parallel.cp=2", f"train.grad_accum={4 // ranks}", "--nproc", str(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_checkpoint_resumes_on_another_number_of_ranks(tiny_model_dir, corpus, tmp_path, reference, before, after):
    """A run on `before` ranks, rewound to its step-2 checkpoint, resumes on `after` ranks: DCP reshards it, the
    data position carries over, and steps 3-6 are those of the run that never changed size."""
    out = tmp_path / "resharded"
    keep = "train.keep_checkpoints=3"
    assert_same_run(out, run(*common_args(tiny_model_dir, corpus, out, keep), *layout(before)), reference)
    for step in (4, 6):
        for path in (out / "checkpoints" / f"step_{step:08d}").iterdir():
            path.unlink()
        (out / "checkpoints" / f"step_{step:08d}").rmdir()

    kept_batch = [*common_args(tiny_model_dir, corpus, out, keep), "parallel.cp=2", "--nproc", str(after)]
    refused = subprocess.run([sys.executable, "-m", "longfit", "train", *kept_batch, f"train.grad_accum={4 // before}"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (f"trained on {before} ranks with a global batch of 2 rows of 128 tokens per step" in refused.stderr
            and f"keep it with train.grad_accum={4 // after}" in refused.stderr
            and "--allow-changes global_batch" in refused.stderr), refused.stderr

    stdout = run(*common_args(tiny_model_dir, corpus, out, keep), *layout(after))
    assert f"resuming from {out / 'checkpoints' / 'step_00000002'} (step 2)" in stdout
    assert f"changed ranks: {before} -> {after}" in stdout
    assert f"changed train.grad_accum: {4 // before} -> {4 // after}" in stdout
    assert_same_run(out, stdout, reference)


# ---- per-node accounting: the plan takes the tightest node's host memory and disk on every rank ---------------------
def _per_node(rank, world, cases, ranks_on_nodes, tmp):
    import os

    import torch

    chosen = [tightest_machine(*machines[rank]) for machines in cases]
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_on_nodes[rank])  # what torchrun tells the ranks of each node
    cfg = load_config(None, ["model=llama-tiny", "seq_len=256", "train.device=cpu", "memory.offload_activations=true",
                             f"memory.offload_dir={tmp}"])
    result = preflight(cfg, world, torch.device("cpu"))
    return chosen, (result.setup.ranks_on_node, result.host_share, result.disk_share)


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_every_rank_plans_with_the_node_that_gives_a_rank_the_least(tmp_path):
    """Three gloo ranks as two nodes, one of 1 rank and one of 2 (torchrun's --nproc-per-node 1 and 2)."""
    from parallel_harness import run_distributed

    # node A: rank 0 alone, 100 GiB host, 50 GiB disk; node B: ranks 1, 2, 120 GiB host, 40 GiB disk
    b_tightest = [(100 * GiB, 50 * GiB, 1), (120 * GiB, 40 * GiB, 2), (120 * GiB, 40 * GiB, 2)]
    # node A has 30 GiB for its one rank: the tightest for host memory; B still for the disk (20 GiB a rank)
    a_tightest = [(30 * GiB, 50 * GiB, 1), *b_tightest[1:]]
    results = run_distributed(_per_node, 3, [b_tightest, a_tightest], [1, 2, 2], str(tmp_path))
    assert [chosen for chosen, _ in results] == [[(120 * GiB, 40 * GiB, 2), (30 * GiB, 20 * GiB, 1)]] * 3
    # preflight on this one machine: the node of two ranks is the tightest, and every rank plans with its share
    # (half the machine), not its own node's
    plans = [plan for _, plan in results]
    assert plans[0][0] == 2 and plans == [plans[0]] * 3


# ---- the rule for what may change with the ranks, and the multi-node examples -------------------------------------
def test_layout_may_change_with_the_ranks_when_the_global_batch_stays():
    from longfit.config import ConfigError
    from longfit.train.resume import check_resume_changes

    saved = load_config(None, ["parallel.cp=2"])  # written on 4 ranks: dp 2, one row each per step
    more_rows = load_config(None, ["parallel.cp=1", "train.grad_accum=4"])  # on 1 rank: 4 rows per step
    changes = check_resume_changes(saved.to_yaml(), load_config(None, ["parallel.cp=2", "train.grad_accum=2"]),
                                   frozenset(), "step_00000002", saved_world=4, world=2)
    assert [str(c) for c in changes] == ["train.grad_accum: 1 -> 2", "ranks: 4 -> 2"]
    with pytest.raises(ConfigError, match="global batch of 2 rows .* this config makes it 4 .*: keep it with "
                                          "train.grad_accum=2, or change it from here on with --allow-changes global_batch"):
        check_resume_changes(saved.to_yaml(), more_rows, frozenset(), "step_00000002", saved_world=4, world=1)
    allowed = check_resume_changes(saved.to_yaml(), more_rows, frozenset({"global_batch"}), "step_00000002", 4, 1)
    assert "ranks: 4 -> 1" in map(str, allowed)
    with pytest.raises(ConfigError, match=r"--allow-changes train.lr"):  # what is trained still needs saying
        check_resume_changes(saved.to_yaml(), load_config(None, ["parallel.cp=2", "train.lr=1e-3"]), frozenset(),
                             "step_00000002", saved_world=4, world=4)


EXAMPLES = Path(__file__).parents[1] / "examples" / "multinode"


@pytest.mark.slow  # 42 s of an 8B's layer traces on a cold cache (the suite's 15 minutes); .ci/run runs it
def test_multinode_example_fits_its_sixteen_gpus(capsys):
    from longfit.cli import main

    assert main(["plan", str(EXAMPLES / "llama8b_1m_cp16.yaml"), "--gpu", "h100-80gb", "--host-mem", "2TiB", "--json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    assert (plan["gpus"], plan["cp"], plan["seq_len"], plan["fits"]) == (16, 16, 1048576, True)


def longfit_command(text: str) -> list[str]:
    """The words after `longfit` in a script's `longfit train` command (with its continuation lines)."""
    import shlex

    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "longfit train" in line and not line.lstrip().startswith("#"))
    command = []
    for line in lines[first:]:
        command.append(line.strip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(" ".join(command))
    return words[words.index("longfit") + 1:]


@pytest.mark.parametrize("script", ["slurm.sbatch", "two_nodes.sh"])
def test_multinode_scripts_start_sixteen_ranks_on_two_nodes(script, monkeypatch):
    import os

    from longfit.cli import build_parser, parse
    from longfit.launch import Launch

    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)
    for name, value in {"SLURM_NNODES": "2", "head_node": "node001", "SLURM_JOB_ID": "42"}.items():
        monkeypatch.setenv(name, value)
    argv = [os.path.expandvars(word) for word in longfit_command((EXAMPLES / script).read_text())]
    args = parse(build_parser(), argv)
    launch = Launch(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.max_restarts)
    assert (launch.world_size, launch.nnodes, launch.max_restarts) == (16, 2, 3)
    assert args.items == ["examples/multinode/llama8b_1m_cp16.yaml"] and args.rdzv_endpoint == "node001:29500"


def _lose_a_peer(rank, store_path, result_path):
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from longfit.train.command import lost_a_peer

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone without a word, as after a SIGKILL
    time.sleep(1)
    try:
        dist.all_reduce(torch.ones(1 << 16))
        found = "no error"
    except RuntimeError as error:
        found = f"{lost_a_peer(error)} {str(error).splitlines()[0]}"
    Path(result_path).write_text(found)
    os._exit(0)


def test_a_collective_whose_peer_died_is_told_apart_from_a_bug(tmp_path):
    import torch.multiprocessing as mp

    processes = [mp.get_context("spawn").Process(target=_lose_a_peer, args=(r, str(tmp_path / "store"), str(tmp_path / "found")))
                 for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert (tmp_path / "found").read_text().startswith("True ")
    from longfit.train.command import lost_a_peer

    assert not lost_a_peer(RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"))


@pytest.mark.slow
def test_bf16_checkpoint_of_four_ranks_resumes_on_two(tiny_model_dir, corpus, tmp_path):
    """The same under train.dtype=bf16 (FSDP2 gathers bf16 weights): the resumed steps 3-6 on 2 ranks are those of
    the 4-rank run within bf16's reduction-order noise, and the data counts are exact."""
    out = tmp_path / "bf16"
    args = common_args(tiny_model_dir, corpus, out, "train.keep_checkpoints=3", "train.dtype=bf16")
    uninterrupted = run(*args, *layout(4))
    expected = losses(out)
    for step in (4, 6):
        for path in (out / "checkpoints" / f"step_{step:08d}").iterdir():
            path.unlink()
        (out / "checkpoints" / f"step_{step:08d}").rmdir()
    stdout = run(*args, *layout(2))
    assert "changed ranks: 4 -> 2" in stdout
    got = losses(out)
    assert sorted(got) == sorted(expected)
    assert [got[s] for s in (3, 4, 5, 6)] == pytest.approx([expected[s] for s in (3, 4, 5, 6)], rel=2e-2)
    assert data_line(stdout) == data_line(uninterrupted)
