"""Video parts of chat rows (#54): frames, their patches and their placeholder tokens, as the checkpoint's own video
processor and processor make them, where torchvision is not installed.

A `{"type": "video", "path": ...}` part is a video file PyAV decodes, or a folder of frame images (in name order).
- Frames are sampled as transformers samples them (the video processor's `sample_frames`: `fps` frames a second,
  at least `min_frames`, at most `max_frames`, evenly spaced over the video; `data.video_fps` and
  `data.video_max_frames` override the checkpoint's `video_preprocessor_config.json`, as LLaMA-Factory's
  `video_fps` / `video_maxlen` and ms-swift's `FPS` / `FPS_MAX_FRAMES` do). A folder's frames are taken as already
  sampled at that rate: all of them are kept, evenly thinned to `max_frames`.
- Pixels: the checkpoint's own video processor class runs whole (its resize rule over all the frames together, its
  normalisation and its temporal patching: `temporal_patch_size` frames a patch, the last frame repeated to fill
  one), with the two torchvision kernels it calls replaced (`PillowFrames`): each frame resized by Pillow as the
  `*ImageProcessorPil` image processors resize, and the mean/std normalisation in torchvision's own arithmetic.
  transformers' video processor classes need torchvision only for those two kernels; on a machine with torchvision
  its antialiased uint8 resize may differ from Pillow's by a level on some pixels (the image side has the same
  property: `AutoImageProcessor` takes the Pillow backend here).
- Placeholder: the chat template writes one `<|video_pad|>` for the part; the processor's rule
  (`Qwen3VLProcessor.replace_video_token`, Qwen3.5's) replaces it with, for every temporal patch, its timestamp as
  text (`<1.5 seconds>`: the mean time of the patch's frames), `<|vision_start|>`, the patch's tokens and
  `<|vision_end|>` (from transformers 5.25 the template's own `<|vision_start|>` and `<|vision_end|>` around the
  `<|video_pad|>` go with it: `VideoReader.template_span`). Each temporal patch is one `MediaItem` (its tokens are
  contiguous; the tower's attention never crosses two of them, and `get_rope_index` splits a video's grid into them
  the same way), and all of them share the video's whole placeholder as their `unit`: a row is never cut inside a
  video.

Gemma 4 (`Gemma4VideoReader`) has no temporal patches: each sampled frame is one item, patched by its own
`Gemma4VideoProcessor` (whose module calls torchvision's resize itself: loaded with Pillow's in its place,
`video_processor_class`) and written as `Gemma4Processor.replace_video_token` writes it.

Errors are one line naming the file and the fix (`DataError`): a missing file, no decoder installed (PyAV), a file
that does not decode or has no frame count in its header, folders with no or differently sized frames, fewer frames
than a temporal patch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from longfit.data.documents import DataError
from longfit.data.media import VIDEO, MediaItem, image_size, missing_file, open_image


@lru_cache(maxsize=None)
def pillow_video_processor(video_processor_class: type) -> type:
    """`video_processor_class` (a transformers `BaseVideoProcessor`) with its torchvision kernels done by Pillow and
    torch: the class's own sampling, resize rule, normalisation and patching run unchanged around them (module
    docstring). Its methods call `super().resize` / `self.normalize`, which this mixin answers before
    `TorchvisionBackend` would."""
    from transformers.video_processing_utils import BaseVideoProcessor

    class PillowFrames(BaseVideoProcessor):
        def resize(self, image: torch.Tensor, size, resample=None, **kwargs) -> torch.Tensor:
            """(..., C, H, W) uint8 frames to `size.height` x `size.width`, each frame by Pillow (the Pil image
            processors' resize; torchvision's antialiased resize follows Pillow's filters)."""
            return pillow_resize(image, [size.height, size.width], resample)

        def normalize(self, image: torch.Tensor, mean, std, inplace: bool = False, **kwargs) -> torch.Tensor:
            """torchvision's `normalize` arithmetic: (image - mean) / std per channel, in the image's dtype."""
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return image.sub(mean).div(std)

        def convert_to_rgb(self, video: torch.Tensor) -> torch.Tensor:
            return video  # frames are decoded as RGB (`VideoReader.frames`)

    return type(video_processor_class.__name__, (video_processor_class, PillowFrames), {})


def pillow_resize(frames: torch.Tensor, size, interpolation=None, antialias: bool = True) -> torch.Tensor:
    """(..., C, H, W) uint8 frames resized to `size` (height, width), each frame by Pillow with the `interpolation`
    filter (PIL's resampling number; None: bilinear): torchvision's `functional.resize` as the video processors
    call it."""
    from PIL import Image
    from transformers.image_utils import PILImageResampling

    height, width = size
    resample = PILImageResampling(interpolation if interpolation is not None else PILImageResampling.BILINEAR)
    flat = frames.reshape(-1, *frames.shape[-3:]).permute(0, 2, 3, 1).numpy()  # (N, H, W, C)
    resized = [np.asarray(Image.fromarray(frame).resize((width, height), resample=resample)) for frame in flat]
    out = torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2)  # (N, C, h, w)
    return out.reshape(*frames.shape[:-2], height, width)


