"""The built-in long-context task: key-value retrieval buried in distractor prose.

A document is BOS + distractor sentences with one or more needles ("The secret number of the amber
heron is 48213.") at chosen depths + a question about one key + its answer + EOS:

    <bos> ...prose... The secret number of the amber heron is 48213. ...prose...
    Question: What is the secret number of the amber heron?
    Answer: 48213<eos>

The prose comes from sentence templates with varied fillers: regular enough that a tiny byte-level
model's loss falls within tens of steps, varied enough that it must keep learning. Answering needs
attention across the whole document, which is what long-context training has to teach.

Every piece is tokenized separately and concatenated, so an example has EXACTLY the requested number
of tokens with any tokenizer; the needle lands on the sentence boundary nearest its depth. Everything
is a function of the seed: the same seed gives the same document with the same tokenizer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from longfit.data.documents import START, DataError, Document, Position

NAMES = ["Alice", "Bruno", "Chen", "Dara", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kemal", "Lena",
         "Marco", "Nadia", "Omar", "Priya", "Rosa", "Sven", "Tomas", "Yuki"]
PLACES = ["market", "harbor", "library", "garden", "station", "bakery", "valley", "museum", "village", "forest",
          "bridge", "kitchen", "river bank", "old mill", "school", "lighthouse"]
ANIMALS = ["fox", "heron", "badger", "otter", "sparrow", "horse", "goat", "owl", "rabbit", "cat", "dog", "crow"]
COLORS = ["red", "amber", "green", "silver", "blue", "black", "white", "golden", "grey", "violet"]
OBJECTS = ["lamp", "basket", "letter", "key", "kettle", "map", "coat", "bell", "book", "candle", "boat", "ladder"]
ADJECTIVES = ["quiet", "busy", "cold", "bright", "narrow", "warm", "empty", "crowded", "small", "ancient", "muddy"]
TIMES = ["morning", "evening", "afternoon", "night", "spring", "winter", "summer", "autumn"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]
TOPICS = ["rivers", "old ships", "the stars", "bread", "mountains", "birds", "clocks", "the weather", "maps"]
SMELLS = ["salt", "smoke", "rain", "pine", "fresh bread", "wet stone", "apples", "tar"]

TEMPLATES = [
    "{name} walked to the {place} in the {time} and found a {color} {object}.",
    "The {animal} slept under the {object} while rain fell on the {place}.",
    "Every {time}, {name} reads a book about {topic} at the {place}.",
    "A {color} {animal} crossed the road near the {adjective} {place}.",
    "{name} told {name2} that the {object} was {adjective}.",
    "The {place} was {adjective} and quiet after the {time} market closed.",
    "In the {time}, the {animal}s gathered by the river to drink.",
    "{name} counted {number} {object}s on the table before dinner.",
    "The wind over the {place} smelled of {smell} and {smell2}.",
    "Nobody at the {place} remembered where the {color} {object} had gone.",
    "{name} and {name2} carried {number} baskets of apples to the {place}.",
    "The {adjective} {animal} watched {name} paint the {object} {color}.",
    "At the {place}, a man sold {color} {object}s and stories about {topic}.",
    "{name} wrote a letter about {topic} and left it by the {object}.",
]

NEEDLE = " The secret number of the {key} is {value}."
QUESTION = "\nQuestion: What is the secret number of the {key}?\nAnswer:"
ANSWER = " {value}"


@dataclass
class RetrievalExample:
    prompt_ids: list[int]  # BOS ... "Answer:"; the model must continue with answer_ids
    answer_ids: list[int]
    key: str
    value: str
    depth: float  # where the queried needle sits: 0 = right after BOS, 1 = right before the question

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def _sentence(rng: random.Random) -> str:
    names = rng.sample(NAMES, 2)
    smells = rng.sample(SMELLS, 2)
    text = rng.choice(TEMPLATES).format(
        name=names[0], name2=names[1], place=rng.choice(PLACES), animal=rng.choice(ANIMALS),
        color=rng.choice(COLORS), object=rng.choice(OBJECTS), adjective=rng.choice(ADJECTIVES),
        time=rng.choice(TIMES), number=rng.choice(NUMBERS), topic=rng.choice(TOPICS),
        smell=smells[0], smell2=smells[1],
    )
    # Paragraphs of a few sentences: the separator is part of the sentence so pieces concatenate.
    return ("\n" if rng.random() < 0.2 else " ") + text


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _distractor(tokenizer, budget: int, rng: random.Random, tokens_per_char: float) -> list[list[int]]:
    """Token lists of consecutive sentences totalling exactly `budget` tokens (the last one cut).

    Sentences are drawn 32 at a time, as the documents' seeds have always drawn them, but tokenized only as far as the
    budget reaches (a sentence's tokens do not depend on its neighbours), guessed from their characters at
    `tokens_per_char` (then at the rate of the sentences tokenized): the sentences a round draws past the budget are
    never tokenized (#52: SmolLM2's synthetic epoch at seq_len=512 tokenized 54,464 sentences to keep 20,105)."""
    sentences: list[list[int]] = []
    total = characters = tokens = 0
    while total < budget:
        drawn = [_sentence(rng) for _ in range(32)]
        while drawn and total < budget:
            taken, drawn = _split(drawn, budget - total, tokens / characters if characters else tokens_per_char)
            for text, ids in zip(taken, _encode(tokenizer, taken)):
                characters, tokens = characters + len(text), tokens + len(ids)
                ids = ids[: budget - total]
                sentences.append(ids)
                total += len(ids)
                if total == budget:
                    break
    return sentences


def _split(drawn: list[str], tokens: int, tokens_per_char: float) -> tuple[list[str], list[str]]:
    """(the first of the `drawn` sentences, whose characters at `tokens_per_char` reach `tokens`, and one more; the
    rest)."""
    reach = 0.0
    for count, text in enumerate(drawn, 1):
        reach += len(text) * tokens_per_char
        if reach >= tokens:
            return drawn[: count + 1], drawn[count + 1 :]
    return drawn, []


def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample([(c, a) for c in COLORS for a in ANIMALS], count)
    return [f"{color} {animal}" for color, animal in pairs]


def build_retrieval(
    tokenizer, length: int, depths: list[float], rng: random.Random, query: int = 0, grow: bool = False
) -> RetrievalExample:
    """An example of exactly `length` tokens (prompt + answer) with a needle at each depth in [0, 1];
    the question asks for needle `query`. A `length` too short for the needles and question is an
    error, or with `grow` gives the example without prose."""
    keys = _keys(rng, len(depths))
    values = [str(rng.randrange(10_000, 100_000)) for _ in depths]
    texts = [*(NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)), QUESTION.format(key=keys[query]),
             ANSWER.format(value=values[query])]
    *needles, question, answer = _encode(tokenizer, texts)  # one call: a call costs more than its few texts
    head = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    fixed = len(head) + sum(map(len, needles)) + len(question) + len(answer)
    if length < fixed and not grow:
        raise DataError(f"a retrieval example needs at least {fixed} tokens with this tokenizer, asked for {length}")
    sentences = _distractor(tokenizer, max(length - fixed, 0), rng, (fixed - len(head)) / sum(map(len, texts)))
    # Needle i goes before sentence round(depth * n): depth 0 follows BOS, depth 1 precedes the question.
    slots: dict[int, list[list[int]]] = {}
    for depth, needle in sorted(zip(depths, needles), key=lambda pair: pair[0]):
        slots.setdefault(round(depth * len(sentences)), []).append(needle)
    prompt = list(head)
    for index in range(len(sentences) + 1):
        for needle in slots.get(index, []):
            prompt += needle
        if index < len(sentences):
            prompt += sentences[index]
    prompt += question
    return RetrievalExample(prompt, answer, keys[query], values[query], depths[query])


def retrieval_example(tokenizer, length: int, depth: float, seed: int | str) -> RetrievalExample:
    """One evaluation example: a single needle at `depth`, prompt + answer exactly `length` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} must lie in [0, 1]")
    return build_retrieval(tokenizer, length, [depth], random.Random(f"retrieval-eval:{seed}"))


class SyntheticSource:
    """`samples` training documents, log-uniform lengths from seq_len/16 to seq_len tokens, 1-3 needles."""

    def __init__(self, tokenizer, samples: int, seq_len: int, seed: int):
        if samples < 1:
            raise DataError(f"data.synthetic_samples={samples}: must be >= 1 (or set data.path)")
        self.tokenizer = tokenizer
        self.samples = samples
        self.seq_len = seq_len
        self.seed = seed
        self.eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.description = f"synthetic retrieval task (seed {seed}, {samples} documents)"

    def read(self, position: Position) -> Document:
        index = position.offset
        if not 0 <= index < self.samples:
            raise DataError(f"{self.description}: no document {index}; did data.synthetic_samples change?")
        rng = random.Random(f"synthetic:{self.seed}:{index}")
        low = max(self.seq_len / 16, 1)
        length = round(math.exp(rng.uniform(math.log(low), math.log(self.seq_len))))
        needles = rng.randint(1, 3)
        depths = [rng.random() for _ in range(needles)]
        example = build_retrieval(self.tokenizer, length - len(self.eos), depths, rng, rng.randrange(needles), grow=True)
        ids = np.asarray(example.ids + self.eos, dtype=np.int64)
        return Document(ids, np.ones(len(ids), dtype=bool), Position(0, index, index), Position(0, index + 1, index + 1))

    def documents(self, start: Position = START) -> Iterator[Document]:
        for index in range(start.offset, self.samples):
            yield self.read(Position(0, index, index))
