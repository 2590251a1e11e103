import json

import numpy as np
import pytest
from batch_helpers import target_spans

from longfit.config import Config
from longfit.data.documents import START, DataError, DocumentEncoder
from longfit.data.packing import build_dataloader
from longfit.data.sources import open_source
from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "six"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def make_cfg(path, **data) -> Config:
    cfg = Config()
    cfg.data.path = str(path)
    cfg.seq_len = 64
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def documents(cfg, tokenizer):
    return list(open_source(cfg, tokenizer).documents(START))


def test_text_documents_are_bos_text_eos(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}, {"text": "wörld <|eos|>"}])
    docs = documents(make_cfg(path), tokenizer)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert [d.ids.tolist() for d in docs] == [[bos, *b"hello", eos], [bos, *"wörld <|eos|>".encode(), eos]]
    assert all(d.loss_mask.all() for d in docs)


def test_chat_loss_only_on_assistant_turns_single_bos(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (doc,) = documents(make_cfg(path), tokenizer)
    ids = doc.ids.tolist()
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(doc.ids[doc.loss_mask]) == "4<|end|>six<|end|>"
    assert tokenizer.decode(doc.ids[~doc.loss_mask]) == (
        "<|bos|><|system|>be brief<|end|><|user|>what is 2+2?<|end|><|assistant|><|user|>and 3+3?<|end|><|assistant|>")


@pytest.mark.parametrize("template_bos", [True, False])
def test_chat_without_generation_markers_uses_prefixes(tokenizer, template_bos):
    reference_ids, reference_mask = DocumentEncoder(tokenizer).chat(CHAT)
    plain = byte_tokenizer()
    template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain.chat_template = template if template_bos else template.replace("{{ bos_token }}", "")
    encoder = DocumentEncoder(plain)
    assert not encoder.template_marks_generation
    ids, mask = encoder.chat(CHAT)
    # The BOS comes from the template or is added once; the spans match the {% generation %} ones.
    np.testing.assert_array_equal(ids, reference_ids)
    np.testing.assert_array_equal(mask, reference_mask)


@pytest.mark.parametrize("generation_markers", [True, False])
def test_chat_targets_end_at_the_end_of_turn_token_not_the_separator_after_it(generation_markers):
    """ChatML-like: each turn ends "<|end|>\n". The prefix rendering spans the "\n" up to the next turn, and a
    template may put it inside {% generation %}; the model stops at <|end|>, so neither trains the newline."""
    tokenizer = byte_tokenizer()
    template = CHAT_TEMPLATE.replace("'<|end|>' }}", "'<|end|>\n' }}")
    tokenizer.chat_template = template if generation_markers else template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    encoder = DocumentEncoder(tokenizer)
    assert encoder.template_marks_generation == generation_markers
    ids, mask = encoder.chat(CHAT)
    assert tokenizer.decode(ids[mask]) == "4<|end|>six<|end|>"
    assert tokenizer.decode(ids).count("<|end|>\n") == 5


def test_tokenizer_without_bos(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.bos_token = None
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{{ bos_token }}", "")
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"messages": CHAT[1:3]}])
    text_doc, chat_doc = documents(make_cfg(path), tokenizer)
    assert text_doc.ids.tolist() == [*b"ab", tokenizer.eos_token_id]
    assert tokenizer.decode(chat_doc.ids[:2]) == "<|user|>w"