def video_processor_class(class_path: str) -> type:
    """The video processor class `class_path` ("module:Class"). A module that calls torchvision's functional kernels
    itself (Gemma 4's resize) names them at import and fails without torchvision: it is then loaded with that name
    (`tvF`) given Pillow's resize (`pillow_resize`), its own code unchanged."""
    import importlib
    import importlib.util
    import sys
    from types import SimpleNamespace

    module, name = class_path.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except NameError:  # a torchvision name read while the module is made
        spec = importlib.util.find_spec(module)
        made = importlib.util.module_from_spec(spec)
        made.tvF = SimpleNamespace(InterpolationMode=int, resize=pillow_resize)
        sys.modules[module] = made  # transformers' docstrings read the class's source file through it
        spec.loader.exec_module(made)
        return getattr(made, name)


def load_video_processor(directory: str, class_path: str):
    """The checkpoint's video processor (`video_preprocessor_config.json`, or the processor config transformers
    falls back to) as its class `class_path` ("module:Class") on Pillow frames; None when the checkpoint has none."""
    cls = pillow_video_processor(video_processor_class(class_path))
    try:
        return cls.from_pretrained(directory, local_files_only=True)
    except OSError:
        return None


@dataclass(frozen=True)
class VideoFrame:
    """One temporal patch of a video: its patches and grid (1, h, w) (none when only counted)."""

    pixel_values: torch.Tensor  # (h*w, C*T*p*p)
    grid_thw: torch.Tensor  # (3,) long


