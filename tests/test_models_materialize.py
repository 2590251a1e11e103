"""Models built on the meta device receive their values where they train, each rank only its own part.

- A preset's seeded initialisation gives bit-identical weights and buffers on every rank of 3 FSDP2
  ranks (uneven shards, a padding row, LoRA adapters with an empty shard), equal to one process's, in
  every run; another seed gives other weights.
- A local checkpoint read slice by slice equals `from_pretrained` exactly, parameters and buffers, for
  tied embeddings, multi-file and bf16 checkpoints and Gemma-3, in one process and on 2 ranks.
- LoRA adapters start as peft starts them (B zero, A kaiming-uniform), on the full fine-tuning base.
- Tensor-parallel layouts (2-D meshes, FSDP2 over tensor-parallel shards) fill and read their own boxes.
- Checkpoints that cannot be read slice by slice, or lack weights, are refused.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.config import ConfigError, load_config
from longfit.memory.loss import CausalLMLoss
from longfit.models import init
from longfit.models.build import build_model
from longfit.models.loading import (
    load_model,
    materialize_model,
    meta_model,
    resolve_model_config,
)
from longfit.models.structure import unwrap_peft
from longfit.parallel.dims import ParallelDims
from longfit.parallel.fsdp import apply_fsdp
from longfit.parallel.parallelize import parallelize

SMALL_BLOCK = 4096  # elements per generator here: each tiny weight spans several blocks, and shards cut blocks
LORA = ["lora.enabled=true", "lora.r=4", "train.dtype=bf16"]


def gemma3_config(tied: bool = True):
    from transformers import AutoConfig

    from longfit.models.attention import register_attention

    config = AutoConfig.for_model(
        "gemma3_text", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=24, vocab_size=301, sliding_window=8, pad_token_id=7,
        tie_word_embeddings=tied, max_position_embeddings=256,
    )
    config._attn_implementation = register_attention()
    return config


def full_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered whole (a collective under FSDP2)."""
    values = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        values[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
    return values


def trainer_model(overrides: list[str], world: int) -> torch.nn.Module:
    """The trainer's path: build_model on the meta device, then parallelize (FSDP2 over `world` ranks)."""
    cfg = load_config(None, overrides)
    dims = ParallelDims.from_config(cfg, world, 4)
    dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
    model = build_model(cfg, dtype, "cpu", dims.fsdp_enabled)
    parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, dims.build_mesh("cpu"), param_dtype=dtype, device="cpu")
    return model


