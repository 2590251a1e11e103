"""longfit's byte-level tokenizer: the tokenizer of every preset, built locally (no download).

Token id b (0..255) is the byte b of the UTF-8 text, so any string round-trips and the model learns
spelling from scratch; ids 256.. are the special tokens. The vocabulary (263 tokens) fits the smallest
preset embedding (384 rows). The chat template marks assistant turns with {% generation %} so
`apply_chat_template(..., return_assistant_tokens_mask=True)` yields the training loss mask.
"""

from __future__ import annotations

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS, END_OF_TURN)

# The assistant's end-of-turn marker sits inside the generation span: the model must learn to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_tokenizer_special_ids() -> dict[str, int]:
    """bos/eos/pad ids as model-config attributes: the ids follow the 256 byte tokens in SPECIAL_TOKENS order."""
    return {f"{name}_token_id": 256 + SPECIAL_TOKENS.index(token) for name, token in (("bos", BOS), ("eos", EOS), ("pad", PAD))}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return chars


def byte_tokenizer():
    """A `PreTrainedTokenizerFast`: 256 byte tokens + special tokens, bos/eos/pad set, chat template.

    `add_special_tokens=True` adds nothing: callers place BOS/EOS explicitly (see `longfit.data.documents`).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    # A BPE without merges over the byte alphabet: every byte is its own token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 40,
        clean_up_tokenization_spaces=False,
    )