@dataclass(frozen=True)
class VideoReader:
    """How a checkpoint reads video parts: its video processor (on Pillow frames) and its placeholder tokens."""

    processor: object
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    replaces_template_markers: bool = False
    """Whether the processor's expansion also replaces the chat template's `<|vision_start|>` and `<|vision_end|>`
    around the video's token (Qwen3VLProcessor from transformers 5.25, `get_text_with_replacements`: every temporal
    patch carries its own pair, so the template's outer pair is dropped), not the video token alone (before 5.25)."""

    def template_span(self, ids: np.ndarray, at: int) -> tuple[int, int]:
        """(start, end) of the chat template's tokens that the video's expansion replaces, its token at `at`."""
        if not self.replaces_template_markers:
            return at, at + 1
        wrapped = 0 < at < len(ids) - 1 and ids[at - 1] == self.vision_start_token_id and \
            ids[at + 1] == self.vision_end_token_id
        return (at - 1, at + 2) if wrapped else (at, at + 1)

    def sampled(self, fps: float | None, max_frames: int | None) -> VideoReader:
        """This reader with `data.video_fps` / `data.video_max_frames` in place of the processor's (None: its own)."""
        processor = copy.copy(self.processor)
        if fps is not None:
            processor.fps = fps
        if max_frames is not None:
            processor.max_frames = max_frames
        return replace(self, processor=processor)

    @property
    def temporal_patch_size(self) -> int:
        return self.processor.temporal_patch_size

    def metadata(self, path: Path):
        """The video's `VideoMetadata` from its header (a file) or its frames' headers (a folder), and the sampled
        frames' indices in it (`frames_indices`), as the video processor samples them."""
        metadata = self.header(path)
        metadata.frames_indices = self.processor.sample_frames(metadata)
        if len(metadata.frames_indices) < self.temporal_patch_size:
            raise DataError(f"video {path} gives {len(metadata.frames_indices)} frame(s), fewer than the "
                            f"{self.temporal_patch_size} of one temporal patch; give a longer video or drop that row")
        return metadata

    @property
    def folder_fps(self) -> float:
        """The frame rate of a folder of frames: they are taken as sampled at the processor's rate."""
        return float(self.processor.fps)

    def header(self, path: Path):
        """The video's `VideoMetadata` (frames, rate, size) from its header or its frames' headers."""
        from transformers.video_utils import VideoMetadata

        if path.is_dir():
            frames = sorted(p for p in path.iterdir() if p.is_file())
            if not frames:
                raise DataError(f"video folder {path} holds no frame images; drop that row")
            height, width = image_size(frames[0])
            return VideoMetadata(total_num_frames=len(frames), fps=self.folder_fps, height=height, width=width,
                                 video_backend="frames")
        with _open_video(path) as container:
            stream = container.streams.video[0]
            metadata = VideoMetadata(total_num_frames=int(stream.frames), fps=float(stream.average_rate or 0) or None,
                                     height=stream.height, width=stream.width, video_backend="pyav")
        if not metadata.total_num_frames or not metadata.fps:
            raise DataError(f"video {path} has no frame count or frame rate in its header; re-encode it (H.264 "
                            "MP4) or give it as a folder of frames")
        metadata.duration = metadata.total_num_frames / metadata.fps
        return metadata

    def frames(self, path: Path, metadata) -> np.ndarray:
        """The sampled frames (T, H, W, 3) uint8 RGB."""
        indices = [int(i) for i in metadata.frames_indices]
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file())
            frames = [np.asarray(open_image(files[i])) for i in indices]
            if len({frame.shape for frame in frames}) > 1:
                raise DataError(f"video folder {path} holds frames of different sizes; resize them alike or drop that "
                                "row")
            return np.stack(frames)
        wanted, frames = set(indices), {}
        with _open_video(path) as container:
            try:
                for index, frame in enumerate(container.decode(video=0)):
                    if index in wanted:
                        frames[index] = frame.to_ndarray(format="rgb24")
                    if index >= indices[-1]:
                        break
            except decode_errors() as e:
                raise DataError(f"video {path} cannot be decoded ({e}); re-encode it (H.264 MP4) or give it as a "
                                "folder of frames") from e
        if len(frames) < len(wanted):
            raise DataError(f"video {path} decodes to fewer frames than its header's {metadata.total_num_frames}; "
                            "re-encode it (H.264 MP4) or give it as a folder of frames")
        return np.stack([frames[i] for i in indices])

    def read(self, path: Path, pixels: bool = True) -> tuple[list[tuple[float, int]], list[VideoFrame]]:
        """((timestamp, tokens) of each temporal patch, its patches and grid): the video processor's output cut
        into its temporal patches; with `pixels` False, the same counts from the headers and no patches."""
        metadata = self.metadata(path)
        sampled = len(metadata.frames_indices)
        grid_t = math.ceil(sampled / self.temporal_patch_size)
        merge = self.processor.merge_size ** 2
        if pixels:
            out = self.processor(videos=[self.frames(path, metadata)], video_metadata=[metadata],
                                 do_sample_frames=False, return_tensors="pt")
            grid = out["video_grid_thw"][0]  # (3,)
            frame = grid[1:].prod()
            patches = out["pixel_values_videos"].split(int(frame))  # t-major: the processor's patch order
            frames = [VideoFrame(p, torch.tensor([1, *grid[1:].tolist()])) for p in patches]
            tokens = int(frame) // merge
        else:
            try:
                patches = self.processor.get_num_of_video_patches(sampled, metadata.height, metadata.width)
            except ValueError as e:  # the resize rule's refusals (aspect ratio)
                raise DataError(f"video {path}: {e}; crop it or drop that row") from e
            tokens = patches // grid_t // merge
            frames = [VideoFrame(torch.zeros(0, 0), torch.zeros(3, dtype=torch.long))] * grid_t
        stamps = qwen3_vl_timestamps(metadata.frames_indices, metadata.fps, self.temporal_patch_size)
        return [(stamp, tokens) for stamp in stamps], frames

    def tokens(self, path: Path) -> int:
        """The video's placeholder tokens that take embeddings (headers only), for the row-size check."""
        patches, _ = self.read(path, pixels=False)
        return sum(tokens for _, tokens in patches)

    def stamp_texts(self, patches: list[tuple[float, int]]) -> list[str]:
        """The text before each item's markers: Qwen3VLProcessor's "<t seconds>" (each between two special tokens,
        so tokenised alone as in the processor's whole text)."""
        return [f"<{stamp:.1f} seconds>" for stamp, _ in patches]

    def encode(self, path: Path, tokenize, pixels: bool = True) -> tuple[np.ndarray, list[MediaItem]]:
        """(the placeholder's tokens, one `MediaItem` per item (a temporal patch, Gemma 4's frame), starts in
        placeholder coordinates, each item's `unit` the whole placeholder): the processor's `replace_video_token`
        expansion of the video's placeholder, each item's `stamp_texts` tokenised by `tokenize`, then its markers
        around its video tokens."""
        patches, frames = self.read(path, pixels)
        stamps = tokenize(self.stamp_texts(patches))
        pieces, items, at = [], [], 0
        for stamp, (_, tokens), frame in zip(stamps, patches, frames):
            pieces += [np.asarray(stamp, dtype=np.int64), [self.vision_start_token_id],
                       np.full(tokens, self.video_token_id, dtype=np.int64), [self.vision_end_token_id]]
            at += len(stamp) + 1
            items.append(MediaItem(VIDEO, frame.pixel_values, frame.grid_thw, at, tokens))
            at += tokens + 1
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
        return ids, [replace(item, unit=(0, len(ids))) for item in items]


