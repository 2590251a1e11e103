"""`longfit eval --positions` on rows with images and videos (#54): the loss by position of a wrapper's image and video
rows, each target counted at the position its RoPE rotates by (Qwen3.5's M-RoPE: an image or a video frame of h x w
tokens takes max(h, w) positions). The reference is transformers' own: the wrapper's eager forward on each
conversation alone with its images (`longfit.check.media.wrapper_step`'s inputs), its per-token cross-entropy bucketed
by the M-RoPE positions its language model is given (`get_rope_index`). The checkpoints and rows are
tests/test_media.py's and tests/test_media_video.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_media import ROWS, image_batch, qwen_images, write_rows  # noqa: E402,F401
from test_media_video import ROWS as VIDEO_ROWS  # noqa: E402
from test_media_video import qwen_video  # noqa: E402,F401
from test_media_video import write_rows as write_video_rows  # noqa: E402

from longfit.cli import main  # noqa: E402

WINDOWS = {"images": 12, "video": 10}
"""--window of each case: buckets of w/4, w/2, w, 2w, ... positions, where the images' and the video's fewer positions
move targets between them (asserted)."""


def wrapper_buckets(checkpoint: Path, batch, edges: list[int]) -> tuple[list[float], list[int]]:
    """(the mean loss, the targets) of each bucket [edges[i], edges[i+1]): the wrapper's eager forward on each
    conversation of `batch` alone, each target at the largest of its M-RoPE positions as the wrapper gives them to its
    language model (its text positions where it gives none: a conversation without images)."""
    import numpy as np
    from transformers import AutoModelForImageTextToText

    from longfit.check.media import _conversation_media
    from longfit.models.media import build_media_encoder

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    encoder, media = build_media_encoder(str(checkpoint)), batch.media
    starts = [0, *np.cumsum(encoder.pixel_rows(media.grid_thw)).tolist()]
    given: list = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: given.append(kwargs.get("position_ids")), with_kwargs=True)
    sums, counts, first = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1), 0
    with torch.no_grad():
        for row, spans in enumerate(batch.documents.rows):
            for start, end in spans:
                count = media.items_in(row, start, end)
                inputs = dict(input_ids=batch.input_ids[row : row + 1, start:end], use_cache=False)
                if count:
                    inputs |= _conversation_media(encoder, media, starts, range(first, first + count), row, start, end)
                    first += count
                logits = model(**inputs).logits[0]
                positions = given.pop()
                rotated = torch.arange(end - start) if positions is None else positions[-3:, 0].amax(0)
                labels = batch.labels[row, start:end]
                losses = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
                for at in (labels != -100).nonzero().flatten().tolist():
                    bucket = max(i for i, edge in enumerate(edges[:-1]) if int(rotated[at]) >= edge)
                    sums[bucket] += float(losses[at])
                    counts[bucket] += 1
    hook.remove()
    return [s / n if n else float("nan") for s, n in zip(sums, counts)], counts


@pytest.mark.parametrize("kind", ["images", "video"])
def test_the_loss_by_position_of_media_rows_is_the_wrappers_at_its_rope_positions(kind, request, tmp_path, capsys,
                                                                                   one_thread) -> None:
    from longfit.eval.positions import position_edges

    if kind == "images":
        checkpoint = request.getfixturevalue("qwen_images")
        conversations, seq_len, rows = ROWS["packed"]
        path = write_rows(tmp_path, conversations)
    else:
        checkpoint = request.getfixturevalue("qwen_video")
        conversations, seq_len, rows = VIDEO_ROWS["packed"]
        path = write_video_rows(tmp_path, conversations)
    assert main(["eval", "--model", str(checkpoint), "--data", str(path), "--seq-len", str(seq_len), "--rows",
                 str(rows), "--positions", "--window", str(WINDOWS[kind]), "--device", "cpu", "--json", "-"]) == 0
    out = capsys.readouterr().out
    got = json.loads(out[out.index("{"):])
    batch = image_batch(checkpoint, path, seq_len, rows)  # the same first rows, as training packs them
    edges = position_edges(seq_len, WINDOWS[kind])
    losses, counts = wrapper_buckets(checkpoint, batch, edges)
    assert [b["tokens"] for b in got["positions"]] == counts
    for bucket, want in zip(got["positions"], losses):
        if bucket["tokens"]:
            assert bucket["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), (bucket, want)
    total = sum(b["loss"] * b["tokens"] for b in got["positions"] if b["tokens"]) / got["tokens"]
    assert total == pytest.approx(got["loss"], rel=1e-6)
    # the premise: bucketed by their text positions, the targets would fall otherwise
    text = torch.bucketize(batch.position_ids[batch.labels != -100], torch.tensor(edges[1:-1]), right=True)
    assert torch.bincount(text, minlength=len(counts)).tolist() != counts
