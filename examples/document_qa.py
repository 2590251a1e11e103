"""Long-document question answering on page images (#54): the data of examples/qwen3_5_document_qa.yaml.

Each row is a document rendered as page images (as a PDF's pages would be) with a question whose answer is on one
page: "Which page holds the key, and what is it?". Written with Pillow, seeded; your own PDFs become such rows by
rendering their pages to PNG (e.g. `pdftoppm -png -r 100 doc.pdf pages/doc`) and naming them in `image` parts.

    python examples/document_qa.py                 # runs/document-qa/: pages/ and rows.jsonl
    python examples/document_qa.py --tiny-model    # and runs/qwen3_5-tiny: a tiny Qwen3.5 wrapper for the CPU

The tiny wrapper is written by transformers itself (`Qwen3_5ForConditionalGeneration`) from transformers' default
Qwen3.5 config with the language model and the vision tower shrunk, random weights, longfit's byte tokenizer with
Qwen's vision tokens and a chat template that renders image parts as Qwen's does, and Qwen's own Pillow image
processor (16-pixel patches merged 2 x 2) capped at 64 x 64 pixels a page: 4 tokens a page.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
RENDER_CONTENT = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)
"""Qwen's chat template's rendering of a content list (an image part: its placeholder), on the byte tokenizer's."""
TINY_TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def write_pages(folder: Path, documents: int, pages: int, seed: int = 0) -> Path:
    """`documents` rows of `pages` rendered pages each, the key on one of them; returns the rows' JSONL file."""
    from longfit.eval.media_retrieval import PAGE_SIZE, render_page  # eval.retrieval_media's pages, alike

    rng = random.Random(seed)
    (folder / "pages").mkdir(parents=True, exist_ok=True)
    rows = []
    for doc in range(documents):
        key_page, key = rng.randrange(pages), f"{rng.randrange(10_000):04d}"
        parts = []
        for page in range(pages):
            image = render_page(rng, PAGE_SIZE["images"], key if page == key_page else None)
            name = f"pages/doc{doc:03d}-p{page:02d}.png"
            image.save(folder / name)
            parts.append({"type": "image", "path": name})
        parts.append({"type": "text", "text": "Which page holds the key, and what is it?"})
        rows.append({"messages": [{"role": "user", "content": parts},
                                  {"role": "assistant", "content": f"Page {key_page + 1}: the key is {key}."}]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_tiny_qwen3_5(path: Path, text: dict = TINY_TEXT, vision: dict = TINY_VISION, seed: int = 0,
                       model_type: str = "qwen3_5") -> Path:
    """A tiny Qwen3.5 (or `model_type="qwen3_5_moe"`: Qwen3.5-MoE, `text` with its experts) wrapper checkpoint that
    reads images (module docstring) at `path`."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = RENDER_CONTENT + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                             max_pixels=64 * 64).save_pretrained(path)
    return path


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--out", type=Path, default=ROOT / "runs" / "document-qa")
    cli.add_argument("--documents", type=int, default=48)
    cli.add_argument("--pages", type=int, default=24)
    cli.add_argument("--tiny-model", action="store_true", help="also write runs/qwen3_5-tiny")
    opts = cli.parse_args()
    print(write_pages(opts.out, opts.documents, opts.pages))
    if opts.tiny_model:
        print(write_tiny_qwen3_5(ROOT / "runs" / "qwen3_5-tiny"))


if __name__ == "__main__":
    main()
