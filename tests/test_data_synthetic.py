import re

import pytest

from longfit.data.documents import START, DataError
from longfit.data.synthetic import SyntheticSource, _sentence, retrieval_example
from longfit.data.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A real subword tokenizer (BPE trained here on the task's prose), to check lengths are exact with
    tokens that span several characters."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    backend.train_from_iterator([_sentence(rng) for _ in range(3000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("which", ["tokenizer", "bpe_tokenizer"])
@pytest.mark.parametrize("length", [120, 333, 1024, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_example_has_exact_length_and_findable_answer(request, which, length, depth):
    tok = request.getfixturevalue(which)
    example = retrieval_example(tok, length, depth, seed=7)
    assert len(example.prompt_ids) + len(example.answer_ids) == length
    assert example.prompt_ids[0] == tok.bos_token_id
    text = tok.decode(example.prompt_ids)
    assert text.endswith(f"\nQuestion: What is the secret number of the {example.key}?\nAnswer:")
    needle = f"The secret number of the {example.key} is {example.value}."
    assert text.count(needle) == 1
    assert tok.decode(example.answer_ids) == f" {example.value}"
    # The needle sits at the requested depth of the prose, within a sentence or so.
    prose_start, prose_end = len("<|bos|>" if which == "tokenizer" else "<s>"), text.index("\nQuestion:")
    where = (text.index(needle) - prose_start) / max(prose_end - prose_start - len(needle) - 1, 1)
    assert abs(where - depth) <= 0.1 + 120 / length


def test_examples_are_deterministic_per_seed(tokenizer):
    a, b, c = (retrieval_example(tokenizer, 500, 0.5, seed) for seed in (1, 1, 2))
    assert a.ids == b.ids and a.ids != c.ids


def test_too_short_length_is_an_error(tokenizer):
    with pytest.raises(DataError, match="needs at least"):
        retrieval_example(tokenizer, 20, 0.5, seed=0)


def test_training_documents(tokenizer):
    seq_len = 2048
    source = SyntheticSource(tokenizer, samples=40, seq_len=seq_len, seed=3)
    docs = list(source.documents(START))
    assert len(docs) == 40
    lengths = [len(d) for d in docs]
    assert max(lengths) <= seq_len and min(lengths) < seq_len / 4 and max(lengths) > seq_len / 2
    for doc in docs:
        assert doc.loss_mask.all()
        assert doc.ids[0] == tokenizer.bos_token_id and doc.ids[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(doc.ids[1:-1])
        pairs = dict(re.findall(r"The secret number of the (\w+ \w+) is (\d+)\.", text))
        asked, answer = re.search(r"Question: What is the secret number of the (\w+ \w+)\?\nAnswer: (\d+)$", text).groups()
        assert 1 <= len(pairs) <= 3 and pairs[asked] == answer
    again = SyntheticSource(tokenizer, samples=40, seq_len=seq_len, seed=3)
    assert again.read(docs[17].position).ids.tolist() == docs[17].ids.tolist()
    other_seed = SyntheticSource(tokenizer, samples=40, seq_len=seq_len, seed=4).read(docs[17].position)
    assert other_seed.ids.tolist() != docs[17].ids.tolist()


def test_tiny_seq_len_still_holds_the_task(tokenizer):
    docs = list(SyntheticSource(tokenizer, samples=5, seq_len=16, seed=0).documents(START))
    for doc in docs:  # longer than seq_len: the packer splits them
        assert "Answer:" in tokenizer.decode(doc.ids)



def test_a_document_tokenizes_the_sentences_it_keeps_and_no_others(bpe_tokenizer, monkeypatch):
    """#52: a document draws its sentences 32 at a time and tokenizes only those its length takes (SmolLM2's epoch
    tokenized 2.7 times the sentences it kept); its tokens are those of tokenizing every drawn sentence."""
    from longfit.data import synthetic

    texts, kept = [], []
    encode, distractor = synthetic._encode, synthetic._distractor
    monkeypatch.setattr(synthetic, "_encode", lambda tok, batch: texts.extend(batch) or encode(tok, batch))
    monkeypatch.setattr(synthetic, "_distractor", lambda *args: (s := distractor(*args), kept.append(len(s)))[0])
    docs = list(SyntheticSource(bpe_tokenizer, samples=30, seq_len=1024, seed=5).documents(START))
    sentences = len(texts) - sum(len(re.findall(r"\d{5}", text)) for text in texts)  # less needles and answers
    sentences -= sum(text.startswith("\nQuestion:") for text in texts)
    assert sentences - sum(kept) <= 2 * len(docs)  # tokenizing whole rounds: 18 a document
    monkeypatch.setattr(synthetic, "_split", lambda drawn, *args: (drawn, []))  # every drawn sentence tokenized
    every = SyntheticSource(bpe_tokenizer, samples=30, seq_len=1024, seed=5)
    assert [doc.ids.tolist() for doc in every.documents(START)] == [doc.ids.tolist() for doc in docs]
