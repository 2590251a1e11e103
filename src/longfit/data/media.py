"""Chat rows with images in them (#54): reading, checking and packing them.

A `messages` row whose message contents are lists of parts in the shape transformers' chat templates and processors
take -- `{"type": "text", "text": ...}`, `{"type": "image", "path": ...}` -- becomes a document whose tokens hold
each image's placeholder tokens and whose `media` holds the image's pixels:
- the checkpoint's own chat template renders the conversation (an image part becomes the family's placeholder, e.g.
  Qwen's `<|vision_start|><|image_pad|><|vision_end|>`), and the loss mask is that of any chat (assistant turns only,
  `longfit.data.documents.DocumentEncoder.chat`);
- the checkpoint's own image processor (its Pillow backend, `*ImageProcessorPil`: torchvision is not needed, except by
  Llama 4's, `MediaReader.unavailable`) resizes and patches each image, and each placeholder is repeated as many times
  as the image has tokens, as the family's processor does (`MediaSpec.tokens`; Gemma 3's newlines and image markers
  around them, Pixtral's row breaks between them, Llama 4's tiles with their separators: `MediaSpec`), never a
  target.

A relative path is relative to the folder of the .jsonl file that names it (LLaMA-Factory's `media_dir` default).
A missing or unreadable image is one `longfit: error:` line naming the file, row and fix, raised before the first
step (`check_media`: every row's images are opened, headers only, when the data is opened).

Packing (`longfit.data.packing`): a chat with images is never split between rows (`data.long_chats=split` is refused
for them), so an image is never cut; a chat with images longer than `seq_len` is cut by `data.long_chats` (keep_end,
truncate) only where the cut leaves every image whole (`fit_media_chat`: the window's edge moves to the image's edge,
the images outside it are left out with their pixels), or dropped.

A video part (`{"type": "video", "path": ...}`: a folder of frames or a file PyAV decodes) is read by the checkpoint's
video processor and placeholder rule (`longfit.data.video`): one item per temporal patch of frames, cut or left out
only together (`MediaItem.unit`).

An audio part (`{"type": "audio", "path": ...}`: a file PyAV decodes; Gemma 4's checkpoints with an audio tower) is
read by the checkpoint's feature extractor and placeholder rule (`longfit.data.audio`): one item of its log-mel
frames, its token type `AUDIO`, never cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from longfit.data.documents import DataError

TEXT, IMAGE, VIDEO, AUDIO = 0, 1, 2, 3  # token types, as transformers' `mm_token_type_ids`
MEDIA_PARTS = ("image", "video", "audio")


@dataclass(frozen=True)
class MediaSpec:
    """What reading image rows needs of a checkpoint (made by `longfit.models.media` from its config)."""

    image_token_id: int
    video_token_id: int | None
    merge_size: int
    """Patches merged into one token along each side (Qwen's `spatial_merge_size`): tokens = patches / merge_size^2."""
    placeholder_id: int | None = None
    """The token the chat template writes for an image part, where it is not `image_token_id` (Gemma 3's
    `<start_of_image>`)."""
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    """The tokens the family's processor writes before and after an image's `image_token_id`s in the placeholder's
    place (Gemma 3's "\n\n<start_of_image>" and "<end_of_image>\n\n")."""
    tokens_per_image: int | None = None
    """Every image's tokens, where the family fixes them (Gemma 3's `mm_tokens_per_image`): its grid is then
    (1 + crops, 1, tokens_per_image) with `merge_size` 1, and the image processor gives one pixel tensor per image and
    per pan-and-scan crop of it (the processor's `num_crops`; `layout` then places them)."""
    row_break: tuple[int, int] | None = None
    """(break, end) token ids where an image's tokens are its rows of merged patches, each row followed by the break
    token and the last by the end token (Pixtral's `[IMG_BREAK]`, `[IMG_END]`): its grid is (1, patch rows, patch
    columns) from the processor's `image_sizes` (`patch_size` pixels a patch), one pixel tensor per image."""
    patch_size: int = 0
    processor_kwargs: tuple[tuple[str, object], ...] = ()
    """What the family's processor passes its image processor (Pixtral: resize to whole merged patches)."""
    size_tokens: Callable[[int, int], int] | None = None
    """An image's tokens from its (height, width), breaks included, where the image processor has no
    `get_number_of_image_patches` (Pixtral's and Gemma 4's resize rules, Llama 4's canvas of tiles)."""
    patch_positions: bool = False
    """Whether the image processor gives each image's patches padded to its patch budget, (I, max_patches, p*p*C),
    with their (x, y) positions in `image_position_ids` ((-1, -1) on padding; Gemma 4): an image's pixels are then its
    padded (1, max_patches, p*p*C) and its grid (1, patch rows, patch columns), `merge_size` the pooling kernel."""
    tiles: bool = False
    """Whether the image processor cuts each image into tiles of the tower's size (Llama 4): its grid is then
    (1, tile rows, tile columns) from the processor's `aspect_ratios`, its pixels its tiles (T, C, S, S) row by row
    and, when there are several, the whole image resized to one more tile after them."""
    layout: Callable[[torch.Tensor], np.ndarray] | None = None
    """An image's tokens from its grid where the family's processor writes its `image_token_id`s among markers
    (Llama 4's tile separators, `Llama4Processor._prompt_split_image`): only the `image_token_id`s take embeddings."""

    def tokens(self, grid_thw: torch.Tensor) -> int:
        """The image's placeholder tokens: its patch grid over the merged patches (Qwen3VLProcessor's rule)."""
        return int(grid_thw.prod()) // self.merge_size**2

    def grids(self, processed) -> torch.Tensor:
        """(I, 3) the grids of the images an image processor's output `processed` holds."""
        if self.row_break is not None:
            return torch.tensor([[1, h // self.patch_size, w // self.patch_size] for h, w in processed["image_sizes"]])
        if self.tiles:
            return torch.tensor([[1, rows, columns] for rows, columns in processed["aspect_ratios"].tolist()])
        if self.patch_positions:
            real = processed["image_position_ids"].amax(dim=1) + 1  # (I, 2): columns, rows
            return torch.stack([torch.ones_like(real[:, 0]), real[:, 1], real[:, 0]], dim=1)
        if self.tokens_per_image is None:
            return processed["image_grid_thw"]
        # Gemma 3's pan-and-scan: an image's crops follow it in pixel_values, images of its part (1 + crops, 1, tokens)
        crops = processed.get("num_crops", [0] * len(processed["pixel_values"]))
        return torch.tensor([[1 + int(n), 1, self.tokens_per_image] for n in crops])

    def pixel_rows(self, grid_thw: torch.Tensor) -> int:
        """The rows of the image processor's `pixel_values` an image of `grid_thw` takes."""
        if self.tiles:
            tiles = int(grid_thw[1] * grid_thw[2])
            return tiles + (tiles > 1)  # the global tile
        if self.tokens_per_image is not None:
            return int(grid_thw[0])  # the image and its pan-and-scan crops (Gemma 3)
        whole = self.row_break is not None or self.patch_positions
        return 1 if whole else int(grid_thw.prod())


@dataclass(frozen=True)
class MediaReader:
    """How a checkpoint reads image parts: its placeholder rule and its own image processor (Pillow backend)."""

    spec: MediaSpec
    image_processor: object
    pixels: bool = True
    """False: read the images' token counts from their headers only, no pixels decoded or processed (what counting an
    epoch's rows needs: `longfit.data.packing.count_epoch`); the items then carry no patches."""
    video: object = None
    """How the checkpoint reads video parts (`longfit.data.video.VideoReader`); None: `no_video` says why not."""
    no_video: str = ("this checkpoint has no video processor (video_preprocessor_config.json beside its "
                     "preprocessor_config.json); give the frames as image parts")
    """Why a video part cannot be read, when `video` is None: the checkpoint lacks its video processor, or its
    family's videos are not read (`longfit.models.media.media_reader`)."""
    audio: object = None
    """How the checkpoint reads audio parts (`longfit.data.audio.AudioReader`); None: `no_audio` says why not."""
    no_audio: str = ("this checkpoint has no audio tower and feature extractor (Gemma 4's smaller checkpoints have "
                     "them); drop the audio parts")
    unavailable: str | None = None
    """Why this checkpoint's images cannot be read here (a package its image processor needs, and the fix), its
    `image_processor` then None: its text rows train, and its first image part is refused with it (`available`)."""

    def sampled(self, data) -> MediaReader:
        """This reader with the run's video sampling (`data.video_fps`, `data.video_max_frames`)."""
        if self.video is None:
            return self
        return replace(self, video=self.video.sampled(data.video_fps, data.video_max_frames))

    def videos(self, path: Path):
        """The video reader, or one error naming the file and why its video parts cannot be read (`no_video`)."""
        if self.video is None:
            raise DataError(f"video {path}: {self.no_video}")
        return self.video

    def audios(self, path: Path):
        """The audio reader, or one error naming the file and why its audio parts cannot be read (`no_audio`)."""
        if self.audio is None:
            raise DataError(f"audio {path}: {self.no_audio}")
        return self.audio

    def available(self, path: Path) -> None:
        """One error naming the image at `path` when this checkpoint's images cannot be read here (`unavailable`)."""
        if self.unavailable is not None:
            raise DataError(f"image {path}: {self.unavailable}")

    def image_tokens(self, path: Path) -> int:
        """The placeholder tokens of the image at `path`, from its header's size (no pixels decoded): the image
        processor's patches after its resize, merged."""
        self.available(path)
        height, width = image_size(path)
        if self.spec.size_tokens is not None:
            return self.spec.size_tokens(height, width)
        if self.spec.tokens_per_image is not None:
            return self.spec.tokens_per_image
        return self.image_processor.get_number_of_image_patches(height, width, {}) // self.spec.merge_size**2


def check_media_rows(rows, reader: MediaReader, seq_len: int) -> int:
    """Every image and video of `rows` ((where, folder, messages) of the chats with media parts, `media_paths`)
    exists, opens and, all of a row's together, fits in a row of `seq_len` tokens; one error line naming the file or
    row and the fix otherwise. Before the first step: headers only, milliseconds an image or video. Returns the images
    and videos checked."""
    checked = 0
    markers = len(reader.spec.prefix) + len(reader.spec.suffix)  # kept or left out with each image (`MediaItem.unit`)
    for where, folder, messages in rows:
        tokens, kinds = 0, set()
        try:
            for kind, path in media_paths(messages, folder):
                if kind == "audio":
                    tokens += reader.audios(path).tokens(path) + 2  # its begin and end markers
                else:
                    tokens += (reader.videos(path).tokens(path) if kind == "video"
                               else reader.image_tokens(path) + markers)
                kinds.add(kind)
                checked += 1
        except DataError as e:
            raise DataError(f"{where}: {e}") from e
        if tokens > seq_len:
            what, fix = " and ".join(f"{k}s" for k in sorted(kinds)), []
            if "image" in kinds:
                fix.append("lower the image processor's max_pixels (its preprocessor_config.json)")
            if "video" in kinds:
                fix.append("sample fewer frames (data.video_fps, data.video_max_frames)")
            if "audio" in kinds:
                fix.append("cut the audio shorter")
            uncut = " or ".join({"image": "an image", "video": "a video", "audio": "an audio"}[k] for k in sorted(kinds))
            raise DataError(f"{where}: its {what} take {tokens} tokens, more than a row of seq_len={seq_len} holds "
                            f"({uncut} is never cut): raise seq_len, {', '.join(fix)} or drop that row")
    return checked


@dataclass
class MediaItem:
    """One image of a document: its processed patches and where its tokens lie in the document."""

    kind: int  # IMAGE, VIDEO or AUDIO
    pixel_values: torch.Tensor  # (P, C*T*p*p) the image processor's patches, (1, C, h, w) a whole image,
    # (1, max_patches, p*p*C) its padded patches (`MediaSpec.patch_positions`) or (1, frames, mel bins) an audio's
    # features (`longfit.data.audio`)
    grid_thw: torch.Tensor  # (3,) long (zeros when only counted)
    start: int  # its first placeholder token, in document coordinates
    length: int  # its placeholder tokens
    unit: tuple[int, int] | None = None
    """(start, end) of the tokens kept or left out together with it: a video's whole placeholder, its other temporal
    patches and timestamps included (`longfit.data.video`); None: its own tokens."""

    row_width: int = 0
    """0: every token of [start, start + length) takes an embedding; else rows of `row_width` image tokens, each
    followed by one break token that does not (Pixtral, `MediaSpec.row_break`)."""
    offsets: torch.Tensor | None = None
    """The offsets in [0, length) of the tokens that take embeddings, where the family's layout places them among
    markers (`MediaSpec.layout`); None: `row_width`'s rule."""

    @property
    def bounds(self) -> tuple[int, int]:
        return self.unit or (self.start, self.start + self.length)

    def shifted(self, offset: int) -> MediaItem:
        unit = None if self.unit is None else (self.unit[0] + offset, self.unit[1] + offset)
        return replace(self, start=self.start + offset, unit=unit)

    def embedded(self) -> torch.Tensor:
        """The offsets in [0, length) of the tokens that take the image's embeddings, in order."""
        if self.offsets is not None:
            return self.offsets
        offsets = torch.arange(self.length)
        return offsets if not self.row_width else offsets[offsets % (self.row_width + 1) < self.row_width]


def has_media(messages) -> bool:
    """Whether a chat's contents hold image or video parts (a list content with a part of that type)."""
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS
                                                          for p in m["content"]) for m in messages)


def media_paths(messages, folder: Path) -> list[tuple[str, Path]]:
    """(type, path) of every image and video part of a chat, in order; relative paths from `folder`."""
    found = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                path = part.get("path") or part.get(part["type"])
                if not isinstance(path, str):
                    raise DataError(f"an {part['type']} part needs a local file in `path`, got {part!r:.120}")
                found.append((part["type"], (folder / path).expanduser()))
    return found


def missing_file(path: Path, kind: str) -> DataError:
    return DataError(f"{kind} {path} does not exist; fix the path (a relative path is relative to the folder of the "
                     f".jsonl file) or drop that row")


def _unreadable(path: Path, error: Exception) -> DataError:
    return DataError(f"image {path} cannot be read ({error}); re-save it as PNG or JPEG or drop that row")


def open_image(path: Path):
    """The image at `path` as RGB, or one error naming the file and the fix."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise missing_file(path, "image")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise _unreadable(path, e) from e


def image_size(path: Path) -> tuple[int, int]:
    """(height, width) of the image at `path` from its header (no pixels decoded), or one error naming the file."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise missing_file(path, "image")
    try:
        with Image.open(path) as image:
            width, height = image.size
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise _unreadable(path, e) from e
    return height, width


class MediaChatEncoder:
    """Turns a chat with image and video parts into (ids, loss_mask, media items) with a checkpoint's tokenizer
    (through `chat`, the text encoder's chat rendering, and `tokenizer` for the videos' timestamps), its image and
    video processors and its placeholder rules."""

    def __init__(self, chat, reader: MediaReader, tokenizer):
        self.chat = chat
        self.reader = reader
        self.spec = reader.spec
        self.tokenizer = tokenizer

    def encode(self, messages, folder: Path) -> tuple[np.ndarray, np.ndarray, list[MediaItem]]:
        """(ids, loss_mask, media items) of a chat whose media paths are relative to `folder`."""
        parts = media_paths(messages, folder)
        for kind, path in parts:
            if kind == "audio":
                self.reader.audios(path)  # a checkpoint without audio: one line naming the file, before rendering
        ids, mask = self.chat(messages)
        written = {self.spec.placeholder_id or self.spec.image_token_id: "image"}
        if self.spec.video_token_id is not None:
            written[self.spec.video_token_id] = "video"
        if self.reader.audio is not None:
            written[self.reader.audio.audio_token_id] = "audio"
        placeholders = np.flatnonzero(np.isin(ids, list(written)))
        kinds = [written[int(ids[at])] for at in placeholders]
        if kinds != [kind for kind, _ in parts]:
            wrote, wanted = (", ".join(f"{names.count(k)} {k}" for k in MEDIA_PARTS)
                             for names in (kinds, [kind for kind, _ in parts]))
            raise DataError(f"the chat template wrote {wrote} placeholders for the row's {wanted} parts; the "
                            "checkpoint's chat template must render image, video and audio parts")
        if not parts:
            return ids, mask, []
        images = iter(self._images([path for kind, path in parts if kind == "image"]))
        pieces_ids, pieces_mask, items, last, offset = [], [], [], 0, 0
        for at, (kind, path) in zip(placeholders, parts):
            start, end = at, at + 1
            if kind == "audio":
                tokens, placed = self.reader.audio.encode(path, self.reader.pixels)
            elif kind == "image":
                tokens, placed = next(images)
            else:
                tokens, placed = self._video(path)
                start, end = self.reader.videos(path).template_span(ids, at)
            pieces_ids += [ids[last:start], tokens]
            pieces_mask += [mask[last:start], np.zeros(len(tokens), dtype=bool)]
            offset += start - last
            items += [item.shifted(offset) for item in placed]
            offset += len(tokens)
            last = end
        pieces_ids.append(ids[last:])
        pieces_mask.append(mask[last:])
        return np.concatenate(pieces_ids), np.concatenate(pieces_mask), items

    def _images(self, paths: list[Path]) -> list[tuple[np.ndarray, list[MediaItem]]]:
        """(tokens, [its item]) of each image: the family's prefix, its placeholder tokens (Pixtral's rows with their
        break tokens), the family's suffix; the item's start is relative to these tokens."""
        if not paths:
            return []
        self.reader.available(paths[0])
        if self.reader.pixels:
            processed = self.reader.image_processor(images=[open_image(path) for path in paths], return_tensors="pt",
                                                    **dict(self.spec.processor_kwargs))
            grids = self.spec.grids(processed)  # (I, 3)
            counts = [self.spec.tokens(grid) for grid in grids]
            patches = torch.split(processed["pixel_values"], [self.spec.pixel_rows(g) for g in grids])
            if self.spec.row_break is not None:  # each image without the padding to the conversation's largest
                patches = [p[..., : g[1] * self.spec.patch_size, : g[2] * self.spec.patch_size]
                           for p, g in zip(patches, grids)]
        else:  # counting rows: the same token counts from the headers (the processor's resize rule)
            counts = [self.reader.image_tokens(path) for path in paths]
            grids, patches = torch.zeros(len(paths), 3, dtype=torch.long), [torch.zeros(0, 0)] * len(paths)
        prefix, suffix = (np.array(t, dtype=np.int64) for t in (self.spec.prefix, self.spec.suffix))
        encoded = []
        for count, grid, pixels in zip(counts, grids, patches):
            tokens, width, offsets = np.full(count, self.spec.image_token_id, dtype=np.int64), 0, None
            if self.spec.row_break is not None and self.reader.pixels:
                tokens, width = self._rows_with_breaks(grid), int(grid[2]) // self.spec.merge_size
            if self.spec.layout is not None and self.reader.pixels:
                tokens = self.spec.layout(grid)
                offsets = torch.from_numpy(np.flatnonzero(tokens == self.spec.image_token_id))
            image = np.concatenate([prefix, tokens, suffix])
            unit = (0, len(image)) if len(image) > len(tokens) else None  # the family's markers go with the image
            encoded.append((image, [MediaItem(IMAGE, pixels, grid, len(prefix), len(tokens), unit, width, offsets)]))
        return encoded

    def _video(self, path: Path) -> tuple[np.ndarray, list[MediaItem]]:
        def tokenize(texts: list[str]) -> list[list[int]]:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

        return self.reader.videos(path).encode(path, tokenize, self.reader.pixels)

    def _rows_with_breaks(self, grid: torch.Tensor) -> np.ndarray:
        """An image's tokens as Pixtral's processor writes them (`replace_image_token`): each row of merged patches
        its image tokens then the break token, the last break the end token."""
        rows, width = (int(n) // self.spec.merge_size for n in grid[1:])
        tokens = np.tile(np.append(np.full(width, self.spec.image_token_id, dtype=np.int64), self.spec.row_break[0]),
                         rows)
        tokens[-1] = self.spec.row_break[1]
        return tokens


def fit_media_chat(ids: np.ndarray, mask: np.ndarray, media: list[MediaItem], start: int, end: int):
    """The window [start, end) of a chat moved inward until no image or video straddles its edges (`MediaItem.bounds`),
    and the items inside it (their starts in window coordinates); None when nothing is left."""
    for item in media:
        first, last = item.bounds
        if first < start < last:
            start = last
        if first < end < last:
            end = first
    if end <= start:
        return None
    kept = [item.shifted(-start) for item in media if start <= item.bounds[0] and item.bounds[1] <= end]
    return ids[start:end], mask[start:end], kept


def _padded_cat(pixels: list[torch.Tensor]) -> torch.Tensor:
    """The images' pixel tensors as one: patch rows (P, C*T*p*p) concatenated; whole images (1, C, h, w) of
    different sizes padded with zeros below and right to the largest (Pixtral's `_pad_for_batching`: its tower reads
    each image's own size, `image_sizes`); Gemma 4's padded patches (1, max_patches, p*p*C) and audio features
    (1, frames, mel bins) padded with zeros to the longest and widest (its encoder reads each one's own part)."""
    if pixels[0].dim() == 2:
        return torch.cat(pixels)
    height, width = max(p.shape[-2] for p in pixels), max(p.shape[-1] for p in pixels)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in pixels])


@dataclass
class MediaBatch:
    """The images of a packed batch: every image of its rows (on every context-parallel rank alike) and, per token,
    which image embedding it takes. `embedding_index` and `positions` are cut with the tokens under context
    parallelism (`longfit.parallel.batch.shard_batch`); the rest stays whole."""

    pixel_values: torch.Tensor  # (P, C*T*p*p) every image's patches, or (I, C, H, W) whole images; in row order
    grid_thw: torch.Tensor  # (I, 3) long
    token_types: torch.Tensor  # (B, L) int: TEXT, IMAGE or VIDEO per token of the whole rows
    embedding_index: torch.Tensor  # (B, L) long: the token's row in the batch's image embeddings, -1 on text
    item_starts: tuple[tuple[int, int], ...]  # (row, start) of each image, in order
    documents: object = None  # the batch's DocumentLayout (rows whole)
    positions: torch.Tensor | None = None
    """The family's position ids (4, B, L), set on the whole rows before the split (`MediaEncoder.rope_positions`)."""

    @classmethod
    def of_rows(cls, rows: list[list[MediaItem]], length: int, documents) -> MediaBatch:
        """The batch of `rows`' images (items with starts in row coordinates) over rows of `length` tokens."""
        token_types = torch.zeros(len(rows), length, dtype=torch.int32)
        embedding_index = torch.full((len(rows), length), -1, dtype=torch.long)
        pixels, grids, starts, taken = [], [], [], 0
        for b, items in enumerate(rows):
            for item in sorted(items, key=lambda i: i.start):
                positions = item.start + item.embedded()
                token_types[b, positions] = item.kind
                embedding_index[b, positions] = torch.arange(taken, taken + len(positions))
                taken += len(positions)
                pixels.append(item.pixel_values)
                grids.append(item.grid_thw)
                starts.append((b, item.start))
        width = pixels[0].shape[1] if pixels else 0
        return cls(_padded_cat(pixels) if pixels else torch.zeros(0, width),
                   torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long),
                   token_types, embedding_index, tuple(starts), documents)

    @property
    def images(self) -> int:
        return len(self.item_starts)

    def items_in(self, row: int, start: int, end: int) -> int:
        """The images of row `row` whose tokens start in [start, end)."""
        return sum(1 for b, s in self.item_starts if b == row and start <= s < end)

    def sharded(self, local) -> MediaBatch:
        """This context-parallel rank's batch: the per-token tensors cut by `local` ((B, L) -> (B, L / cp))."""
        positions = None if self.positions is None else torch.stack([local(p) for p in self.positions])
        return MediaBatch(self.pixel_values, self.grid_thw, self.token_types, local(self.embedding_index),
                          self.item_starts, self.documents, positions)

    def to(self, device, non_blocking: bool = False) -> MediaBatch:
        def move(x):
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return MediaBatch(move(self.pixel_values), move(self.grid_thw), self.token_types, move(self.embedding_index),
                          self.item_starts, self.documents, move(self.positions))