def gemma3_initialised(world: int, seed: int = 0) -> torch.nn.Module:
    """A tied Gemma-3 built on meta, sharded by FSDP2 over `world` ranks (none for one), initialised."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma3_config(), dtype=torch.float32)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp(CausalLMLoss(model), init_device_mesh("cpu", (world,)))
    materialize_model(model, "cpu", seed)
    return model


def preset_cases(world: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "llama-tiny": full_values(trainer_model(["model=llama-tiny", f"train.seed={seed}"], world)),
        "llama-tiny lora": full_values(trainer_model(["model=llama-tiny", f"train.seed={seed}", *LORA], world)),
        "gemma3 tied": full_values(gemma3_initialised(world, seed)),
    }


def preset_worker(rank: int, world: int) -> dict:
    init.BLOCK = SMALL_BLOCK
    return preset_cases(world)


def assert_equal_values(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, f"{where}: {name}"
        assert torch.equal(actual[name], expected[name]), f"{where}: {name}"


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_preset_weights_are_the_same_on_every_rank_in_every_run(monkeypatch):
    monkeypatch.setattr(init, "BLOCK", SMALL_BLOCK)
    one_process = preset_cases(1)
    for case, values in preset_cases(1).items():
        assert_equal_values(values, one_process[case], f"second run, {case}")
    for rank, cases in enumerate(run_distributed(preset_worker, 3)):
        for case, values in cases.items():
            assert_equal_values(values, one_process[case], f"rank {rank} of 3, {case}")

    other_seed = preset_cases(1, seed=1)
    for case, values in one_process.items():
        drawn = [n for n, v in values.items() if n.endswith("weight") and v.float().std() > 0 and "lora_B" not in n]
        assert drawn and all(not torch.equal(values[n], other_seed[case][n]) for n in drawn), case
    llama = one_process["llama-tiny"]
    pad = resolve_model_config("llama-tiny").pad_token_id
    assert not llama["model.embed_tokens.weight"][pad].any() and llama["model.embed_tokens.weight"][pad + 1].all()
    assert all(torch.equal(v, torch.ones_like(v)) for n, v in llama.items() if n.endswith("norm.weight"))
    gemma = one_process["gemma3 tied"]
    assert "lm_head.weight" not in gemma  # tied: one tensor, listed once
    assert all(not v.any() for n, v in gemma.items() if n.endswith("norm.weight"))  # Gemma's norms are 1 + w
    torch.testing.assert_close(gemma["model.embed_tokens.embed_scale"], torch.tensor(48**0.5))


def test_lora_starts_as_peft_starts_it_on_the_full_fine_tuning_base(monkeypatch):
    monkeypatch.setattr(init, "BLOCK", SMALL_BLOCK)
    lora = trainer_model(["model=llama-tiny", *LORA], 1)
    full = dict(trainer_model(["model=llama-tiny"], 1).named_parameters())
    adapters = {n: p for n, p in lora.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 7 * 4  # A and B of the seven projections (the default targets) in 4 layers
    for name, param in adapters.items():
        assert param.dtype == torch.float32 and param.requires_grad
        if "lora_B" in name:
            assert not param.any(), name
        else:  # kaiming_uniform_(a=sqrt(5)): uniform within 1/sqrt(fan_in)
            bound = 1 / math.sqrt(param.shape[1])
            assert param.abs().max() <= bound and param.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name
    for name, param in unwrap_peft(lora).named_parameters():
        if "lora_" not in name:  # the frozen base: the full fine-tuning weights of the same seed, in bf16
            assert param.dtype == torch.bfloat16
            assert torch.equal(param, full[init.canonical_name(name)].to(torch.bfloat16)), name


def save_checkpoint(directory: Path, config, dtype: torch.dtype, shard_size: str | None = None) -> Path:
    """A checkpoint whose every value is random (non-zero padding row, norms other than one)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    llama = resolve_model_config("llama-tiny")
    llama.update(dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2))
    tied = resolve_model_config("llama-tiny")
    tied.update(dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True,
                     rope_parameters={**tied.rope_parameters, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    return {
        "llama fp32": save_checkpoint(root / "llama", llama, torch.float32),
        "llama tied bf16 multi-file": save_checkpoint(root / "tied", tied, torch.bfloat16, shard_size="100KB"),
        "gemma3 tied multi-file": save_checkpoint(root / "gemma3", gemma3_config(), torch.float32, shard_size="100KB"),
    }


def reference(directory: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return full_values(AutoModelForCausalLM.from_pretrained(directory, dtype=dtype))


def checkpoint_worker(rank: int, world: int, directories: dict[str, Path]) -> dict:
    results = {case: full_values(trainer_model([f"model={d}"], world)) for case, d in directories.items()}
    lora = trainer_model([f"model={directories['llama tied bf16 multi-file']}", *LORA], world)
    results["lora"] = full_values(lora)
    return results


@pytest.mark.slow  # 11 s, for the default suite's 15 minutes; .ci/run runs it
def test_checkpoint_read_by_slices_equals_from_pretrained(checkpoints):
    assert len(list(checkpoints["llama tied bf16 multi-file"].glob("*.safetensors"))) > 3
    expected = {case: reference(directory) for case, directory in checkpoints.items()}
    for case, directory in checkpoints.items():
        model = load_model(str(directory))
        assert model.get_input_embeddings().weight.any(dim=1).all()  # the padding row was read, not zeroed
        if "tied" in case:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert_equal_values(full_values(model), expected[case], f"one process, {case}")
    for rank, results in enumerate(run_distributed(checkpoint_worker, 2, checkpoints)):
        for case in checkpoints:
            assert_equal_values(results[case], expected[case], f"rank {rank} of 2, {case}")
        base = reference(checkpoints["llama tied bf16 multi-file"], torch.bfloat16)
        lora = {init.canonical_name(n.removeprefix("base_model.model.")): v for n, v in results["lora"].items()}
        assert all(torch.equal(lora[n], v) for n, v in base.items()), f"rank {rank}: LoRA base"
        assert all(not v.any() for n, v in lora.items() if "lora_B" in n)


def test_unreadable_or_incomplete_checkpoints_are_refused(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    incomplete = tmp_path / "incomplete"
    shutil.copytree(checkpoints["llama fp32"], incomplete)
    weights = load_file(incomplete / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, incomplete / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="no weights for lm_head.weight"):
        load_model(str(incomplete))

    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    save_file(weights, incomplete / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.norm.weight.*config.json does not describe"):
        load_model(str(incomplete))

    (incomplete / "model.safetensors").rename(incomplete / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="Convert a pytorch_model"):
        load_model(str(incomplete))

    # A conversion that is not a rearrangement of slices (Interleave reshapes its input) is refused in one line.
    from transformers.core_model_loading import Interleave

    moe = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                               num_experts=2)
    AutoModelForCausalLM.from_config(moe).save_pretrained(tmp_path / "moe")
    import transformers.conversion_mapping as mapping

    original = mapping.get_model_conversion_mapping

    def interleaved(model, *args, **kwargs):
        transforms = original(model, *args, **kwargs)
        for transform in transforms:
            if hasattr(transform, "operations"):
                transform.operations.append(Interleave(dim=0))
        return transforms

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mapping, "get_model_conversion_mapping", interleaved)
        with pytest.raises(ConfigError, match=r"converted by transformers while loading with reshape .*Interleave"):
            materialize_model(meta_model(str(tmp_path / "moe")), "cpu", checkpoint=tmp_path / "moe")


class Stack(torch.nn.Module):
    """An embedding and two projections: column-wise, row-wise and embedding tensor parallelism (sizes that
    FSDP2 over tensor-parallel shards takes on torch 2.6, which needs even shards there)."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = torch.nn.Embedding(36, 10), torch.nn.Linear(10, 24), torch.nn.Linear(24, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(self.embed(ids)))


def two_dimensional_worker(rank: int, world: int, path: str) -> dict:
    """Tensor parallelism on the 'tp' axis of a (2, 2) mesh, FSDP2 on 'dp': every placement combination."""
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from longfit.models.weights import Stored, read_local_slices
    from longfit.parallel.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Stack()
    parallelize_module(model, mesh["tp"], {"embed": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    init.BLOCK = 40  # blocks of 4 rows: the 18- and 6-row shards cut through blocks
    for name, param in model.named_parameters():
        init.fill_by_blocks(param, name, 0, lambda block, g: block.normal_(generator=g))
    drawn = full_values(model)
    with safe_open(path, framework="pt") as f:
        read_local_slices(model, {name: Stored.leaf(Path(path), name, f.get_slice(name).get_shape()) for name in f.keys()})
    return {"placements": placements, "drawn": drawn, "read": full_values(model)}


def test_two_dimensional_shards_fill_and_read_their_own_box(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    stored = {n: torch.randn(p.shape) for n, p in Stack().named_parameters()}
    save_file(stored, tmp_path / "weights.safetensors")
    monkeypatch.setattr(init, "BLOCK", 40)
    whole = {}
    for name, tensor in stored.items():
        whole[name] = torch.empty_like(tensor)
        init.fill_by_blocks(whole[name], name, 0, lambda block, g: block.normal_(generator=g))
    results = run_distributed(two_dimensional_worker, 4, str(tmp_path / "weights.safetensors"))
    placements = results[0]["placements"]
    assert "_StridedShard" in placements["up.weight"] and "Shard(dim=1)" in placements["down.weight"]
    for rank, result in enumerate(results):
        assert_equal_values(result["drawn"], whole, f"rank {rank}: drawn")
        assert_equal_values(result["read"], stored, f"rank {rank}: read")
