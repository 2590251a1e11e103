"""LoRA on the vision side of an image-text wrapper (#54): `train.vision=projector` or `all` with lora.enabled.

The tiny Qwen3.5 wrapper and the image rows of tests/test_media.py (its session fixtures). longfit adapts the
language model as ever (peft on its causal LM, `lora.target_modules`) and, with `longfit.models.media.trainable_parts`,
every linear layer of the projector (and with `all` of the tower) of its vision module. The reference is peft on
transformers' own wrapper (`get_peft_model`, the same modules named by their wrapper paths), its eager forward on each
conversation alone (`longfit.check.media.wrapper_step`); every adapter of both holds the same random values (B not
zero, so every adapter gradient is tested). The loss and every adapter gradient are equal in fp32 and within the bf16
bound, for one conversation and packed ones, and under cp=2 ring on gloo (slow). The export writes an adapter that
peft loads onto the wrapper from transformers and that runs as trained.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import ROW_CASES, ROWS, batches, cp_share_step, image_batch, qwen_images, write_rows  # noqa: E402,F401
from test_media_gemma3 import ROWS as GEMMA3_ROWS, gemma3_batches, gemma3_images  # noqa: E402,F401 -- the fixtures
from test_media_gemma4 import ROWS as GEMMA4_ROWS, gemma4_batches, gemma4_images  # noqa: E402,F401
from test_media_llama4 import ROWS as LLAMA4_ROWS, llama4_batches, llama4_images  # noqa: E402,F401
from test_media_mistral3 import ROWS as MISTRAL3_ROWS, mistral3_batches, mistral3_images  # noqa: E402,F401

from longfit.check import parity  # noqa: E402
from longfit.config import ConfigError, load_config  # noqa: E402

LORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8"]


def lora_run(vision: str, *more: str):
    return load_config(None, [*LORA, f"train.vision={vision}", *more])


def longfit_lora(checkpoint: Path, vision: str, seed: int = 0):
    """longfit's objective with LoRA on the language model and `vision` of the vision side, every adapter drawn
    from `seed` (std 0.1)."""
    from peft import get_peft_model

    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import lora_config
    from longfit.models.loading import load_model
    from longfit.models.media import build_media_encoder, trainable_parts

    cfg = lora_run(vision)
    encoder = build_media_encoder(str(checkpoint))
    trainable_parts(encoder, vision, cfg.lora)
    loss_module = CausalLMLoss(get_peft_model(load_model(str(checkpoint)), lora_config(cfg)), media_encoder=encoder)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(loss_module.named_parameters()):
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return loss_module


def wrapper_names(checkpoint: Path, loss_module) -> dict[str, str]:
    """longfit's adapter parameters (the loss module's names) -> the peft-wrapped wrapper's."""
    from longfit.models.loading import load_model
    from longfit.models.media import vision_adapter_modules
    from longfit.models.model_config import read_config
    from longfit.models.weights import source_names

    read = read_config(str(checkpoint))
    with torch.device("meta"):
        wrapper = read.model_class()._from_config(read.config)
    plain = load_model(str(checkpoint), device="meta")
    modules = {name.rsplit(".", 1)[0]: key.rsplit(".", 1)[0]
               for key, (name, converter) in source_names(plain, wrapper.state_dict()).items() if converter is None}
    modules = {f"model.base_model.model.{m}": w for m, w in modules.items()}
    modules |= {f"media_encoder.vision.{m}": w for m, w in vision_adapter_modules(loss_module.media_encoder).items()}
    names = {}
    for name, param in loss_module.named_parameters():
        if param.requires_grad:
            module, adapter = name.split(".lora_", 1)
            names[name] = f"base_model.model.{modules[module]}.lora_{adapter}"
    return names


