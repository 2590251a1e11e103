"""Image rows under pipeline parallelism (#54): the vision side on the first stage.

tests/test_media_mistral3.py's tiny Mistral 3 wrapper (written by transformers from its default config, shrunk: four
decoder layers, a Pixtral tower) and its packed rows, two rows of images and text. `parallelize` cuts the stages as the
trainer does (parallel.pp=2, two layers a stage, FSDP2 on each stage's ranks) and `Pipeline.step` runs the step's
micro-batches (a row each) through them: the first stage runs the tower on each micro-batch's images and puts their
embeddings into its input embeddings. The step's loss and every gradient -- the language model's on both stages, the
tower's and projector's where they train -- against the wrapper's own eager forward on the two rows on one process: fp32
within compare_fp32, bf16 within the bf16 bound, the vision side trained and frozen; under cp=2 on each stage too
(slow); an evaluation's forward through the stages. `longfit train --nproc 2 parallel.pp=2` logs the one-process losses,
resumes bit for bit and exports the wrapper (slow). A family whose images change what the later stages' layers read is
refused in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import as_wrapper_names, image_batch, longfit_model, write_rows  # noqa: E402
from test_media_mistral3 import ROWS, untied_mistral3  # noqa: E402,F401 -- the session fixture
from test_media_tp import compared_with_the_wrapper, wrapper_steps  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import ConfigError  # noqa: E402

VISION = ("model.vision_tower.", "model.multi_modal_projector.")


def micro_batches(checkpoint: Path, rows: Path, seq_len: int, count: int) -> list:
    """The first `count` batches of one row each that the trainer's loader makes of `rows`."""
    from longfit.config import load_config
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    cfg = load_config(None, [f"model={checkpoint}", f"data.path={rows}", f"seq_len={seq_len}", "train.micro_batch=1"])
    loader = build_dataloader(cfg, load_tokenizer(str(checkpoint)), epochs=1, media=media_reader(str(checkpoint)))
    return [next(loader) for _ in range(count)]


def pipeline_rank_steps(rank: int, world_size: int, checkpoint: Path, rows: Path, cases: list[tuple],
                        cp: int = 1, method: str = "ring") -> dict:
    """This rank's step of every (train.vision, train.dtype, parallel.pp_schedule) case: parallel.pp=2 (x cp), the
    two rows as two micro-batches through the stages; the step's loss, and every trained gradient this rank's stage
    holds, whole, under the causal LM's names and the wrapper's for the vision side."""
    from longfit.config import load_config
    from longfit.memory.loss import positioned
    from longfit.models.loading import compute_dtype
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize
    from longfit.parallel.pipeline import Pipeline

    _, seq_len, rows_per_batch = ROWS["packed"]
    results = {}
    for vision, dtype, schedule in cases:
        cfg = load_config(None, [f"model={checkpoint}", f"seq_len={seq_len}", "parallel.pp=2", f"parallel.cp={cp}",
                                 f"parallel.cp_method={method}",
                                 f"parallel.pp_schedule={schedule}", f"train.grad_accum={rows_per_batch}",
                                 f"train.dtype={dtype}", f"train.vision={vision}", "memory.tiled_mlp=false",
                                 *(["parallel.reshard_after_forward=false"] if schedule == "zbv" else [])])
        loss_module = longfit_model(checkpoint, vision)
        text = loss_module.model.config
        dims = ParallelDims.from_config(cfg, world_size, text.num_attention_heads,
                                        num_key_value_heads=text.num_key_value_heads,
                                        intermediate_size=text.intermediate_size, text_config=text)
        mesh = dims.build_mesh("cpu")
        stage = parallelize(loss_module, dims, cfg, mesh)
        assert (stage.media_encoder is not None) == (mesh.pp_rank == 0), "the vision side is the first stage's"
        pipeline = Pipeline(stage, cfg, mesh, torch.device("cpu"), compute_dtype(dtype, torch.device("cpu")))
        shards = [shard_batch(positioned(stage, b), mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method))
                  for b in micro_batches(checkpoint, rows, seq_len, rows_per_batch)]
        valid = global_valid_tokens([s.labels for s in shards], mesh.world_group)
        loss = all_reduce_sum(pipeline.step(shards, valid).clone(), mesh.world_group) / valid
        named = list(stage.model.named_parameters())
        if stage.media_encoder is not None:
            named += [("model." + n, p) for n, p in stage.media_encoder.vision.named_parameters()]
        grads = {n: p.grad.full_tensor().float() for n, p in named if p.requires_grad}
        held_out = all_reduce_sum(pipeline.batch_loss(shards[0]).clone(), mesh.world_group)  # an evaluation's forward
        results[vision, dtype, schedule] = parity.Step(loss, grads), held_out
    return results