def test_directory_of_txt_and_jsonl(tokenizer, tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first book\n\nchapter two\n")
    write_jsonl(tmp_path / "b" / "c.jsonl", [{"text": "x"}, {"messages": CHAT[1:3]}])
    (tmp_path / "b" / "empty.txt").write_text("")
    (tmp_path / "notes.md").write_text("ignored")
    docs = documents(make_cfg(tmp_path), tokenizer)
    assert [tokenizer.decode(d.ids) for d in docs] == [
        "<|bos|>first book\n\nchapter two\n<|eos|>",  # one .txt file is one document, blank lines included
        "<|bos|>x<|eos|>",
        "<|bos|><|user|>what is 2+2?<|end|><|assistant|>4<|end|>",
    ]
    assert [d.chat for d in docs] == [False, False, True]


def test_positions_reopen_the_same_document(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("a text file")
    lines = [json.dumps({"text": f"line {i}"}) if i % 3 else "" for i in range(200)]  # blank lines skipped
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    source = open_source(make_cfg(tmp_path), tokenizer)
    docs = list(source.documents(START))
    assert len(docs) == 1 + sum(1 for i in range(200) if i % 3)
    for index in range(0, len(docs), 7):
        doc = docs[index]
        again = source.read(doc.position)
        assert again.ids.tolist() == doc.ids.tolist() and again.next == doc.next
        rest = [d.ids.tolist() for d in source.documents(doc.position)]
        assert rest == [d.ids.tolist() for d in docs[index:]]


def test_hf_datasets_directory(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    Dataset, DatasetDict = datasets.Dataset, datasets.DatasetDict

    texts = [f"row {i} " * (i % 5 + 1) for i in range(600)]  # more rows than one read slice
    Dataset.from_dict({"text": texts, "other": list(range(600))}).save_to_disk(tmp_path / "plain")
    docs = documents(make_cfg(tmp_path / "plain"), tokenizer)
    assert [tokenizer.decode(d.ids[1:-1]) for d in docs] == texts
    source = open_source(make_cfg(tmp_path / "plain"), tokenizer)
    assert source.read(docs[300].position).ids.tolist() == docs[300].ids.tolist()

    chats = DatasetDict({"train": Dataset.from_dict({"messages": [CHAT, CHAT[1:3]]}),
                         "test": Dataset.from_dict({"messages": [CHAT[:1]]})})
    chats.save_to_disk(tmp_path / "chats")
    first, second = documents(make_cfg(tmp_path / "chats"), tokenizer)
    assert tokenizer.decode(first.ids[first.loss_mask]) == "4<|end|>six<|end|>"
    assert tokenizer.decode(second.ids[second.loss_mask]) == "4<|end|>"
    assert first.chat and second.chat and not any(d.chat for d in docs)  # packing keeps chats whole (data.long_chats)

    Dataset.from_dict({"body": ["x"]}).save_to_disk(tmp_path / "wrong")
    with pytest.raises(DataError, match=r"data\.text_field.*data\.messages_field|data\.messages_field.*data\.text_field"):
        open_source(make_cfg(tmp_path / "wrong"), tokenizer)


def test_missing_path_names_file_and_key(tokenizer, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as e:
        build_dataloader(make_cfg(missing), tokenizer)
    assert str(missing) in str(e.value) and "data.path" in str(e.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_has_no_documents(tokenizer, tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{path}.*no documents"):
        build_dataloader(make_cfg(path), tokenizer)


def test_malformed_jsonl_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=rf"{path}, line 3: malformed JSON"):
        build_dataloader(make_cfg(path), tokenizer)


def test_line_without_fields_names_file_line_and_keys(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "no known field"}])
    with pytest.raises(DataError) as e:
        documents(make_cfg(path), tokenizer)
    message = str(e.value)
    assert f"{path}, line 2" in message and "data.text_field" in message and "data.messages_field" in message


def test_custom_field_names(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "a"}, {"conv": CHAT[1:3]}])
    docs = documents(make_cfg(path, text_field="body", messages_field="conv"), tokenizer)
    assert [tokenizer.decode(d.ids) for d in docs] == ["<|bos|>a<|eos|>", "<|bos|><|user|>what is 2+2?<|end|><|assistant|>4<|end|>"]


@pytest.mark.parametrize("messages, needle", [
    ("not a list", "must be a non-empty list"),
    ([{"role": "user"}], "must be an object with string `role` and `content`"),
])
def test_bad_messages_name_file_and_line(tokenizer, tmp_path, messages, needle):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": messages}])
    with pytest.raises(DataError, match=rf"{path}, line 2: .*data\.messages_field.*{needle}"):
        documents(make_cfg(path), tokenizer)


def test_unsupported_inputs(tokenizer, tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.path=.*unsupported file type '\.csv'"):
        open_source(make_cfg(tmp_path / "data.csv"), tokenizer)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match=r"data\.path=.*no \.txt or \.jsonl files"):
        open_source(make_cfg(tmp_path / "nothing"), tokenizer)


def test_large_jsonl_is_streamed(tokenizer, tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "a long-ish line of training text " * 8}) + "\n"
    with path.open("w") as f:
        for _ in range(40_000):
            f.write(line)
    size = path.stat().st_size
    loader = build_dataloader(make_cfg(path), tokenizer)
    batch = next(loader)
    assert batch.input_ids.shape == (1, 64)
    # The first batch came from a prefix of the file: the reader stands a few hundred lines in, not at the end.
    read_up_to = loader.state_dict()["next"][1]
    assert 0 < read_up_to < size / 100


def test_chat_refused_by_template_names_file_and_line(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with "
                               "a user turn') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT[1:3]}, {"messages": CHAT[2:3]}])
    with pytest.raises(DataError, match=rf"{path}, line 2: the chat template rejected .* start with a user turn"):
        documents(make_cfg(path), tokenizer)


# ---- ShareGPT and Alpaca rows (data.format) -------------------------------------------------------------

SHAREGPT = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "what is 2+2?"},
                              {"from": "gpt", "value": "4"}, {"from": "human", "value": "and 3+3?"},
                              {"from": "gpt", "value": "six"}]}