def peft_wrapper(checkpoint: Path, loss_module, attention: str = "eager"):
    """transformers' wrapper with peft's adapters on the modules longfit adapts, holding longfit's values."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from longfit.models.media import vision_adapter_parameters

    names = wrapper_names(checkpoint, loss_module)
    weights = vision_adapter_parameters(loss_module.media_encoder)  # Gemma 3's projector: peft's target_parameters
    targets = sorted({n.removeprefix("base_model.model.").split(".lora_", 1)[0] for n in names.values()}
                     - {w.rsplit(".", 1)[0] for w in weights})
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=weights))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in loss_module.named_parameters():
            if param.requires_grad:
                params[names[name]].copy_(param)
    assert {n for n, p in params.items() if p.requires_grad} == set(names.values())
    return model


def longfit_step(loss_module, batch, autocast: bool = False) -> parity.Step:
    from longfit.memory.loss import batch_loss_sum

    batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids, batch.media)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    loss.backward()
    # (a module the wrapper's forward does not run -- the SigLIP head Gemma 3 leaves unused -- has no gradient)
    return parity.Step(loss.detach().float(), {n: p.grad.float() for n, p in loss_module.named_parameters()
                                               if p.requires_grad and p.grad is not None})


class Llama4Logits(torch.nn.Module):
    """peft's Llama 4 wrapper whose forward gives its logits (tests/test_media_llama4.py's `wrapper_logits`:
    transformers' forward computes them, then fails to build its output object)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.wrapper = model

    def forward(self, **inputs):
        from types import SimpleNamespace

        from test_media_llama4 import wrapper_logits

        return SimpleNamespace(logits=wrapper_logits(self.wrapper.base_model.model, **inputs))

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.wrapper.get_input_embeddings()  # `wrapper_step` reads the wrapper's dtype off it


def reference_step(checkpoint: Path, loss_module, batch, attention: str = "eager", autocast: bool = False):
    from longfit.check.media import wrapper_step

    model = peft_wrapper(checkpoint, loss_module, attention)
    if model.config.model_type != "llama4":
        return wrapper_step(model, loss_module.media_encoder, batch, autocast=autocast)
    step = wrapper_step(Llama4Logits(model), loss_module.media_encoder, batch, autocast=autocast)
    return parity.Step(step.loss, {n.removeprefix("wrapper."): g for n, g in step.grads.items()})


def compared(checkpoint: Path, batch, vision: str, autocast: bool = False):
    """(longfit's step under the wrapper's names, the wrapper's fp32 eager step, its autocast steps)."""
    loss_module = longfit_lora(checkpoint, vision)
    names = wrapper_names(checkpoint, loss_module)
    truth = reference_step(checkpoint, loss_module, batch)
    got = longfit_step(loss_module, batch, autocast)
    got = parity.Step(got.loss, {names[n]: g for n, g in got.grads.items()})
    references = [reference_step(checkpoint, loss_module, batch, a, autocast=True)
                  for a in ("eager", "sdpa")] if autocast else []
    return got, truth, references


VISION_ADAPTERS = {"projector": "base_model.model.model.visual.merger.", "all": "base_model.model.model.visual."}


