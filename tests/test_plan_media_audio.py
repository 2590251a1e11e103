"""`longfit plan` counts Gemma 4's audio tower (#54, longfit.plan.media): the audios of the heaviest micro-batch the
packer makes (`heaviest_media_row`'s `batch_audio_tokens`), each traced at the data's longest audio, the tower's
activations extended from one and two blocks to its depth, added to the vision tower's (the audio tower runs after it
and its backward before it, each beside the other's kept tensors, and each holds the other's gradients or idle zero
gradients through its backward). The plan is held to a real traced step (`longfit.plan.trace.trace_image_step`) of
the tiny Gemma 4 wrapper of tests/test_media_gemma4_av.py, its audio tower three blocks deep, within
plan/accuracy.py's band, at cp=1 and cp=2 (audio rows; image and audio rows, dealt over the ranks together)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_media_gemma4_av import BOTH, write_rows, write_tiny_gemma4_audio  # noqa: E402

from longfit.config import load_config  # noqa: E402
from longfit.plan.accuracy import SAFE_BAND  # noqa: E402

TWO_AUDIOS = [{"role": "user", "content": [{"type": "audio", "path": "a1.wav"}, {"type": "audio", "path": "a0.wav"},
                                           {"type": "text", "text": "what?"}]},
              {"role": "assistant", "content": "tones"}]
IMAGE = [{"role": "user", "content": BOTH[0]["content"][:2]}, BOTH[1]]
CHATS = {"audio": [TWO_AUDIOS] * 4, "both": [BOTH] * 4, "image": [IMAGE] * 4}
"""Rows all alike (two chats a row of 128 tokens): two audios a chat (0.9 s and 0.5 s: 23 and 13 tokens); an image
and an audio a chat; an image a chat (the audio tower idle, its zero gradients held through the vision tower's
backward)."""


@pytest.fixture(scope="module")
def gemma4_audio(tmp_path_factory) -> Path:
    return write_tiny_gemma4_audio(tmp_path_factory.mktemp("gemma4-audio-three-blocks"), audio_depth=3)


def given(checkpoint: Path, rows: Path, dtype: str = "fp32") -> list[str]:
    return [f"model={checkpoint}", f"data.path={rows}", "seq_len=128", "train.vision=all", f"train.dtype={dtype}",
            "eval.retrieval=false"]


def test_the_plan_counts_a_steps_audios(gemma4_audio, tmp_path) -> None:
    """Audio rows alone: the heaviest micro-batch's four audios, each traced at the longest (89 frames), their own
    tokens; the audio tower's activations beside the language model's (the plan failed on them: no vision input)."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    planned = plan_config(load_config(None, given(gemma4_audio, write_rows(tmp_path, CHATS["audio"]))), 1)
    images = planned.setup.images
    assert (images.count, images.audio_frames) == (0, 89)
    assert images.batch_audios == pytest.approx((1, 13 / 23, 1, 13 / 23))
    towers = tower_costs(planned.setup)
    assert (towers.batch_images, towers.embeddings) == (4, 2 * (23 + 13))
    assert towers.kept > 4 * 3 * 32 * 23 * 4  # beyond every block's input
    assert "4 audios" in images.source and "its longest audio (89 frames)" in images.source


