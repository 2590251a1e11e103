"""Synthetic image and video retrieval (#54): find the page or the frame that holds a key.

An example is a chat: `pages` pages rendered with Pillow as examples/document_qa.py renders its pages (lines of filler
words), or a clip of `pages` such frames (a folder of frames: a video part), one of them holding "THE KEY IS 1234" in
red, then the question "What is the key?"; the assistant's answer "The key is 1234." is the target. The key's page
sits at each depth of `longfit.eval.retrieval.DEPTHS` (the first page, a quarter of the way, ..., the last), `samples`
examples a depth, drawn from the seed: the same examples for every model.

The rows are written to a temporary folder and read by the training reader (the checkpoint's chat template, its image
or video processor and placeholder rule: `longfit.data.media`), packed as training packs them (a document attends
only to itself, so a packed example scores as it would alone), and run through the wrapper's vision side and language
model (`longfit.memory.loss.CausalLMLoss`), as a training step runs them.

Scored as the text retrieval is (`longfit.eval.retrieval`): teacher-forced exact match (an example is correct when
the greedy prediction of every answer token is right), and the answer tokens' mean log-likelihood.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from longfit.config import Config, ConfigError
from longfit.eval.retrieval import DEPTHS, CellResult, mean_accuracy

MEDIA_KINDS = ("images", "video")
PAGE_SIZE = {"images": (256, 320), "video": (128, 96)}  # (width, height): a document page, a video frame
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet")
QUESTION = "What is the key?"
ANSWER = "The key is {key}."


@dataclass(frozen=True)
class MediaRetrievalScore:
    kind: str  # "images" or "video"
    accuracy: float  # teacher-forced exact match of the answers
    log_likelihood: float  # the answer tokens' mean log-likelihood
    pages: int  # pages or frames an example
    examples: int
    cells: tuple[CellResult, ...]  # per depth of the key's page (`CellResult.length`: the pages)

    def line(self) -> str:
        what = "pages" if self.kind == "images" else "frames"
        return (f"{self.accuracy:.2f} exact match, answer log-likelihood {self.log_likelihood:.3f} "
                f"({self.examples} examples of {self.pages} {what})")


def key_page(depth: float, pages: int) -> int:
    """The page (frame) that holds the key at `depth` of `pages`."""
    return round(depth * (pages - 1))


def render_page(rng: random.Random, size: tuple[int, int], key: str | None):
    """A white page of `size` with lines of filler words, and "THE KEY IS `key`" in red at its foot when given."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for line in range((size[1] - 32) // 24):
        draw.text((12, 12 + 24 * line), " ".join(rng.choice(WORDS) for _ in range(5)), fill="black")
    if key is not None:
        draw.text((12, size[1] - 20), f"THE KEY IS {key}", fill="red")
    return image


def write_examples(folder: Path, kind: str, pages: int, samples: int, seed: int) -> Path:
    """The examples (module docstring) as chat rows in `folder`, their pages beside them; returns the JSONL file."""
    import json

    rng = random.Random(f"media-retrieval:{kind}:{seed}")
    rows = []
    for depth in DEPTHS:
        for _ in range(samples):
            key, holder, name = f"{rng.randrange(10_000):04d}", key_page(depth, pages), f"example{len(rows):03d}"
            images = [render_page(rng, PAGE_SIZE[kind], key if page == holder else None) for page in range(pages)]
            if kind == "images":
                names = [f"{name}-page{page:02d}.png" for page in range(pages)]
                parts = [{"type": "image", "path": n} for n in names]
            else:  # a folder of frames, in name order
                (folder / name).mkdir()
                names = [f"{name}/{page:05d}.png" for page in range(pages)]
                parts = [{"type": "video", "path": name}]
            for image, n in zip(images, names):
                image.save(folder / n)
            rows.append({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]},
                                      {"role": "assistant", "content": ANSWER.format(key=key)}]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def answer_hits(hidden: torch.Tensor, model, labels: torch.Tensor, spans) -> list[bool]:
    """Per document of a row (`spans`: its (start, end) of documents with targets), whether the greedy prediction
    from the final hidden states `hidden` (L, H) equals every target of `labels` (L,). The logits' scale and softcap
    keep their order, so the prediction is the argmax of lm_head's output."""
    from longfit.models.structure import decoder_and_head, prediction_head

    _, lm_head = decoder_and_head(model)
    head = prediction_head(model)
    hits = []
    for start, end in spans:
        targets = labels[start:end]
        at = targets != -100
        if not at.any():
            continue  # padding, or a document without an answer
        states = hidden[start:end][at]  # (A, H)
        predicted = lm_head(states if head is None else head(states)).argmax(-1)  # (A,)
        hits.append(bool(torch.equal(predicted, targets[at])))
    return hits


def evaluate_media_retrieval(loss_module, tokenizer, reader, cfg: Config, kind: str, pages: int, samples: int,
                             seed: int, device, autocast: torch.dtype | None = None) -> MediaRetrievalScore:
    """The score of `loss_module` (a CausalLMLoss with the wrapper's vision side) on the examples of `kind`, read by
    `reader` (the checkpoint's `longfit.data.media.MediaReader`) with `cfg`'s seq_len and video sampling; an example
    longer than seq_len is one error line."""
    from longfit.data.packing import PackedLoader, media_source, pad_token_id
    from longfit.memory.loss import batch_loss_sum, positioned
    from longfit.models.structure import decoder_and_head

    if kind not in MEDIA_KINDS or pages < 1 or samples < 1:
        raise ConfigError(f"image retrieval of {kind!r}, {pages} pages, {samples} samples: use images or video, at "
                          "least 1 page and 1 sample")
    body, _ = decoder_and_head(loss_module.model)
    captured = []
    hook = body.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    was_training = loss_module.training
    loss_module.eval()
    hits, loss_sum, tokens = [], 0.0, 0
    try:
        with tempfile.TemporaryDirectory(prefix="longfit-media-retrieval-") as folder:
            rows = write_examples(Path(folder), kind, pages, samples, seed)
            data = replace(cfg.data, path=str(rows), eval_path=None, eval_fraction=0.0, long_chats="keep_end")
            source, _ = media_source(replace(cfg, data=data), tokenizer, reader)
            longest = max(len(doc) for doc in source.documents())
            if longest > cfg.seq_len:
                raise ConfigError(f"eval.retrieval_media={kind}: an example of eval.pages={pages} takes {longest} "
                                  f"tokens, more than seq_len={cfg.seq_len}: lower eval.pages or raise seq_len")
            loader = PackedLoader(source, cfg.seq_len, 1, pad_token_id(tokenizer), epochs=1, long_chats="keep_end")
            with torch.no_grad():
                for batch in loader:
                    batch = positioned(loss_module, batch).to(device)
                    captured.clear()
                    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                        loss_sum += float(batch_loss_sum(loss_module, batch))
                        hits += answer_hits(captured[0][0], loss_module.model, batch.labels[0],
                                            batch.documents.rows[0])
                    tokens += batch.num_label_tokens
    finally:
        hook.remove()
        loss_module.train(was_training)
    cells = tuple(CellResult(pages, depth, sum(hits[i * samples : (i + 1) * samples]), samples)
                  for i, depth in enumerate(DEPTHS))
    return MediaRetrievalScore(kind, mean_accuracy(list(cells)), -loss_sum / tokens, pages, len(hits), cells)

