"""Audio parts of chat rows (#54): Gemma 4's, read as its processor reads them.

A `{"type": "audio", "path": ...}` part is a local audio file PyAV decodes (WAV, FLAC, MP3, an audio stream of a
video container):
- Samples: every channel decoded and resampled by FFmpeg's resampler to the feature extractor's `sampling_rate`
  (16 kHz for Gemma 4), as float32, then averaged over the channels (the mono mix `transformers.audio_utils.load_audio`
  gives, through librosa).
- Features: the checkpoint's own feature extractor (`Gemma4AudioFeatureExtractor`, numpy alone: its log-mel frames
  and their mask, its truncation to `max_length` samples, 30 s, as `Gemma4Processor` calls it). Only the valid frames
  are kept, (1, frames, mel bins): the audio tower masks the others to zeros, which its convolutions' own padding
  equals, and its attention never looks ahead, so an audio's embeddings are the same alone or padded in a batch.
- Placeholder: the chat template writes the audio token once for the part; the processor's rule
  (`Gemma4Processor.replace_audio_token`) replaces it with `<boa>`, one audio token per frame left after the tower's
  two stride-2 convolutions (`tokens`), `<eoa>`. The audio is one `MediaItem` whose `unit` is all of it: a row is never
  cut inside an audio.

Errors are one line naming the file and the fix (`DataError`): a missing file, no decoder installed (PyAV), a file
that does not decode or holds no audio stream, an audio too short for one token or longer than the feature extractor
reads (`kept_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from longfit.data.documents import DataError
from longfit.data.media import AUDIO, MediaItem, missing_file
from longfit.data.video import decode_errors


def subsampled(frames: int) -> int:
    """The audio tokens of `frames` valid feature frames: the tower's two stride-2 convolutions (kernel 3, padding 1),
    each ceil(t / 2) (`Gemma4Processor.replace_audio_token`'s mask arithmetic)."""
    for _ in range(2):
        frames = (frames + 1) // 2
    return frames


@dataclass(frozen=True)
class AudioReader:
    """How a checkpoint reads audio parts: its feature extractor and its placeholder tokens."""

    feature_extractor: object
    audio_token_id: int
    begin_token_id: int
    end_token_id: int

    def samples(self, path: Path) -> np.ndarray:
        """The audio at `path` as mono float32 samples at the feature extractor's rate."""
        rate = self.feature_extractor.sampling_rate
        with _open_audio(path) as container:  # PyAV's import checked there: a missing decoder is one line
            import av

            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
            chunks = []
            try:
                for frame in container.decode(stream):
                    chunks += [out.to_ndarray() for out in resampler.resample(frame)]  # (channels, n)
                chunks += [out.to_ndarray() for out in resampler.resample(None)]
            except decode_errors() as e:
                raise DataError(f"audio {path} cannot be decoded ({e}); re-encode it (WAV or FLAC) or drop that "
                                "row") from e
        if not chunks:
            raise DataError(f"audio {path} decodes to no samples; re-encode it (WAV or FLAC) or drop that row")
        return np.concatenate(chunks, axis=1).mean(axis=0, dtype=np.float32)  # (n,)

    def features(self, path: Path) -> torch.Tensor:
        """(1, frames, mel bins) the feature extractor's valid frames of the audio at `path`; an audio longer than
        the extractor keeps (it truncates the rest, as the processor calls it) is refused in one line: a row trains on
        all of its audio or not at all."""
        samples, rate = self.samples(path), self.feature_extractor.sampling_rate
        kept = self.kept_samples
        if kept is not None and len(samples) > kept:
            raise DataError(f"audio {path} is {len(samples) / rate:.1f} s, longer than the {kept / rate:g} s the "
                            f"checkpoint's feature extractor reads of an audio (it cuts the rest); split it into parts "
                            f"of at most {kept / rate:g} s or drop that row")
        out = self.feature_extractor([samples], sampling_rate=rate, return_tensors="pt")
        features, mask = out["input_features"][0], out["input_features_mask"][0]  # (T, mel), (T,)
        frames = int(mask.sum())
        if not subsampled(frames):
            raise DataError(f"audio {path} is too short for one audio token; give a longer audio or drop that row")
        return features[:frames].unsqueeze(0)

    @property
    def kept_samples(self) -> int | None:
        """The samples of an audio the feature extractor keeps: its call's `max_length` default, with which the
        processor calls it (Gemma4AudioFeatureExtractor: 480,000, 30 s at 16 kHz); None where it does not cut."""
        import inspect

        parameters = inspect.signature(type(self.feature_extractor).__call__).parameters
        truncates = parameters.get("truncation")
        if truncates is None or truncates.default is not True or "max_length" not in parameters:
            return None
        return parameters["max_length"].default

    def tokens(self, path: Path) -> int:
        """The audio's tokens that take embeddings, for the row-size check."""
        return subsampled(self.features(path).shape[1])

    def encode(self, path: Path, pixels: bool = True) -> tuple[np.ndarray, list[MediaItem]]:
        """(the placeholder's tokens: `<boa>`, the audio tokens, `<eoa>`; its one `MediaItem`, start in placeholder
        coordinates, grid (0, frames, mel bins)). Counting rows (`pixels` False) keeps no features."""
        features = self.features(path)
        frames = features.shape[1]
        tokens = subsampled(frames)
        ids = np.concatenate([[self.begin_token_id], np.full(tokens, self.audio_token_id), [self.end_token_id]])
        kept = features if pixels else torch.zeros(0, 0)
        grid = torch.tensor([0, *features.shape[1:]]) if pixels else torch.zeros(3, dtype=torch.long)
        return ids.astype(np.int64), [MediaItem(AUDIO, kept, grid, 1, tokens, (0, len(ids)))]


def _open_audio(path: Path):
    """The container of the audio file at `path` (PyAV), or one error naming the file and the fix."""
    if not path.is_file():
        raise missing_file(path, "audio")
    try:
        import av
    except ImportError as e:
        raise DataError(f"audio {path} needs a decoder: `pip install av` (PyAV)") from e
    try:
        container = av.open(str(path))
    except decode_errors() as e:
        raise DataError(f"audio {path} cannot be decoded ({e}); re-encode it (WAV or FLAC) or drop that row") from e
    if not container.streams.audio:
        container.close()
        raise DataError(f"audio {path} holds no audio stream; give an audio file or drop that row")
    return container