@pytest.mark.parametrize("vision", ["projector", "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_vision_adapters_equal_peft_on_the_wrapper(qwen_images, batches, rows: str, vision: str, one_thread) -> None:
    got, truth, _ = compared(qwen_images, batches[rows], vision)
    assert got.grads.keys() == truth.grads.keys()
    adapted = {n.split(".lora_")[0] for n in got.grads if n.startswith(VISION_ADAPTERS["all"])}
    assert adapted and all(n.startswith(VISION_ADAPTERS[vision]) for n in adapted)
    assert any(n.startswith("base_model.model.model.visual.blocks.") for n in adapted) == (vision == "all")
    assert all(g.abs().sum() > 0 for n, g in got.grads.items() if n.startswith(VISION_ADAPTERS["all"]))
    comparison = parity.compare_fp32(rows, got, truth)
    assert comparison.worst[1] <= 2, comparison.line()  # tests/test_media.py's bound (the gated-delta layers)


@pytest.mark.parametrize("rows", ROW_CASES)
def test_bf16_vision_adapters_are_within_the_bf16_bound(qwen_images, batches, rows: str, one_thread) -> None:
    got, truth, references = compared(qwen_images, batches[rows], "all", autocast=True)
    comparison = parity.compare_bf16(rows, got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_only_the_adapters_of_the_vision_side_train(qwen_images) -> None:
    from longfit.models.media import build_media_encoder, trainable_parts

    encoder = build_media_encoder(str(qwen_images))
    trained = trainable_parts(encoder, "projector", lora_run("projector").lora)
    names = {n for n, p in encoder.vision.named_parameters() if p.requires_grad}
    assert len(trained) == len(names) == 4  # lora_A and lora_B of the merger's linear_fc1 and linear_fc2
    assert all(n.startswith("merger.") and ".lora_" in n and p.dtype == torch.float32
               for n, p in encoder.vision.named_parameters() if p.requires_grad)
    assert all(m.r["default"] == 4 and m.scaling["default"] == 2 for m in encoder.vision.modules() if hasattr(m, "r"))
    frozen = build_media_encoder(str(qwen_images))
    assert trainable_parts(frozen, "frozen", lora_run("frozen").lora) == []


def test_the_vision_adapters_are_drawn_from_the_seed_alone(qwen_images) -> None:
    """peft's initialisation (A drawn, B zero), the same on every rank whatever the global generator drew before (the
    language model's adapters' rule, `longfit.models.init.reset_lora`), another for another seed."""
    from longfit.models.media import build_media_encoder, trainable_parts

    drawn = []
    for generator_seed, seed in ((1, 0), (2, 0), (1, 1)):
        torch.manual_seed(generator_seed)
        encoder = build_media_encoder(str(qwen_images))
        trainable_parts(encoder, "all", lora_run("all").lora, seed)
        drawn.append({n: p.detach().clone() for n, p in encoder.vision.named_parameters() if p.requires_grad})
    first, again, other = drawn
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(first[n].abs().sum() > 0 and not torch.equal(first[n], other[n]) for n in first if ".lora_A." in n)
    assert all(not first[n].any() for n in first if ".lora_B." in n)


def test_lora_with_a_trained_vision_side_is_accepted_by_the_config() -> None:
    assert lora_run("all").train.vision == "all" and lora_run("projector").lora.enabled


def test_a_projector_without_a_linear_layer_is_refused_in_one_line(qwen_images) -> None:
    from longfit.models.media import build_media_encoder, trainable_parts

    encoder = build_media_encoder(str(qwen_images))
    encoder.family = type(encoder.family)(tower="model.visual", projector="merger.norm")  # a projector of norms only
    with pytest.raises(ConfigError, match="train.vision=projector with lora.enabled=true: the qwen3_5 projector has "
                                          "no linear layer or weight matrix for an adapter; set train.vision=all"):
        trainable_parts(encoder, "projector", lora_run("projector").lora)


# -- context parallelism ----------------------------------------------------------------------------------------

def family_batch(family: str, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int):
    """The first packed batch of `rows` as each family's tests read it (Llama 4's tiles without torchvision)."""
    if family == "llama4":
        from test_media_llama4 import llama4_batch

        return llama4_batch(checkpoint, rows, seq_len, micro_batch)
    return image_batch(checkpoint, rows, seq_len, micro_batch)


def cp_rank_step(rank: int, world_size: int, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int,
                 method: str, family: str = "qwen3_5"):
    """One rank of a cp=2 group, ring or Ulysses (tests/test_media.py's `cp_rank_step` with LoRA): the summed loss
    and every adapter gradient summed over the ranks."""
    import torch.distributed as dist

    from longfit.parallel.media import DealtMedia
    from longfit.parallel.parallelize import apply_context_parallel

    loss_module = longfit_lora(checkpoint, "all")
    layout = apply_context_parallel(loss_module.model, dist.group.WORLD, method)
    loss_module.media_features = DealtMedia(dist.group.WORLD)
    batch = family_batch(family, checkpoint, rows, seq_len, micro_batch)
    # Read after the backward: a module the forward does not run (Gemma 3's SigLIP head) has no gradient.
    trained = ((n, p) for n, p in loss_module.named_parameters() if p.grad is not None)
    return cp_share_step(loss_module, layout, batch, rank, world_size, trained)[0]


@pytest.mark.slow  # two gloo ranks per case, each building the model, and the wrapper's reference
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("rows", list(ROWS))
def test_context_parallel_vision_adapters_equal_peft_on_the_wrapper(qwen_images, tmp_path, rows: str,
                                                                    method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS[rows]
    path = write_rows(tmp_path, conversations)
    results = run_distributed(cp_rank_step, 2, qwen_images, path, seq_len, micro_batch, method)
    batch = image_batch(qwen_images, path, seq_len, micro_batch)
    loss_module = longfit_lora(qwen_images, "all")
    names = wrapper_names(qwen_images, loss_module)
    truth = reference_step(qwen_images, loss_module, batch)
    for rank, got in enumerate(results):
        got = parity.Step(got.loss, {names[n]: g for n, g in got.grads.items()})
        assert got.grads.keys() == truth.grads.keys()
        comparison = parity.compare_fp32(f"rank {rank}, {method}", got, truth)
        assert comparison.worst[1] <= 2, comparison.line()


# -- the export -------------------------------------------------------------------------------------------------

def exported_wrapper(checkpoint: Path, batch, merge: bool, tmp_path: Path):
    """(longfit's adapters on `checkpoint`'s wrapper, all of it trained; their export under tmp_path, merged or not;
    peft's wrapper holding them on `batch`, the reference; transformers' wrapper of the checkpoint, or of the merged
    export)."""
    from transformers import AutoModelForImageTextToText

    from longfit.models.loading import load_tokenizer
    from longfit.train.export import export_model

    loss_module = longfit_lora(checkpoint, "all")
    cfg = lora_run("all", f"model={checkpoint}", f"lora.merge_on_export={str(merge).lower()}")
    out = export_model(cfg, loss_module.model, load_tokenizer(str(checkpoint)), tmp_path / "export", rank=0,
                       media_encoder=loss_module.media_encoder)
    truth = reference_step(checkpoint, loss_module, batch)
    wrapper = AutoModelForImageTextToText.from_pretrained(checkpoint if not merge else out, dtype=torch.float32,
                                                          attn_implementation="eager")
    return loss_module, out, truth, wrapper


@pytest.mark.parametrize("merge", [False, True])
def test_the_export_loads_onto_the_wrapper_and_runs_as_trained(qwen_images, batches, tmp_path, merge: bool,
                                                                one_thread) -> None:
    """The adapter peft loads onto transformers' wrapper (`PeftModel.from_pretrained`), or the merged wrapper, gives
    the loss (and, as an adapter, every adapter gradient) of peft's wrapper holding longfit's adapters."""
    from peft import PeftModel

    from longfit.check.media import wrapper_step

    batch = batches["packed"]
    loss_module, out, truth, wrapper = exported_wrapper(qwen_images, batch, merge, tmp_path)
    if merge:
        assert not (out / "adapter_config.json").exists()
        got = wrapper_step(wrapper, loss_module.media_encoder, batch)
        torch.testing.assert_close(got.loss, truth.loss, rtol=1e-5, atol=1e-6)
        return
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(Path(qwen_images).resolve())
    model = PeftModel.from_pretrained(wrapper, out, is_trainable=True)
    got = wrapper_step(model, loss_module.media_encoder, batch)
    assert got.grads.keys() == truth.grads.keys()
    assert any(".visual.blocks." in n for n in got.grads) and any(".visual.merger." in n for n in got.grads)
    torch.testing.assert_close(got.loss, truth.loss, rtol=0, atol=0)
    for name, grad in truth.grads.items():
        torch.testing.assert_close(got.grads[name], grad, rtol=0, atol=0, msg=name)


# -- longfit check -----------------------------------------------------------------------------------------------

def lora_image_run(checkpoint: Path, folder: Path, *overrides: str):
    from test_media import ONE, TEXT_ONLY, TWO

    rows = write_rows(folder, [ONE, TWO, TEXT_ONLY])
    return load_config(None, [f"model={checkpoint}", f"data.path={rows}", "seq_len=128", "train.device=cpu",
                              "train.vision=all", *LORA, *overrides])


def test_longfit_check_proves_the_adapters_on_image_rows(qwen_images, tmp_path, one_thread) -> None:
    from longfit.check.parity import check_run

    report = check_run(lora_image_run(qwen_images, tmp_path, "train.dtype=fp32"), "cpu")
    assert report.exact, report.refusal
    assert "image rows, one process, fp32, packed" in [c.name for c in report.comparisons]
    assert any(line.startswith("  note: image rows with LoRA: adapters on the language model's q_proj") and
               "and the all linear layers of the vision side, against peft on the wrapper" in line
               for line in report.lines()), report.lines()


@pytest.mark.slow  # the text and image steps under bf16, then two gloo ranks
def test_longfit_check_proves_the_adapters_on_image_rows_under_bf16_and_cp(qwen_images, tmp_path, one_thread) -> None:
    from longfit.check.parity import check_run

    cfg = lora_image_run(qwen_images, tmp_path, "train.dtype=bf16", "parallel.cp=2", "parallel.cp_method=ring",
                         "memory.tiled_layers=false")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    names = [c.name for c in report.comparisons]
    assert "image rows, bf16 autocast, techniques, packed" in names
    assert "image rows, rank 1 of 2, ring, techniques, packed" in names


# -- longfit plan ------------------------------------------------------------------------------------------------

def test_the_plan_counts_the_vision_adapters_as_what_trains(qwen_images) -> None:
    from longfit.models.media import build_media_encoder
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    run = [f"model={qwen_images}", "data.plan_images=2", "data.plan_image_size=64x64", "seq_len=256",
           "train.dtype=fp32", "eval.retrieval=false"]
    full = tower_costs(plan_config(load_config(None, [*run, "train.vision=all"]), 1).setup)
    lora = tower_costs(plan_config(lora_run("all", *run), 1).setup)
    linears = [m for m in build_media_encoder(str(qwen_images)).vision.modules() if isinstance(m, torch.nn.Linear)]
    adapters = sum(4 * (m.in_features + m.out_features) for m in linears)  # lora.r=4: A (r, in) and B (out, r)
    assert full.trained == full.params and lora.trained == adapters
    assert lora.params == full.params + adapters


# -- longfit train -----------------------------------------------------------------------------------------------

@pytest.mark.slow  # a one-process run and a --nproc 2 run, each with its preflight check
@pytest.mark.timeout(1800)
def test_longfit_train_with_vision_adapters_under_cp_equals_one_process_and_exports_them(qwen_images,
                                                                                         tmp_path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from test_media import ONE, TEXT_ONLY, TWO, logged_losses, train_argv, train_on_two_ranks
    from transformers import AutoModelForImageTextToText

    from longfit.cli import main

    rows = write_rows(tmp_path / "data", [[ONE, TWO, TEXT_ONLY][i % 3] for i in range(12)])
    argv = [*train_argv(qwen_images, rows, tmp_path / "one"), *LORA]
    assert main(["train", *argv]) == 0
    train_on_two_ranks(*train_argv(qwen_images, rows, tmp_path / "cp2"), *LORA, "parallel.cp=2")
    losses = [logged_losses(tmp_path / run) for run in ("one", "cp2")]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-4)
    export = tmp_path / "one" / "final"
    adapters = load_file(export / "adapter_model.safetensors")
    tower = [k for k in adapters if k.startswith("base_model.model.model.visual.blocks.") and ".lora_B." in k]
    assert tower and all(adapters[k].abs().sum() > 0 for k in tower)  # B starts at zero: the tower's adapters trained
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(qwen_images, dtype=torch.float32),
                                      export)
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if ".lora_" in k}
    assert loaded.keys() == adapters.keys()
    assert all(torch.equal(loaded[k], adapters[k].float()) for k in adapters)


# -- resume -----------------------------------------------------------------------------------------------------

@pytest.mark.slow  # three runs of 2-4 steps, each with its preflight check
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_resumed_run_with_vision_adapters_is_bit_identical(qwen_images, tmp_path, dtype: str) -> None:
    """A run stopped after 2 of 4 steps and resumed from its checkpoint (the vision side's adapters and their optimizer
    state in it) logs the losses of the uninterrupted run and exports the same adapters, bit for bit."""
    from safetensors.torch import load_file
    from test_media import ONE, TEXT_ONLY, TWO, logged_losses, train_argv

    from longfit.train.loop import train

    rows = write_rows(tmp_path / "data", [[ONE, TWO, TEXT_ONLY][i % 3] for i in range(12)])
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    more = [*LORA, "train.steps=4", f"train.dtype={dtype}"]
    train(load_config(None, [*train_argv(qwen_images, rows, whole), *more]))
    cfg = load_config(None, [*train_argv(qwen_images, rows, resumed), *more])
    train(cfg, stop_after_steps=2)
    assert train(cfg).resumed_from == 2
    losses = [logged_losses(run) for run in (whole, resumed)]
    assert len(losses[0]) == 4 and losses[1] == losses[0]
    exports = [load_file(run / "final" / "adapter_model.safetensors") for run in (whole, resumed)]
    assert exports[0].keys() == exports[1].keys()
    tower = [k for k in exports[0] if k.startswith("base_model.model.model.visual.blocks.") and ".lora_B." in k]
    assert tower and all(exports[0][k].abs().sum() > 0 for k in tower)  # B starts at zero: the tower's trained
    assert all(torch.equal(exports[0][key], exports[1][key]) for key in exports[0])


# -- Gemma 3 ---------------------------------------------------------------------------------------------------

GEMMA3_PROJECTOR = "base_model.model.model.multi_modal_projector."


@pytest.mark.parametrize("vision", ["projector", "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_gemma3_vision_adapters_equal_peft_on_the_wrapper(gemma3_images, gemma3_batches, rows: str, vision: str,
                                                          one_thread) -> None:
    """Gemma 3's projector is one weight (`mm_input_projection_weight`, no linear layer): its adapter is peft's
    `ParamWrapper` (`target_parameters`), A (r, text width) and B (vision width, r); with `all` the SigLIP tower's
    linear layers too (`q_proj`, `out_proj`, `fc1` of each layer: the language model's target names among them)."""
    got, truth, _ = compared(gemma3_images, gemma3_batches[rows], vision)
    assert got.grads.keys() == truth.grads.keys()
    projector = {n: g for n, g in got.grads.items() if n.startswith(GEMMA3_PROJECTOR)}
    assert sorted(projector) == [GEMMA3_PROJECTOR + "lora_A.default.weight", GEMMA3_PROJECTOR + "lora_B.default.weight"]
    assert all(g.abs().sum() > 0 for g in projector.values())
    tower = {n.split(".lora_")[0] for n in got.grads if ".vision_tower." in n}
    assert bool(tower) == (vision == "all")
    if vision == "all":
        assert any(n.endswith(".self_attn.out_proj") for n in tower) and any(n.endswith(".mlp.fc1") for n in tower)
    comparison = parity.compare_fp32(f"gemma3, {rows}", got, truth)
    assert comparison.ok, comparison.line()


def test_bf16_gemma3_projector_adapter_is_within_the_bf16_bound(gemma3_images, gemma3_batches, one_thread) -> None:
    got, truth, references = compared(gemma3_images, gemma3_batches["packed"], "projector", autocast=True)
    assert any(n.startswith(GEMMA3_PROJECTOR) for n in got.grads)
    comparison = parity.compare_bf16("gemma3, packed", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


@pytest.mark.parametrize("merge", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gemma3s_projector_adapter_exports_and_loads_onto_the_wrapper(gemma3_images, gemma3_batches, tmp_path,
                                                                     merge: bool, one_thread) -> None:
    """The adapter names the projector's weight in `target_parameters` (its module is no linear layer for
    `target_modules`); peft loads it onto transformers' wrapper bit for bit, and the loaded wrapper gives the loss and
    every adapter gradient of peft's wrapper holding longfit's adapters; merged, the wrapper gives the loss."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from longfit.check.media import wrapper_step

    batch = gemma3_batches["packed"]
    loss_module, out, truth, wrapper = exported_wrapper(gemma3_images, batch, merge, tmp_path)
    if merge:
        assert not (out / "adapter_config.json").exists()
        projector = loss_module.media_encoder.projector
        weight = projector.get_param()
        merged = weight.float() + 2 * projector.lora_B["default"].weight @ projector.lora_A["default"].weight
        torch.testing.assert_close(wrapper.model.multi_modal_projector.mm_input_projection_weight,
                                   merged.to(weight.dtype), rtol=0, atol=0)  # W + (alpha / r) B A
        got = wrapper_step(wrapper, loss_module.media_encoder, batch)
        torch.testing.assert_close(got.loss, truth.loss, rtol=1e-5, atol=1e-6)
        return
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["target_parameters"] == ["model.multi_modal_projector.mm_input_projection_weight"]
    assert "multi_modal_projector" not in adapter["target_modules"]
    saved = load_file(out / "adapter_model.safetensors")
    projector = {k: v for k, v in saved.items() if k.startswith(GEMMA3_PROJECTOR)}
    assert sorted(projector) == [GEMMA3_PROJECTOR + "lora_A.weight", GEMMA3_PROJECTOR + "lora_B.weight"]
    model = PeftModel.from_pretrained(wrapper, out, is_trainable=True)
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if ".lora_" in k}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k].float()) for k in saved)
    got = wrapper_step(model, loss_module.media_encoder, batch)
    assert got.grads.keys() == truth.grads.keys() and any(n.startswith(GEMMA3_PROJECTOR) for n in got.grads)
    torch.testing.assert_close(got.loss, truth.loss, rtol=0, atol=0)
    for name, grad in truth.grads.items():
        torch.testing.assert_close(got.grads[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_longfit_check_proves_gemma3s_projector_adapter(gemma3_images, tmp_path, dtype: str, one_thread) -> None:
    from longfit.check.parity import check_run

    report = check_run(lora_image_run(gemma3_images, tmp_path, f"train.dtype={dtype}", "train.vision=projector"), "cpu")
    assert report.exact, report.refusal
    assert any(line.startswith("  note: image rows with LoRA: adapters on the language model's") and
               "and the vision side's model.multi_modal_projector.mm_input_projection_weight (peft's "
               "target_parameters), against peft on the wrapper" in line
               for line in report.lines()), report.lines()


def test_the_plan_counts_gemma3s_projector_adapter_as_what_trains(gemma3_images) -> None:
    from longfit.models.media import build_media_encoder
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    run = [f"model={gemma3_images}", "data.plan_images=2", "data.plan_image_size=64x64", "seq_len=256",
           "train.dtype=fp32", "eval.retrieval=false"]
    full = tower_costs(plan_config(load_config(None, [*run, "train.vision=projector"]), 1).setup)
    lora = tower_costs(plan_config(lora_run("projector", *run), 1).setup)
    rows, columns = build_media_encoder(str(gemma3_images)).projector.mm_input_projection_weight.shape
    assert lora.trained == 4 * (rows + columns)  # lora.r=4: A (r, columns) and B (rows, r)
    assert lora.params == full.params + lora.trained


def test_a_projector_weight_adapter_with_dropout_is_refused_in_one_line(gemma3_images) -> None:
    from longfit.models.media import build_media_encoder, trainable_parts

    encoder = build_media_encoder(str(gemma3_images))
    with pytest.raises(ConfigError, match=r"train.vision=all with lora.dropout=0.1: the gemma3 projector's "
                                          r"mm_input_projection_weight is a weight without a linear layer, whose "
                                          r"adapter takes no dropout; set lora.dropout=0$"):
        trainable_parts(encoder, "all", lora_run("all", "lora.dropout=0.1").lora)


# -- Gemma 4, Llama 4, Mistral 3 --------------------------------------------------------------------------------

# Each family's tower under the wrapper's names, and its fp32 bound (in longfit check's fp32 bounds). Gemma 4's is 3:
# its gradients cancel (transformers' std-0.02 initialisation), and the wrapper's own sdpa step against its eager one
# is as far off: with the projector's adapters, longfit 2.8x one conversation and 1.8x packed, sdpa 1.9x and 3.1x.
FAMILIES = {"gemma4": (".vision_tower.", 3), "llama4": (".vision_model.", 1), "mistral3": (".vision_tower.", 1)}
FAMILY_ROWS = {"gemma3": GEMMA3_ROWS["packed"], "gemma4": GEMMA4_ROWS["packed"], "llama4": LLAMA4_ROWS["packed"],
               "mistral3": MISTRAL3_ROWS["packed"]}
BOUNDS = {"gemma3": 1} | {family: bound for family, (_, bound) in FAMILIES.items()}


@pytest.mark.parametrize("vision", ["projector", "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vision_adapters_of_each_family_equal_peft_on_the_wrapper(request, family: str, rows: str, vision: str,
                                                                  one_thread) -> None:
    checkpoint = request.getfixturevalue(f"{family}_images")
    got, truth, _ = compared(checkpoint, request.getfixturevalue(f"{family}_batches")[rows], vision)
    assert got.grads.keys() == truth.grads.keys()
    tower, bound = FAMILIES[family]
    adapted = [n for n in got.grads if tower in n]
    assert bool(adapted) == (vision == "all") and all(got.grads[n].abs().sum() > 0 for n in adapted)
    comparison = parity.compare_fp32(f"{family}, {rows}", got, truth)
    assert comparison.worst[1] <= bound, comparison.line()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_vision_adapters_of_each_family_are_within_the_bf16_bound(request, family: str, one_thread) -> None:
    checkpoint = request.getfixturevalue(f"{family}_images")
    got, truth, references = compared(checkpoint, request.getfixturevalue(f"{family}_batches")["packed"], "all",
                                      autocast=True)
    comparison = parity.compare_bf16(f"{family}, packed", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


@pytest.mark.slow  # two gloo ranks per case, each building the model, and the wrapper's reference
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("family", list(FAMILY_ROWS))
def test_context_parallel_vision_adapters_of_each_family_equal_peft_on_the_wrapper(request, tmp_path, family: str,
                                                                                   method: str) -> None:
    from parallel_harness import run_distributed

    checkpoint = request.getfixturevalue(f"{family}_images")
    conversations, seq_len, micro_batch = FAMILY_ROWS[family]
    path = write_rows(tmp_path, conversations)
    results = run_distributed(cp_rank_step, 2, checkpoint, path, seq_len, micro_batch, method, family)
    loss_module = longfit_lora(checkpoint, "all")
    names = wrapper_names(checkpoint, loss_module)
    truth = reference_step(checkpoint, loss_module, family_batch(family, checkpoint, path, seq_len, micro_batch))
    for rank, got in enumerate(results):
        got = parity.Step(got.loss, {names[n]: g for n, g in got.grads.items()})
        assert got.grads.keys() == truth.grads.keys()
        comparison = parity.compare_fp32(f"{family}, rank {rank}, {method}", got, truth)
        assert comparison.worst[1] <= BOUNDS[family], comparison.line()