ALPACA = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}


@pytest.mark.parametrize("data_format", ["auto", "sharegpt"])
def test_sharegpt_rows_are_the_same_chat_as_messages(tokenizer, tmp_path, data_format):
    reference = documents(make_cfg(write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])), tokenizer)[0]
    (doc,) = documents(make_cfg(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT]), format=data_format), tokenizer)
    assert doc.chat
    np.testing.assert_array_equal(doc.ids, reference.ids)
    np.testing.assert_array_equal(doc.loss_mask, reference.loss_mask)


@pytest.mark.parametrize("data_format", ["auto", "alpaca"])
def test_alpaca_rows_train_on_the_output_only(tokenizer, tmp_path, data_format):
    rows = [ALPACA, {"instruction": "Say hi.", "input": "", "output": "hi"}, {"instruction": "Say yo.", "output": "yo"}]
    docs = documents(make_cfg(write_jsonl(tmp_path / "a.jsonl", rows), format=data_format), tokenizer)
    assert [tokenizer.decode(d.ids) for d in docs] == [
        "<|bos|><|user|>Add the numbers.\n\n2 and 2<|end|><|assistant|>4<|end|>",
        "<|bos|><|user|>Say hi.<|end|><|assistant|>hi<|end|>",
        "<|bos|><|user|>Say yo.<|end|><|assistant|>yo<|end|>",
    ]
    assert [tokenizer.decode(d.ids[d.loss_mask]) for d in docs] == ["4<|end|>", "hi<|end|>", "yo<|end|>"]


def test_auto_format_decides_per_row_and_labels_only_the_answers(tokenizer, tmp_path):
    """One file of all four formats, packed into rows: the labels are the text and the assistant turns alone."""
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "plain"}, {"messages": CHAT[1:3]}, SHAREGPT, ALPACA])
    cfg = make_cfg(path)
    cfg.seq_len, cfg.train.micro_batch = 256, 1
    batch = next(iter(build_dataloader(cfg, tokenizer)))
    assert target_spans(tokenizer, batch.labels[0]) == [
        "plain<|eos|>", "4<|end|>", "4<|end|>", "six<|end|>", "4<|end|>"]


@pytest.mark.parametrize("record, data_format, needle", [
    ({"conversations": [{"from": "robot", "value": "x"}]}, "auto", r"line 1: 'conversations' \(ShareGPT\)\[0\] must be an object with `from` \(system, human"),
    ({"conversations": []}, "sharegpt", "non-empty list of {from, value} turns"),
    ({"instruction": "x", "output": 3}, "auto", "Alpaca row needs string `instruction` and `output`"),
    ({"text": "plain"}, "alpaca", "Alpaca row needs"),
    ({"messages": CHAT}, "sharegpt", r"no ShareGPT 'conversations'.*found \['messages'\]"),
    ({"prompt": "x"}, "auto", r"no Alpaca 'instruction' and 'output'; found \['prompt'\]"),
])
def test_rows_without_their_format_name_line_and_fields(tokenizer, tmp_path, record, data_format, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(DataError, match=needle):
        documents(make_cfg(path, format=data_format), tokenizer)


def test_data_format_is_a_checked_config_key():
    from longfit.config import ConfigError, load_config

    assert load_config(None, ["data.format=sharegpt"]).data.format == "sharegpt"
    with pytest.raises(ConfigError, match="data.format"):
        load_config(None, ["data.format=csv"])


def test_sharegpt_and_alpaca_datasets_directories(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([SHAREGPT, SHAREGPT]).save_to_disk(tmp_path / "sharegpt")
    reference = documents(make_cfg(write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])), tokenizer)[0]
    first, second = documents(make_cfg(tmp_path / "sharegpt"), tokenizer)
    np.testing.assert_array_equal(first.ids, reference.ids)
    np.testing.assert_array_equal(second.loss_mask, reference.loss_mask)
    rows = [ALPACA, {"instruction": "Say yo.", "output": "yo"}]  # Arrow fills the second row's input with null
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "alpaca")
    source = open_source(make_cfg(tmp_path / "alpaca", format="alpaca"), tokenizer)
    docs = list(source.documents(START))
    assert [tokenizer.decode(d.ids[d.loss_mask]) for d in docs] == ["4<|end|>", "yo<|end|>"]
    assert source.read(docs[1].position).ids.tolist() == docs[1].ids.tolist()
