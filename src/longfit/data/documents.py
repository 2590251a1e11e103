"""Documents as token ids + a per-token loss mask, and how text and chats become them.

`loss_mask[t]` says whether token t is a training TARGET (predicted from the tokens before it). Text
documents are BOS + text + EOS with every token a target; chats train on assistant turns only, each turn's
content and its end-of-turn token, never the separator the template writes after it (`end_at_terminator`). BOS or
EOS is skipped when the tokenizer has none; BOS is never doubled (a chat template that already emits it
keeps its own).

A long text is tokenised in pieces of about `PIECE_CHARS` characters (`text_pieces`), so the memory it
takes is its ids (8 bytes a token) plus one piece's worth of the tokenizer's per-token bookkeeping,
not that bookkeeping for the whole text (about 230 bytes a character for a 20 MB line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from jinja2 import TemplateError

from longfit.config import ConfigError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
PIECE_CHARS = 1 << 18  # characters of text per tokenizer call
_CUT = re.compile(r"[^\W_]\s")  # a letter or digit followed by whitespace: cut between them
_CUT_SEARCH = 1 << 14  # how far back from a piece's end a cut is looked for first


class DataError(ConfigError):
    """Training data that cannot be read; the message names the file, line and config key to fix."""


class Position(NamedTuple):
    """Where a document starts in its source: file index, byte offset (or row) and record number.

    `record` is the 0-based line number in a JSONL file, the row of a datasets table or the index of a
    synthetic document; it is kept only to name the line in error messages after a resume.
    """

    file: int
    offset: int
    record: int


START = Position(0, 0, 0)


@dataclass
class Document:
    ids: np.ndarray  # (n,) int64
    loss_mask: np.ndarray  # (n,) bool, True where the token is a training target
    position: Position  # where this document starts
    next: Position  # where the document after it starts
    chat: bool = False  # rendered from `messages`: packing keeps it in one row (data.long_chats)
    media: tuple = ()  # its images (longfit.data.media.MediaItem), their tokens in document coordinates

    def __len__(self) -> int:
        return len(self.ids)


def _as_arrays(ids: list[int], mask: list[int] | list[bool]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


CONTENT_PARTS = ("text", "image", "video", "audio")
"""The `type`s of a message's content parts (transformers' chat-template shape: #54's image rows)."""


def _is_content(content: Any) -> bool:
    """A message content: a string, or a list of {type: text|image|video|audio, ...} parts."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") in CONTENT_PARTS for part in content))


def validate_messages(messages: Any, key: str) -> list[dict[str, Any]]:
    """A chat must be a non-empty list of {role, content} messages, each content a string or a list of text, image,
    video and audio parts; the error names `key`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{key} must be a non-empty list of {{role, content}} messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not _is_content(message.get("content")):
            raise DataError(f"{key}[{i}] must be an object with string `role` and `content` (or a `content` list of "
                            f"{{type: {'|'.join(CONTENT_PARTS)}}} parts), got {message!r:.120}")
    return messages


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
"""ShareGPT's `from` values and the chat roles they are (user and assistant: exports that already renamed them)."""


def sharegpt_messages(turns: Any, key: str) -> list[dict[str, str]]:
    """A ShareGPT `conversations` list of {from, value} turns as {role, content} messages; the error names `key`."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{key} must be a non-empty list of {{from, value}} turns, got {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise DataError(f"{key}[{i}] must be an object with `from` ({', '.join(SHAREGPT_ROLES)}) and a string "
                            f"`value`, got {turn!r:.120}")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def alpaca_messages(record: dict) -> list[dict[str, str]]:
    """An Alpaca row as a chat: the instruction (then a blank line and the input, when not empty) as the user's
    turn, the output as the assistant's."""
    fields = {name: record.get(name) for name in ("instruction", "output")}
    fields["input"] = record.get("input") or ""  # absent, null (a datasets column another row filled) or empty
    wrong = [name for name, value in fields.items() if not isinstance(value, str)]
    if wrong or "instruction" not in record or "output" not in record:
        raise DataError(f"an Alpaca row needs string `instruction` and `output` (and `input`, possibly empty), got "
                        f"{ {name: type(value).__name__ for name, value in record.items()} }")
    prompt = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]


