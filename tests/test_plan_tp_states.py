"""The plan's model states of a tp rank against what the rank holds after `parallelize` on two gloo ranks (#54).

Every family tensor parallelism admits (tests/test_tp_families.py, tests/test_tp_families_more.py: Qwen3 and Gemma 3's
per-head norms, Gemma 3's and Gemma 4's one key/value head that every tp rank holds whole, Qwen3.5's Gated DeltaNet
whose fused in_proj_qkv and conv1d stay whole on every rank, Qwen3-Next's whose projections fused by key head are
split, Gemma 2, Granite, OLMo 1, Llama 4's dense text model)
and Llama through the preset families' formulas: a tiny model transformers wrote, planned at parallel.tp=2 (weights,
gradients and optimizer state of one rank, `analytic.model_states`) and built, split and given its optimizer state
by the trainer's own steps on two gloo ranks, whose parameters, gradients and AdamW moments are summed byte by byte.
Full fine-tuning and LoRA, in fp32 and under train.dtype=bf16 (LoRA's frozen base in bf16).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_families import SMALL  # noqa: E402
from test_tp_families import FAMILIES as TP_FAMILIES  # noqa: E402
from test_tp_families_more import FAMILIES as MORE_TP_FAMILIES  # noqa: E402

from longfit.config import load_config  # noqa: E402

FAMILIES = {"llama": dict(SMALL, model_type="llama"), **TP_FAMILIES, **MORE_TP_FAMILIES}
CASES = [(dtype, lora) for dtype in ("fp32", "bf16") for lora in (False, True)]


def run_config(model_dir: Path, dtype: str, lora: bool):
    return load_config(None, [f"model={model_dir}", "seq_len=64", "parallel.tp=2", f"train.dtype={dtype}",
                              f"lora.enabled={str(lora).lower()}"])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = {}
    for family, values in FAMILIES.items():
        values = dict(values)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        dirs[family] = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(config).save_pretrained(dirs[family])
    return dirs


def held_states(rank: int, world_size: int, cases: list[tuple[str, Path, str, bool]]) -> dict:
    """This rank's (weights, gradients, optimizer state) bytes of each case, as the trainer builds and splits the model
    (`parallelize`) and its optimizer makes the state (one step of zero gradients): every local tensor's bytes."""
    import torch
    from torch.distributed.tensor import DTensor

    from longfit.memory.loss import CausalLMLoss
    from longfit.memory.optim import build_optimizer
    from longfit.models.build import build_model
    from longfit.parallel.parallelize import parallelize
    from longfit.plan.setup import resolve

    def nbytes(tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    held = {}
    for family, model_dir, dtype, lora in cases:
        cfg = run_config(model_dir, dtype, lora)
        setup = resolve(cfg, world_size, "cuda")
        torch_dtype = torch.float32 if setup.regime == "fp32" else torch.bfloat16
        model = build_model(cfg, torch_dtype, "cpu", setup.fsdp)
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), setup.dims, cfg,
                                  setup.dims.build_mesh("cpu"), param_dtype=torch_dtype, device="cpu")
        params = list(loss_module.parameters())  # each tied parameter once
        trainable = [p for p in params if p.requires_grad]
        optimizer = build_optimizer(trainable, lr=1e-3, weight_decay=0.0, kind=setup.optimizer)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        held[family, dtype, lora] = (sum(nbytes(p) for p in params), sum(nbytes(p.grad) for p in trainable),
                                     sum(nbytes(t) for t in state))
    return held


# slow: one spawn of two gloo ranks building 36 tiny models, and a fake-process-group split of each planned (~40 s CPU)
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tp_rank_plans_the_states_it_holds(model_dirs) -> None:
    from parallel_harness import run_distributed

    from longfit.plan.analytic import model_states
    from longfit.plan.setup import resolve

    from longfit.config import ConfigError

    def refused(model_dir: Path, dtype: str, lora: bool) -> bool:
        """LoRA on experts under tp is refused in one line (parallel/tp.py), by the plan as by the run."""
        try:
            resolve(run_config(model_dir, dtype, lora), 2, "cuda")
        except ConfigError as error:
            assert "LoRA on a mixture of experts under tensor parallelism" in str(error), error
            return True
        return False

    cases = [(family, model_dir, dtype, lora) for family, model_dir in model_dirs.items() for dtype, lora in CASES
             if not refused(model_dir, dtype, lora)]
    assert {family for family, _, _, lora in cases if lora} == {family for family in FAMILIES
                                                                if "expert" not in str(FAMILIES[family])}
    ranks = run_distributed(held_states, 2, cases)
    for family, model_dir, dtype, lora in cases:
        held = [rank[family, dtype, lora] for rank in ranks]
        planned = model_states(resolve(run_config(model_dir, dtype, lora), 2, "cuda"))
        # rank 0 holds torch.chunk's larger slices, which the plan counts
        assert tuple(int(part) for part in planned) == max(held), (family, dtype, lora, planned, held)