def test_the_plan_deals_images_and_audios_together_as_the_run(gemma4_audio, tmp_path) -> None:
    """Under cp=2 the run deals the step's inputs, an image then an audio, over the ranks together
    (`longfit.parallel.media.DealtMedia` on the batch's own grids): one rank runs the image, the other the
    audio. The plan deals them the same (before: each kind apart, fewer than the ranks, so each on every rank: both
    towers' activations on one rank)."""
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import build_media_encoder, media_reader
    from longfit.parallel.media import rank_inputs
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import _ranks_inputs, tower_costs

    cfg = load_config(None, given(gemma4_audio, write_rows(tmp_path, CHATS["both"])) + ["parallel.cp=2"])
    batch = next(build_dataloader(cfg, load_tokenizer(cfg.model), epochs=1, media=media_reader(cfg.model)))
    grid = batch.media.grid_thw  # (I, 3): an audio's (0, frames, mel bins)
    run = [[bool(grid[i, 0] == 0) for i in own]
           for own in rank_inputs(build_media_encoder(cfg.model, "cpu").pixel_rows(grid), 2)]  # audio or not
    planned = plan_config(cfg, 2).setup
    assert planned.images.batch_audio == tuple(bool(g[0] == 0) for g in grid) == (False, True)
    kinds = [False, True]  # tower_costs' kinds: the vision tower's inputs, then the audios
    dealt = _ranks_inputs(planned, [(None, [1.0], [1.0], kind) for kind in kinds], planned.images.batch_audio)
    plan = [[kinds[k] for k, inputs in enumerate(own) for _ in inputs] for own in dealt]
    assert plan == run == [[False], [True]]
    alone = [(None, [1.0], [1.0], False)]  # one input, fewer than the ranks: every rank runs it, as the run's rule
    assert _ranks_inputs(planned, alone, ()) == [[[0]], [[0]]] and rank_inputs([7], 2) == [[0], [0]]
    assert tower_costs(planned).images == 1


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])  # 9-10 s each
def test_tiled_layers_hold_nothing_of_their_runs_to_the_towers_backward(gemma4_audio, tmp_path, dtype: str) -> None:
    """Gemma 4's image rows under memory.tiled_layers: the step peaks in the tower's backward, after the language
    model's, and the tiled step there holds what the untiled one holds. Before, each tiled layer's autograd node kept
    its run after its backward until the whole graph went (memory/tiled_layers.py): the keys and values its tiles'
    recompute wrote into transformers' `shared_kv_states`, its per-layer inputs' gradients; the traced step 311,296 B
    (fp32) over the untiled one, 0.64% over its plan, which frees them with the layers' backward."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.trace import trace_image_step

    data = write_rows(tmp_path, CHATS["image"])
    configs = {tiled: load_config(None, given(gemma4_audio, data, dtype) + [f"memory.tiled_layers={tiled}"])
               for tiled in ("false", "true")}
    peaks = {tiled: trace_image_step(cfg).peak_bytes for tiled, cfg in configs.items()}
    assert peaks["true"] == peaks["false"] <= plan_config(configs["true"], 1).tensor_bytes


TRACED_ROWS = [("audio", "fp32", 1, False), ("audio", "bf16", 1, False), ("both", "fp32", 1, False),
               ("both", "bf16", 1, False), ("image", "fp32", 1, False), ("audio", "fp32", 2, False),
               ("both", "fp32", 2, False), ("both", "bf16", 2, False), ("audio", "fp32", 1, True),
               ("audio", "bf16", 1, True)]
"""(rows, train.dtype, cp, lora.enabled): with LoRA the towers are traced with their adapters, whose frozen layers
keep no input for a weight gradient and whose first layers take no input gradient (before, traced trained whole: 30.6%
over in fp32), and one rank's bf16 run under autocast (before, traced in fp32: 47.8% over); image and audio rows at
cp=2 in bf16, where each rank's towers read their rows of FSDP2's bf16 cast of the pixels (before, traced on fp32
pixels copied in fp32 before the cast: 4.80% over)."""


# measured on the shared 2-core machine: 67-187 s wall a case at load 8-12 (79 CPU s for the five cp=1 cases); at load
# 1: cp=1 ~10 CPU s, cp=2 23 s wall (31 CPU s); image and audio rows at cp=2 (the step's inputs dealt together, one
# rank each): 170 s wall at load 10 (57 CPU s), in bf16 74 s wall at load 3
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chats, dtype, cp, lora", TRACED_ROWS)
def test_the_plan_of_an_audio_row_is_the_traced_steps(gemma4_audio, tmp_path, chats: str, dtype: str, cp: int,
                                                      lora: bool) -> None:
    from test_plan_media import _traced_rank

    from longfit.bench.cp import run_degree
    from longfit.plan.analytic import plan_config

    overrides = given(gemma4_audio, write_rows(tmp_path, CHATS[chats]), dtype) + [f"parallel.cp={cp}",
                                                                                 f"lora.enabled={str(lora).lower()}"]
    traced = max(rank["peak"] for rank in run_degree(_traced_rank, cp, {"overrides": overrides}))
    analytic = plan_config(load_config(None, overrides), cp).tensor_bytes
    under, over = SAFE_BAND
    assert under <= analytic / traced - 1 <= over, (analytic, traced)
