import random

import pytest
from transformers import AutoTokenizer

from longfit.data.tokenizer import SPECIAL_TOKENS, byte_tokenizer
from longfit.models.presets import PRESETS

SAMPLES = [
    "",
    "plain ascii",
    "héllo wörld, 日本語, emoji 🎉👩‍👩‍👧, RTL مرحبا",
    "control \x00\x01\x7f and whitespace \t\n\r  \u2028 end",
    "text that spells a special token: <|bos|> <|assistant|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def _random_text(rng: random.Random) -> str:
    return "".join(chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0xD7FF), rng.randrange(0x10000, 0x10FFFF)]))
                   for _ in range(200))


def test_ids_are_utf8_bytes_and_round_trip(tokenizer):
    rng = random.Random(0)
    for text in SAMPLES[:4] + [_random_text(rng) for _ in range(20)]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text


def test_special_token_strings_in_text_stay_bytes_when_split(tokenizer):
    text = SAMPLES[4]
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_vocab_fit_every_preset(tokenizer):
    assert len(tokenizer) == 256 + len(SPECIAL_TOKENS) <= 384
    assert min(p["vocab_size"] for p in PRESETS.values()) >= len(tokenizer)
    assert tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|bos|>") >= 256
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|eos|>") >= 256
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|pad|>") >= 256
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    assert tokenizer.encode("ab") == [97, 98]  # no implicit BOS/EOS: callers place them


def test_chat_template_masks_assistant_turns(tokenizer):
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok!"},
    ]
    out = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "yo<|end|>ok!<|end|>"
    prompt = tokenizer.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"


def test_save_and_reload_gives_same_ids(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES:
        assert reloaded.encode(text) == tokenizer.encode(text)
        assert reloaded(text, split_special_tokens=True)["input_ids"] == tokenizer(text, split_special_tokens=True)["input_ids"]
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    kwargs = dict(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert dict(reloaded.apply_chat_template(chat, **kwargs)) == dict(tokenizer.apply_chat_template(chat, **kwargs))
