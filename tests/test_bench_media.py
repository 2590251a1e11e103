"""`longfit bench media` (#54): an image-heavy row's per-rank peak memory at cp=1 and cp=2, the towers' share and the
language model's, written under the folder it is given; its arguments checked before any rank starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_media import qwen_images  # noqa: E402,F401  (the tiny Qwen3.5 wrapper fixture)

from longfit.cli import main  # noqa: E402


@pytest.mark.parametrize("arguments, message", [
    (["--image-size", "448"], "--image-size '448': give HEIGHTxWIDTH"),
    (["--images", "1"], "--images 1: give at least one image per rank of --cp 1,2"),
    (["--short-len", "512"], "--short-len 512 must be below --seq-len 512"),
    ([], "the llama checkpoint's image rows cannot be trained yet"),
])
def test_bad_arguments_are_one_line_before_any_rank_starts(tmp_path, capsys, arguments, message) -> None:
    argv = ["bench", "media", "--model", "llama-tiny", "--seq-len", "512", "--short-len", "256", "--out",
            str(tmp_path), *arguments]
    assert main(argv) != 0
    assert f"longfit: error: {message}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow  # three gloo processes building the wrapper, four steps each
@pytest.mark.timeout(900)
def test_the_report_deals_the_images_over_the_ranks(qwen_images, tmp_path) -> None:  # noqa: F811
    assert main(["bench", "media", "--model", str(qwen_images), "--images", "4", "--image-size", "64x64",
                 "--seq-len", "512", "--short-len", "256", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "media_memory.json").read_text())
    assert [r["cp"] for r in results] == [1, 2]
    one, two = (r["ranks"] for r in results)
    assert one[0]["images"] == 4 and [rank["images"] for rank in two] == [2, 2]  # four equal images, dealt
    assert sum(rank["patches"] for rank in two) == one[0]["patches"]
    assert one[0]["image_tokens"] == 4 * 4  # 16 patches an image, merged 2 x 2
    assert all(r["peak"] > 0 and r["towers"] > 0 for r in results)
    report = (tmp_path / "media_memory.md").read_text()
    assert "towers x cp / cp=1" in report and len((tmp_path / "data" / "rows.jsonl").read_text().splitlines()) == 1
