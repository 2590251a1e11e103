import json
import random

import numpy as np
import pytest
import torch

from longfit.config import Config
from longfit.data.documents import START, DataError
from longfit.data.packing import IGNORE_INDEX, PackedBatch, build_dataloader
from longfit.data.sources import open_source
from longfit.data.tokenizer import byte_tokenizer

L = 64


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def corpus(path, n=60, seed=0):
    """Texts of 0..250 characters (some longer than L, one 3.5 L) and chats with masked turns (one longer than L)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        if i % 5 == 4:
            records.append({"messages": [{"role": "user", "content": f"q{i}" * rng.randrange(1, 8)},
                                         {"role": "assistant", "content": f"a{i}" * rng.randrange(1, 8)}]})
        else:
            records.append({"text": f"<{i}>" + "".join(rng.choice("abcdef ") for _ in range(rng.randrange(0, 120)))})
    records[7] = {"text": "x" * (7 * L // 2)}
    records[9] = {"messages": [{"role": "user", "content": "u" * 2 * L}, {"role": "assistant", "content": "answer"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_cfg(path, micro_batch=1, shuffle_buffer=0, seq_len=L, long_chats=None) -> Config:
    cfg = Config()
    if long_chats:
        cfg.data.long_chats = long_chats
    cfg.data.path = None if path is None else str(path)
    cfg.seq_len = seq_len
    cfg.train.micro_batch = micro_batch
    cfg.data.shuffle_buffer = shuffle_buffer
    return cfg


def check_batch(batch: PackedBatch, rows: int, seq_len: int) -> list[tuple[int, int]]:
    """The batch contract; returns the segments as (start, end) over the flattened tokens."""
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (rows, seq_len)
    assert batch.input_ids.dtype == batch.labels.dtype == batch.position_ids.dtype == torch.long
    cu = batch.cu_seqlens
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == rows * seq_len
    assert bool((cu[1:] > cu[:-1]).all())
    assert set(range(0, rows * seq_len + 1, seq_len)) <= set(cu.tolist())  # row ends are segment ends
    ids, labels, positions = batch.input_ids.flatten(), batch.labels.flatten(), batch.position_ids.flatten()
    segments = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for start, end in segments:
        torch.testing.assert_close(positions[start:end], torch.arange(end - start))
        assert labels[end - 1] == IGNORE_INDEX
        inner = labels[start : end - 1]
        assert bool(((inner == IGNORE_INDEX) | (inner == ids[start + 1 : end])).all())
    assert batch.num_label_tokens == int((labels != IGNORE_INDEX).sum())
    return segments


def test_one_epoch_packs_every_token_once(tokenizer, tmp_path):
    """data.long_chats=split: chats are split like text, so the greedy walk covers every document."""
    cfg = make_cfg(corpus(tmp_path / "c.jsonl"), micro_batch=2, long_chats="split")
    docs = list(open_source(cfg, tokenizer).documents(START))
    loader = build_dataloader(cfg, tokenizer, epochs=1)
    batches = list(loader)
    pad = tokenizer.pad_token_id
    # Walk the packed stream against the documents: every piece is a contiguous slice of one document,
    # the labels are that document's next tokens where they are targets, and nothing is dropped.
    stream = [(d, o) for d, doc in enumerate(docs) for o in range(len(doc))]
    cursor, pieces_per_doc, padding = 0, [0] * len(docs), 0
    for batch in batches:
        ids, labels = batch.input_ids.flatten(), batch.labels.flatten()
        for start, end in check_batch(batch, 2, L):
            if cursor == len(stream):  # data over: the rest is padding without targets
                assert bool((ids[start:end] == pad).all()) and bool((labels[start:end] == IGNORE_INDEX).all())
                padding += end - start
                continue
            d, offset = stream[cursor]
            doc = docs[d]
            assert end - start <= len(doc) - offset
            torch.testing.assert_close(ids[start:end], torch.from_numpy(doc.ids[offset : offset + end - start]))
            targets = np.where(doc.loss_mask[offset + 1 : offset + end - start], doc.ids[offset + 1 : offset + end - start], IGNORE_INDEX)
            torch.testing.assert_close(labels[start : end - 1], torch.from_numpy(targets))
            pieces_per_doc[d] += 1
            cursor += end - start
    assert cursor == len(stream)
    total = sum(len(doc) for doc in docs)
    # Greedy filling puts row starts at every multiple of L of the stream; a piece starting inside a
    # document loses the one target its first token had.
    lost, position = 0, 0
    for doc in docs:
        lost += sum(int(doc.loss_mask[start]) for start in _piece_starts(len(doc), position) if start > 0)
        position += len(doc)
    walked_labels = sum(b.num_label_tokens for b in batches)
    assert walked_labels == sum(int(doc.loss_mask[1:].sum()) for doc in docs) - lost
    stats = loader.stats
    assert stats.documents == len(docs) and stats.tokens == total and stats.padding_tokens == padding
    assert stats.rows * L == total + padding and padding < L * 2
    assert stats.split_documents == sum(p > 1 for p in pieces_per_doc) > 0
    assert stats.long_documents == sum(len(doc) > L for doc in docs) >= 1
    assert stats.label_tokens == walked_labels
    assert max(pieces_per_doc) >= 4  # the 3.5 x L document spans at least four rows
    assert stats.split_chats >= 1 and stats.long_chats == 1 and stats.long_chats_cut == stats.chat_tokens_cut == 0


def chat_rows(tokenizer, tmp_path, policy, records):
    """The rows of one epoch of `records` at seq_len L under data.long_chats=`policy`, decoded: (tokens, targets)."""
    path = tmp_path / f"{policy}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    loader = build_dataloader(make_cfg(path, long_chats=policy), tokenizer, epochs=1)
    rows = []
    for batch in loader:
        check_batch(batch, 1, L)
        ids, labels = batch.input_ids[0], batch.labels[0]
        rows.append((tokenizer.decode(ids[ids != tokenizer.pad_token_id]), tokenizer.decode(labels[labels != IGNORE_INDEX])))
    return rows, loader.stats


LONG_CHAT = {"messages": [{"role": "user", "content": "u" * 150}, {"role": "assistant", "content": "a" * 10}]}
SHORT_CHAT = {"messages": [{"role": "user", "content": "q" * 20}, {"role": "assistant", "content": "b" * 5}]}  # 31 tokens
CHATS = [{"text": "t" * 40}, SHORT_CHAT, LONG_CHAT, {"text": "end"}]  # 42 + 31 tokens: the short chat does not fit row 1


@pytest.mark.parametrize("policy", ["keep_end", "truncate", "drop", "split"])
def test_long_chats_policy(tokenizer, tmp_path, policy):
    rows, stats = chat_rows(tokenizer, tmp_path, policy, CHATS)
    long_tokens = 1 + 1 + 150 + 1 + 1 + 10 + 1  # bos, <|user|>, content, <|end|>, <|assistant|>, answer, <|end|>
    text = "<|bos|>" + "t" * 40 + "<|eos|>"
    short = "<|bos|><|user|>" + "q" * 20 + "<|end|><|assistant|>" + "b" * 5 + "<|end|>"
    if policy == "split":  # today's packing: chats are split at row ends like text
        stream = "".join(row for row, _ in rows)
        assert stream.startswith(text + short) and "a" * 10 in stream
        assert any(targets == "" and row for row, targets in rows)  # a row of user turns only: no target
        assert (stats.long_chats, stats.long_chats_cut, stats.long_chats_dropped, stats.chat_tokens_cut) == (1, 0, 0, 0)
        assert stats.split_chats == 2
        return
    # Otherwise a chat never crosses a row end: the short one starts row 2, row 1 is padded after the text.
    assert rows[0] == (text, "t" * 40 + "<|eos|>")
    assert rows[1][0].startswith(short) and rows[1][1].startswith("b" * 5 + "<|end|>")
    assert stats.split_chats == 0 and stats.long_chats == 1 and stats.padding_tokens >= L - 42
    if policy == "keep_end":  # the answer and the last tokens of the question: a row of their own, L tokens
        assert rows[2] == ("u" * (L - 13) + "<|end|><|assistant|>" + "a" * 10 + "<|end|>", "a" * 10 + "<|end|>")
        assert (stats.long_chats_cut, stats.long_chats_dropped, stats.chat_tokens_cut) == (1, 0, long_tokens - L)
    elif policy == "truncate":  # the start: no room for the answer, a row without a target
        assert rows[2] == ("<|bos|><|user|>" + "u" * (L - 2), "")
        assert (stats.long_chats_cut, stats.long_chats_dropped, stats.chat_tokens_cut) == (1, 0, long_tokens - L)
    else:
        assert all("u" * 20 not in row for row, _ in rows)
        assert (stats.long_chats_cut, stats.long_chats_dropped, stats.chat_tokens_cut) == (0, 1, long_tokens)
    assert rows[-1][0].endswith("<|bos|>end<|eos|>")


def test_keep_end_ends_at_the_last_answer_and_drops_a_long_chat_without_one(tokenizer, tmp_path):
    trailing = {"messages": [*LONG_CHAT["messages"], {"role": "user", "content": "v" * 100}]}
    unanswered = {"messages": [{"role": "user", "content": "w" * 100}]}
    rows, stats = chat_rows(tokenizer, tmp_path, "keep_end", [trailing, unanswered, SHORT_CHAT])
    assert rows[0][0].endswith("a" * 10 + "<|end|>") and len(rows) == 2 and "w" not in rows[1][0]
    assert (stats.long_chats, stats.long_chats_cut, stats.long_chats_dropped) == (2, 1, 1)


def _piece_starts(length: int, position: int):
    """Offsets inside a document of `length` tokens starting at stream `position` where rows begin."""
    starts = [0]
    offset = L - position % L
    while offset < length:
        starts.append(offset)
        offset += L
    return starts


@pytest.mark.parametrize("shuffle_buffer, dp_size, micro_batch", [(0, 1, 1), (0, 2, 2), (7, 1, 2), (7, 3, 1)])
def test_resume_gives_the_same_next_batches(tokenizer, tmp_path, shuffle_buffer, dp_size, micro_batch):
    cfg = make_cfg(corpus(tmp_path / "c.jsonl", n=12), micro_batch, shuffle_buffer)
    for rank in range(dp_size):
        first = build_dataloader(cfg, tokenizer, dp_rank=rank, dp_size=dp_size)
        mid_document = False
        for stop in (3, 11, 40):  # the last ones lie in later epochs
            while first.stats.rows < stop * micro_batch:
                next(first)
            state = json.loads(json.dumps(first.state_dict()))
            mid_document |= state["current"] is not None
            expected = [next(first) for _ in range(4)]
            resumed = build_dataloader(cfg, tokenizer, dp_rank=rank, dp_size=dp_size)
            resumed.load_state_dict(state)
            for want, got in zip(expected, (next(resumed) for _ in range(4))):
                for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                    torch.testing.assert_close(getattr(got, name), getattr(want, name))
            assert resumed.stats == first.stats
        assert first.state_dict()["epoch"] >= 2
        assert mid_document


@pytest.mark.parametrize("shuffle_buffer", [0, 5])
def test_dp_ranks_get_disjoint_interleaved_rows(tokenizer, tmp_path, shuffle_buffer):
    path = corpus(tmp_path / "c.jsonl", n=30)
    single = build_dataloader(make_cfg(path, micro_batch=6, shuffle_buffer=shuffle_buffer), tokenizer)
    ranks = [build_dataloader(make_cfg(path, micro_batch=2, shuffle_buffer=shuffle_buffer), tokenizer, dp_rank=r, dp_size=3)
             for r in range(3)]
    for _ in range(8):
        everything = next(single).input_ids
        parts = [next(rank).input_ids for rank in ranks]
        for r in range(3):  # global row i goes to rank i % dp_size
            torch.testing.assert_close(parts[r], everything[r::3])
    states = [rank.state_dict() for rank in ranks]
    assert all({k: v for k, v in s.items() if k != "stats"} == {k: v for k, v in states[0].items() if k != "stats"}
               for s in states)


def test_finite_epochs_end_together_on_every_rank(tokenizer, tmp_path):
    cfg = make_cfg(corpus(tmp_path / "c.jsonl", n=20), micro_batch=2)
    total = sum(len(d) for d in open_source(cfg, tokenizer).documents(START))
    loaders = [build_dataloader(cfg, tokenizer, dp_rank=r, dp_size=2, epochs=2) for r in range(2)]
    counts = [sum(1 for _ in loader) for loader in loaders]
    assert counts[0] == counts[1] > 0
    # Every token is packed once per epoch, or counted as cut from the long chat (data.long_chats=keep_end).
    assert sum(loader.stats.tokens + loader.stats.chat_tokens_cut for loader in loaders) == 2 * total
    assert sum(loader.stats.long_chats_cut for loader in loaders) == 2
    assert sum(loader.stats.rows for loader in loaders) % 4 == 0  # whole batches of whole rows


def test_shuffle_buffer_orders_each_epoch_differently(tokenizer, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc{i}"}) + "\n" for i in range(40)))
    loader = build_dataloader(make_cfg(path, shuffle_buffer=8), tokenizer, epochs=2)
    stream = torch.cat([b.input_ids.flatten() for b in loader])
    text = tokenizer.decode(stream[stream != tokenizer.pad_token_id])
    order = [t.removesuffix("<|eos|>") for t in text.split("<|bos|>")[1:]]
    first, second = order[:40], order[40:]
    expected = [f"doc{i}" for i in range(40)]
    assert sorted(first) == sorted(second) == sorted(expected)
    assert first != expected and second != expected and first != second


def test_synthetic_default_rows(tokenizer):
    cfg = make_cfg(None, micro_batch=2, seq_len=1024)
    cfg.data.synthetic_samples = 12
    loader = build_dataloader(cfg, tokenizer)
    for _ in range(10):  # more than one epoch
        check_batch(next(loader), 2, 1024)
    epochs_ended = loader.state_dict()["epoch"]
    assert epochs_ended >= 1
    # Rows are full, but for the last row of each epoch: a new epoch starts on a row of its own.
    assert loader.stats.padding_tokens < epochs_ended * 1024 and loader.stats.documents >= 12


def test_to_device_keeps_everything(tokenizer, tmp_path):
    batch = next(build_dataloader(make_cfg(corpus(tmp_path / "c.jsonl")), tokenizer))
    moved = batch.to("cpu")
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        assert torch.equal(getattr(moved, name), getattr(batch, name))
    assert moved.num_label_tokens == batch.num_label_tokens


def test_synthetic_resume_with_shuffle(tokenizer):
    cfg = make_cfg(None, micro_batch=2, shuffle_buffer=3, seq_len=256)
    cfg.data.synthetic_samples = 6
    first = build_dataloader(cfg, tokenizer)
    for _ in range(9):
        next(first)
    state = first.state_dict()
    assert state["epoch"] >= 1 and state["buffer"]
    expected = [next(first) for _ in range(3)]
    resumed = build_dataloader(cfg, tokenizer)
    resumed.load_state_dict(state)
    for want in expected:
        torch.testing.assert_close(next(resumed).input_ids, want.input_ids)


def test_state_from_other_data_is_refused(tokenizer, tmp_path):
    state = build_dataloader(make_cfg(None), tokenizer).state_dict()
    other = build_dataloader(make_cfg(corpus(tmp_path / "c.jsonl")), tokenizer)
    with pytest.raises(DataError, match="resume with the same data.path"):
        other.load_state_dict(state)


@pytest.mark.parametrize("policy, why", [("drop", "drops them"), ("truncate", "cuts off their answers")])
def test_a_policy_that_leaves_no_target_is_refused_up_front(tokenizer, tmp_path, policy, why):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(LONG_CHAT) + "\n")
    with pytest.raises(DataError, match=rf"none of its 1 rows keeps a training target within seq_len={L}: .*"
                                        rf"data.long_chats={policy} {why}. Use data.long_chats=keep_end"):
        build_dataloader(make_cfg(path, long_chats=policy), tokenizer)
    build_dataloader(make_cfg(path, long_chats="keep_end"), tokenizer)


def test_a_batch_of_given_documents_keeps_the_packers_contract():
    input_ids = torch.arange(2 * L).reshape(2, L)
    batch = PackedBatch.of_documents(input_ids, [[L], [3, L - 5, 2]])
    segments = check_batch(batch, rows=2, seq_len=L)
    assert segments == [(0, L), (L, L + 3), (L + 3, 2 * L - 2), (2 * L - 2, 2 * L)]
    assert batch.num_label_tokens == 2 * L - 4  # every token but each document's last
    with pytest.raises(ValueError, match="do not fill"):
        PackedBatch.of_documents(input_ids, [[L], [L - 1]])