def text_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `size` characters, each cut between a letter or digit and the
    whitespace after it.

    Byte-level BPE tokenizers whose pre-tokenizer regex starts a new pre-token at such a place (GPT-2 and
    the byte tokenizer: exact, tested) give the same ids for the pieces as for the whole text. Others may
    tokenise a cut differently by a token (a SentencePiece tokenizer adds its word-start marker there); with
    one cut per `size` characters that is noise. A stretch of `size` characters with no such place is cut
    where the piece is full.
    """
    pieces, start = [], 0
    while len(text) - start > size:
        end = start + size
        cut = None
        for lo in (max(start, end - _CUT_SEARCH), start):
            matches = list(_CUT.finditer(text, lo, end))
            if matches:
                cut = matches[-1].start() + 1
                break
        cut = cut if cut and cut > start else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def end_at_terminator(ids: list[int], mask: list[int], special: set[int]) -> list[int]:
    """`mask` with every target span cut after its last special token (when it has one).

    A template writes each assistant turn as content + turn terminator + separator, e.g. ChatML's
    `<|im_end|>` + "\n", Gemma's `<end_of_turn>` + "\n"; a rendering (prefix differences, or a
    {% generation %} block that includes the newline) cannot tell the two apart. Generation stops at a
    special token (the eos, or a generation config's stop ids), so the terminator is the span's last
    special token and what follows it is never generated: training on it teaches nothing the model
    will use, and for ChatML it teaches predicting "\n" after the turn is over. Template-agnostic and
    needs no eos: Gemma's and Phi-3's turn terminators are not their tokenizers' eos. A span without a
    special token (a template that ends turns with text only) is kept whole: that text is its only stop.
    """
    out = list(mask)
    t = 0
    while t < len(out):
        if not out[t]:
            t += 1
            continue
        end = t
        while end < len(out) and out[end]:
            end += 1
        last = next((i for i in range(end - 1, t - 1, -1) if ids[i] in special), None)  # from the end: near it
        if last is not None:
            out[last + 1 : end] = [0] * (end - last - 1)
        t = end
    return out


class DocumentEncoder:
    """Turns text and chat messages into (ids, loss_mask) with one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id
        self.eos = tokenizer.eos_token_id
        self.special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self.special.update(tokenizer.all_special_ids)
        template = tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default")
        self.chat_template = template
        self.template_marks_generation = bool(template and _GENERATION_TAG.search(template))
        self.media = None  # the run's reader of image parts (longfit.data.media.MediaChatEncoder), None: text only

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        encoded = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True,
                                 return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return [np.asarray(ids, dtype=np.int64) for ids in encoded]

    def texts(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """BOS + text + EOS per text, every token a target. Special-token strings inside the text stay text.

        Short texts are tokenised in one batch, a text longer than PIECE_CHARS piece by piece.
        """
        short = [text for text in texts if len(text) <= PIECE_CHARS]
        encoded_short = iter(self._encode(short) if short else [])
        head = np.asarray([] if self.bos is None else [self.bos], dtype=np.int64)
        tail = np.asarray([] if self.eos is None else [self.eos], dtype=np.int64)
        out = []
        for text in texts:
            if len(text) <= PIECE_CHARS:
                parts = [next(encoded_short)]
            else:
                parts = [self._encode([piece])[0] for piece in text_pieces(text)]
            ids = np.concatenate([head, *parts, tail])
            del parts
            out.append((ids, np.ones(len(ids), dtype=bool)))
        return out

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False, **kwargs) -> dict:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def chat(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """Chat template tokens; targets are the assistant turns (content and end-of-turn token, not the
        separator after it)."""
        if not self.chat_template:
            raise DataError(
                "this tokenizer has no chat template, so `messages` data cannot be rendered: use a model whose "
                "tokenizer has one, or convert the data to plain text (data.text_field)"
            )
        try:
            if self.template_marks_generation:
                rendered = self._render(messages, return_assistant_tokens_mask=True)
                ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
            else:
                ids, mask = self._chat_by_prefixes(messages)
        except DataError:
            raise
        except (TemplateError, ValueError, TypeError) as e:  # templates refuse chats with raise_exception
            raise DataError(f"the chat template rejected this conversation: {e}") from e
        mask = end_at_terminator(ids, mask, self.special)
        if self.bos is not None and (not ids or ids[0] != self.bos):
            ids, mask = [self.bos, *ids], [0, *mask]
        return _as_arrays(ids, mask)

    def _chat_by_prefixes(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Assistant spans without generation markers: turn i spans from the end of the rendered
        prefix `messages[:i]` + generation prompt to the end of the rendered `messages[:i + 1]` (which
        includes the separator after the turn; `chat` cuts it).

        Measured as common prefixes with the full rendering, so a template that renders earlier turns
        differently once later turns exist can only shrink a span, never mark a non-assistant token.
        """
        full = list(self._render(messages)["input_ids"])
        mask = [0] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = common_prefix_length(list(self._render(messages[:i], True)["input_ids"]), full) if i else 0
            end = common_prefix_length(list(self._render(messages[: i + 1])["input_ids"]), full)
            mask[start:end] = [1] * max(0, end - start)
        return full, mask
