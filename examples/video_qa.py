"""Question answering on long videos (#54): the data of examples/qwen3_5_video_qa.yaml.

Each row is a clip (an MP4 file, or a folder of frame images for every fourth row) in which the key shows on the
frames of one second: "At which second does the key show, and what is it?". Written with Pillow and PyAV, seeded;
your own videos are named in `video` parts as they are (MP4, MKV, WebM, ...: whatever PyAV decodes), or as folders of
frames extracted beforehand (e.g. `ffmpeg -i talk.mp4 -vf fps=2 frames/talk/%05d.png`).

    python examples/video_qa.py                 # runs/video-qa/: clips/ and rows.jsonl
    python examples/video_qa.py --tiny-model    # and runs/qwen3_5-video-tiny: a tiny Qwen3.5 wrapper for the CPU

The tiny wrapper is examples/document_qa.py's (transformers' default Qwen3.5 config shrunk, random weights) with
Qwen3.5's own video processor (`Qwen3VLVideoProcessor`: 16-pixel patches merged 2 x 2, two frames a temporal patch,
2 frames a second) capped at 64 x 64 x 16 pixels a video.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from document_qa import TINY_TEXT, TINY_VISION, write_tiny_qwen3_5

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VL_VIDEO = "transformers.models.qwen3_vl.video_processing_qwen3_vl"
TINY_VIDEO = dict(patch_size=16, temporal_patch_size=2, merge_size=2, fps=2, min_frames=4, max_frames=16,
                  size={"shortest_edge": 32 * 32 * 2, "longest_edge": 64 * 64 * 16}, cap_pixels_per_frame=False)
"""Qwen3.5's video processor settings but its pixel budget (`size`: pixels over all of a video's frames)."""


def write_clip(path: Path, frames, fps: int) -> Path:
    """`frames` (a list of RGB arrays) as an H.264 MP4 at `fps` frames a second (PyAV)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_clips(folder: Path, videos: int, seconds: int, fps: int = 4, seed: int = 0) -> Path:
    """`videos` rows of `seconds`-long clips, the key on the frames of one second; returns the rows' JSONL file."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for video in range(videos):
        key_second, key = rng.randrange(seconds), f"{rng.randrange(10_000):04d}"
        frames = []
        for index in range(seconds * fps):
            image = Image.new("RGB", (128, 96), (20 + 3 * index % 200, 40, 90))
            draw = ImageDraw.Draw(image)
            draw.ellipse((index * 4 % 112, 30, index * 4 % 112 + 16, 46), fill="yellow")  # something moves
            if index // fps == key_second:
                draw.text((8, 70), f"KEY {key}", fill="white")
            frames.append(np.asarray(image))
        if video % 4 == 3:  # a folder of frames, taken at the video processor's rate (2 a second)
            name = f"clips/video{video:03d}"
            (folder / name).mkdir(exist_ok=True)
            for index, frame in enumerate(frames[:: fps // 2]):
                Image.fromarray(frame).save(folder / name / f"{index:05d}.png")
        else:
            name = f"clips/video{video:03d}.mp4"
            write_clip(folder / name, frames, fps)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "video", "path": name},
                                         {"type": "text", "text": "At which second does the key show, and what is it?"}]},
            {"role": "assistant", "content": f"At second {key_second}: the key is {key}."}]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_tiny_qwen3_5_video(path: Path, text: dict = TINY_TEXT, vision: dict = TINY_VISION, seed: int = 0,
                             model_type: str = "qwen3_5", video: dict = TINY_VIDEO) -> Path:
    """examples/document_qa.py's tiny wrapper with Qwen3.5's video processor (`video`: its settings) beside its image
    processor. The class is imported from its module: transformers' top level offers a placeholder without
    torchvision, but the class itself is written and read without it."""
    import importlib

    write_tiny_qwen3_5(path, text, vision, seed, model_type)
    importlib.import_module(QWEN3_VL_VIDEO).Qwen3VLVideoProcessor(**video).save_pretrained(path)
    return path


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--out", type=Path, default=ROOT / "runs" / "video-qa")
    cli.add_argument("--videos", type=int, default=48)
    cli.add_argument("--seconds", type=int, default=8)
    cli.add_argument("--tiny-model", action="store_true", help="also write runs/qwen3_5-video-tiny")
    opts = cli.parse_args()
    print(write_clips(opts.out, opts.videos, opts.seconds))
    if opts.tiny_model:
        print(write_tiny_qwen3_5_video(ROOT / "runs" / "qwen3_5-video-tiny"))


if __name__ == "__main__":
    main()