def assert_stages_equal_the_wrapper(checkpoint: Path, rows: Path, results: list[dict]) -> None:
    """The stages' gradients together, each parameter's from the one stage holding it, against the wrapper on the two
    rows in one batch (the micro-batches' rows, as the loader packs them); the evaluation of the first micro-batch
    through the stages against longfit's loss of it on one process."""
    from longfit.memory.loss import batch_loss_sum, positioned

    conversations, seq_len, rows_per_batch = ROWS["packed"]
    batch = image_batch(checkpoint, rows, seq_len, rows_per_batch)
    assert batch.media.images == 4
    assert torch.equal(torch.cat([b.input_ids for b in micro_batches(checkpoint, rows, seq_len, rows_per_batch)]),
                       batch.input_ids)
    cases = results[0].keys()
    truth, references = wrapper_steps("mistral3", checkpoint, batch, any(dtype == "bf16" for _, dtype, _ in cases))
    names = longfit_model(checkpoint, "all")
    with torch.no_grad():  # the eval loss of the first micro-batch on one process, no parallelism
        first_row = positioned(names, micro_batches(checkpoint, rows, seq_len, 1)[0])
        held_out = batch_loss_sum(names, first_row)
    for vision, dtype, schedule in cases:
        steps = [r[vision, dtype, schedule][0] for r in results]
        assert len({float(s.loss) for s in steps}) == 1, "the ranks disagree on the loss"
        for _, evaluated in (r[vision, dtype, schedule] for r in results):
            torch.testing.assert_close(evaluated, held_out, **({"rtol": 1e-5, "atol": 1e-5} if dtype == "fp32" else
                                                               {"rtol": 2e-2, "atol": 0.0}))
        first, last = (steps[0].grads, steps[-1].grads)
        assert not first.keys() & last.keys(), "a parameter on two stages"
        got = as_wrapper_names(parity.Step(steps[0].loss, {**first, **last}), names, truth.grads)
        assert any(n.startswith(VISION) for n in got.grads) == (vision != "frozen")
        assert not any(n.startswith(VISION) for n in as_wrapper_names(steps[-1], names, truth.grads).grads)
        name = f"mistral3, pp=2 ({schedule}), train.vision={vision}, {dtype}"
        comparison = compared_with_the_wrapper(name, got, truth, references, dtype)
        assert comparison.ok, comparison.line()
        print(comparison.line())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cases", [[("all", "fp32", "1f1b")],
                                   pytest.param([("frozen", "fp32", "gpipe"), ("all", "bf16", "1f1b"),
                                                 ("projector", "fp32", "zbv")], marks=pytest.mark.slow)],
                         ids=["trained-fp32", "frozen-fp32-trained-bf16-projector-zbv"])
def test_pipelined_image_rows_equal_the_wrapper(untied_mistral3, tmp_path, cases) -> None:
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, ROWS["packed"][0])
    results = run_distributed(pipeline_rank_steps, 2, untied_mistral3, path, cases)
    assert_stages_equal_the_wrapper(untied_mistral3, path, results)


@pytest.mark.slow  # four gloo ranks, each building the wrapper twice
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_pipelined_and_context_parallel_image_rows_equal_the_wrapper(untied_mistral3, tmp_path, method) -> None:
    """pp=2 x cp=2: each stage's two cp ranks share a row's tokens; the first stage's deal its images."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, ROWS["packed"][0])
    results = run_distributed(pipeline_rank_steps, 4, untied_mistral3, path, [("all", "fp32", "1f1b")], 2, method)
    assert_stages_equal_the_wrapper(untied_mistral3, path, [results[0], results[-1]])


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "gemma4"])
def test_a_family_whose_images_reach_every_layer_is_refused_under_pp(family) -> None:
    """Qwen3.5's M-RoPE positions, Gemma 3's image spans, Gemma 4's per-layer inputs: what the stages after the first
    would not receive. Mistral 3's image rows have text positions and causal attention."""
    from transformers import AutoConfig

    from longfit.parallel.pipeline import refuse_image_rules

    with pytest.raises(ConfigError, match=rf"^parallel.pp=2: the {family} checkpoint's image rows give every decoder "
                                          r"layer .+ set parallel.pp=1"):
        refuse_image_rules(AutoConfig.for_model(family), 2)
    refuse_image_rules(AutoConfig.for_model("mistral3"), 2)