@dataclass(frozen=True)
class Gemma4VideoReader(VideoReader):
    """Gemma 4's video parts (`Gemma4VideoProcessor`, `Gemma4Processor.replace_video_token`): every sampled frame is
    one tower input as an image is (no temporal patches), resized keeping its aspect ratio to the video processor's
    own patch budget and padded to it; the chat template's one video token becomes, frame by frame, its time as
    mm:ss, a space, `<boi>`, its video tokens, `<eoi>`, the frames joined by spaces. `vision_start_token_id` and
    `vision_end_token_id` hold `<boi>` and `<eoi>`.

    Sampling is the processor's (`num_frames` evenly spaced frames, 32 by default); `data.video_fps` samples that
    many frames a second instead and `data.video_max_frames` caps the count. A video shorter than the count gives
    every frame (the processor refuses it). A folder's frames are taken as sampled at `data.video_fps`, else at the
    24 frames a second Gemma4Processor assumes of frames without a rate, thinned evenly to the count."""

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def folder_fps(self) -> float:
        return float(self.processor.fps or 24)

    def metadata(self, path: Path):
        from transformers.video_utils import default_sample_indices_fn

        metadata = self.header(path)
        processor, total = self.processor, metadata.total_num_frames
        if path.is_dir():  # frames sampled at data.video_fps are all kept; else thinned to the processor's count
            wanted = total if processor.fps is not None else processor.num_frames
        elif processor.fps is not None:
            wanted = max(1, int(total / metadata.fps * processor.fps))
        else:
            wanted = processor.num_frames
        wanted = min(wanted or total, getattr(processor, "max_frames", None) or total, total)
        metadata.frames_indices = default_sample_indices_fn(metadata, num_frames=wanted)
        return metadata

    def read(self, path: Path, pixels: bool = True) -> tuple[list[tuple[float, int]], list[VideoFrame]]:
        """((time in seconds, tokens) of each sampled frame, its padded patches (1, max_patches, p*p*C) and grid
        (1, patch rows, patch columns)); with `pixels` False, the same counts from the header and no patches."""
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        metadata = self.metadata(path)
        processor = self.processor
        kernel = processor.pooling_kernel_size
        if pixels:
            out = processor(videos=[self.frames(path, metadata)], video_metadata=[metadata], do_sample_frames=False,
                            return_tensors="pt")
            real = out["video_position_ids"].amax(dim=1) + 1  # (F, 2): columns, rows
            frames = [VideoFrame(patches.unsqueeze(0), torch.tensor([1, int(rows), int(columns)]))
                      for patches, (columns, rows) in zip(out["pixel_values_videos"], real.tolist())]
            tokens = int(out["num_soft_tokens_per_video"][0])
        else:
            try:
                height, width = get_aspect_ratio_preserving_size(
                    metadata.height, metadata.width, processor.patch_size,
                    processor.max_soft_tokens * kernel**2, kernel)
            except ValueError as e:  # the resize rule's refusals (aspect ratio)
                raise DataError(f"video {path}: {e}; crop it or drop that row") from e
            tokens = (height // processor.patch_size) * (width // processor.patch_size) // kernel**2
            frames = [VideoFrame(torch.zeros(0, 0), torch.zeros(3, dtype=torch.long))] * len(metadata.frames_indices)
        return [(float(stamp), tokens) for stamp in metadata.timestamps], frames

    def stamp_texts(self, patches: list[tuple[float, int]]) -> list[str]:
        """`Gemma4Processor.replace_video_token`'s text between two frames' markers (" mm:ss "), tokenised alone as in
        the processor's whole text."""
        return [(" " if i else "") + f"{int(s // 60):02d}:{int(s % 60):02d} " for i, (s, _) in enumerate(patches)]


def qwen3_vl_timestamps(indices, fps: float, temporal_patch_size: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frames' (`Qwen3VLProcessor.
    _calculate_timestamps`: the indices filled to whole patches with the last one)."""
    indices = [int(i) for i in indices]
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def _open_video(path: Path):
    """The container of the video file at `path` (PyAV), or one error naming the file and the fix."""
    if not path.is_file():
        raise missing_file(path, "video")
    try:
        import av
    except ImportError as e:
        raise DataError(f"video {path} needs a decoder: `pip install av` (PyAV), or give the video as a folder of "
                        "frame images") from e
    try:
        container = av.open(str(path))
    except decode_errors() as e:
        raise DataError(f"video {path} cannot be decoded ({e}); re-encode it (H.264 MP4) or give it as a folder of "
                        "frames") from e
    if not container.streams.video:
        container.close()
        raise DataError(f"video {path} holds no video stream; give a video file or a folder of frames")
    return container


def decode_errors() -> tuple[type[Exception], ...]:
    """PyAV's errors of a file it cannot open or decode (video and audio parts)."""
    import av

    return (av.error.FFmpegError, ValueError, OSError)