@pytest.mark.slow  # a one-process run, a --nproc 2 run and its resume, each with its preflight check
@pytest.mark.timeout(1800)
def test_longfit_train_on_image_rows_under_pp_equals_one_process_resumes_and_exports(untied_mistral3,
                                                                                      tmp_path) -> None:
    """`longfit train --nproc 2 parallel.pp=2` on image rows with the tower trained (refused before, #54): the
    one-process losses; resumed from its step-2 checkpoint, the same last loss and export bit for bit; the export the
    wrapper with the tower as the one-process run trained it."""
    import shutil

    from safetensors.torch import load_file

    from longfit.cli import main
    from test_media import logged_losses, train_argv, train_on_two_ranks

    rows = write_rows(tmp_path / "data", ROWS["packed"][0] * 3)

    def argv(out: str) -> list[str]:
        return [*train_argv(untied_mistral3, rows, tmp_path / out), "train.dtype=fp32", "train.grad_accum=2",
                "train.save_every=2", "memory.tiled_mlp=false"]

    def pipelined() -> str:
        return train_on_two_ranks(*argv("pp2"), "parallel.pp=2")

    assert main(["train", *argv("one")]) == 0
    assert "layout  2 ranks: pp 2 (1f1b)" in pipelined()
    one_process = logged_losses(tmp_path / "one")
    assert len(one_process) == 3 and logged_losses(tmp_path / "pp2") == pytest.approx(one_process, rel=1e-4)
    one, exported = (load_file(tmp_path / out / "final" / "model.safetensors") for out in ("one", "pp2"))
    source = load_file(untied_mistral3 / "model.safetensors")
    assert exported.keys() == source.keys()
    tower = [k for k in source if k.startswith(("vision_tower.", "multi_modal_projector.")) and k.endswith("weight")]
    assert tower and all(not torch.equal(source[k], exported[k]) for k in tower)
    for key, value in one.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-5, msg=key)

    first = logged_losses(tmp_path / "pp2")
    shutil.rmtree(tmp_path / "pp2" / "checkpoints" / "step_00000003")
    shutil.rmtree(tmp_path / "pp2" / "final")
    assert "resuming from" in pipelined()
    assert logged_losses(tmp_path / "pp2") == first
    again = load_file(tmp_path / "pp2" / "final" / "model.safetensors")
    assert all(torch.equal(again[k], exported[k]) for k in exported)


@pytest.mark.slow  # a one-process run and a --nproc 2 run, each with its preflight check
@pytest.mark.timeout(1800)
def test_lora_on_the_language_model_and_the_tower_under_pp_equals_one_process(untied_mistral3, tmp_path) -> None:
    """LoRA on both sides (train.vision=all): the first stage trains the tower's adapters, and the export's adapters
    (the language model's and the vision side's) are the one-process run's."""

    from safetensors.torch import load_file

    from longfit.cli import main
    from test_media import logged_losses, train_argv, train_on_two_ranks

    rows = write_rows(tmp_path / "data", ROWS["packed"][0] * 3)
    lora = ["train.dtype=fp32", "train.grad_accum=2", "memory.tiled_mlp=false", "lora.enabled=true", "lora.r=4",
            "lora.alpha=8"]
    assert main(["train", *train_argv(untied_mistral3, rows, tmp_path / "one"), *lora]) == 0
    train_on_two_ranks(*train_argv(untied_mistral3, rows, tmp_path / "pp2"), *lora, "parallel.pp=2")
    losses = [logged_losses(tmp_path / out) for out in ("one", "pp2")]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-4)
    files, other = (sorted(p.relative_to(tmp_path / out / "final")
                           for p in (tmp_path / out / "final").rglob("*.safetensors")) for out in ("one", "pp2"))
    assert files == other
    adapters = {}
    for file in files:
        want, got = (load_file(tmp_path / out / "final" / file) for out in ("one", "pp2"))
        assert want.keys() == got.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=f"{file}: {key}")
        adapters |= {k: v for k, v in want.items() if "lora_" in k}
    assert any("vision_tower" in k for k in adapters) and any("language_model" in k for k in adapters), sorted(adapters)
