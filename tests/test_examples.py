"""Every examples/*.yaml loads and plans as its header says (`longfit plan ...` on the GPU and GPU count it names,
analytic: no weights), its `longfit train` line parses into a valid config, and its chat data trains on answers."""

import re
import shlex
from pathlib import Path

import pytest

from longfit.cli import build_parser, main, parse
from longfit.config import load_config, split_config_items

ROOT = Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def header_commands(path: Path, command: str) -> list[list[str]]:
    """The `longfit COMMAND ...` lines of the example's header comment, as argv after `longfit`."""
    lines = re.findall(rf"^#\s+longfit ({command}\b.*)$", path.read_text(), flags=re.MULTILINE)
    return [shlex.split(line) for line in lines]


def skip_without_its_model(path: Path) -> None:
    """A real model that a package ships (smollm2-135m) is planned where the package is installed; a model that an
    example's script writes (examples/document_qa.py's tiny wrapper) where it was written."""
    from longfit.config import ConfigError
    from longfit.models.source import packaged_gguf

    model = load_config(path).model
    if model.startswith(str(ROOT / "runs")) and not Path(model).is_dir():
        pytest.skip(f"{model} is written by the script the example's header names")
    try:
        packaged_gguf(model)
    except ConfigError as e:
        pytest.skip(str(e))


def test_the_examples_cover_the_common_cases():
    names = {path.stem for path in EXAMPLES}
    assert {"lora_chat", "full_cp_8gpu", "gemma3_windows", "llama8b_1m_one_gpu"} <= names
    for path in EXAMPLES:
        assert path.read_text().startswith("# "), f"{path.name}: a header comment says what it is"


@pytest.mark.slow  # plans many layouts: minutes of layer traces on a cold trace cache
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plans_as_its_header_says(path, monkeypatch, capsys):
    skip_without_its_model(path)
    monkeypatch.chdir(ROOT)  # the header's commands run from the repository's root
    commands = header_commands(path, "plan") or [["plan", str(path.relative_to(ROOT))]]
    for argv in commands:
        assert main(argv) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "does NOT fit" not in out, out
        if "--gpu" in argv:
            assert re.search(r"^  fits NVIDIA", out, flags=re.MULTILINE), out
    for argv in header_commands(path, "train"):
        args = parse(build_parser(), argv)
        cfg = load_config(*split_config_items(args.items))
        assert Path(cfg.output_dir).is_absolute() and Path(cfg.output_dir).parent == ROOT / "runs"


@pytest.mark.parametrize("name", ["chat.jsonl", "alpaca.jsonl"])
def test_example_chat_data_trains_on_the_answers(name):
    from longfit.config import Config
    from longfit.data.documents import START
    from longfit.data.sources import open_source
    from longfit.data.tokenizer import byte_tokenizer

    cfg = Config()
    cfg.data.path = str(ROOT / "examples" / "data" / name)
    tokenizer = byte_tokenizer()
    documents = list(open_source(cfg, tokenizer).documents(START))
    assert len(documents) >= 10 and all(d.chat for d in documents)
    for document in documents:
        targets = tokenizer.decode(document.ids[document.loss_mask])
        assert targets.endswith("<|end|>") and "<|user|>" not in targets and "<|assistant|>" not in targets


@pytest.mark.slow  # a one-process run, a --nproc 2 run and its resume, each with its preflight check and evaluations
@pytest.mark.timeout(1800)
def test_the_document_example_under_cp2_equals_one_process_resumes_and_exports(tmp_path) -> None:
    """examples/qwen3_5_document_qa.yaml as its header runs it (#54), on its script's tiny Qwen3.5 wrapper and page
    images written under tmp_path and four steps: `--nproc 2 parallel.cp=2` logs the one-process losses within 1e-4;
    resumed from its step-2 checkpoint, the same losses and export bit for bit; the export is the wrapper, which
    transformers loads and runs on an image of the rows."""
    import shutil
    import sys

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "tests"))
    from document_qa import write_pages, write_tiny_qwen3_5
    from test_media import image_batch, logged_losses, train_on_two_ranks

    example = ROOT / "examples" / "qwen3_5_document_qa.yaml"
    checkpoint = write_tiny_qwen3_5(tmp_path / "qwen3_5-tiny")
    rows = write_pages(tmp_path / "document-qa", documents=8, pages=24)

    def argv(out: str) -> list[str]:
        return [str(example), f"model={checkpoint}", f"data.path={rows}", f"output_dir={tmp_path / out}",
                "train.steps=4", "train.save_every=2"]

    assert main(["train", *argv("one")]) == 0
    train_on_two_ranks(*argv("cp2"), "parallel.cp=2")
    one = logged_losses(tmp_path / "one")
    first = logged_losses(tmp_path / "cp2")
    assert len(one) == 4 and first == pytest.approx(one, rel=1e-4)
    exported = load_file(tmp_path / "cp2" / "final" / "model.safetensors")

    shutil.rmtree(tmp_path / "cp2" / "checkpoints" / "step_00000004")
    shutil.rmtree(tmp_path / "cp2" / "final")
    assert "resuming from" in train_on_two_ranks(*argv("cp2"), "parallel.cp=2")
    assert logged_losses(tmp_path / "cp2") == first
    again = load_file(tmp_path / "cp2" / "final" / "model.safetensors")
    assert again.keys() == exported.keys() == load_file(checkpoint / "model.safetensors").keys()
    assert all(torch.equal(again[key], exported[key]) for key in exported)

    export = tmp_path / "cp2" / "final"
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    batch = image_batch(export, rows, load_config(example).seq_len)
    start, end = batch.documents.rows[0][0]  # the first document: its pages are the batch's first images
    grids = batch.media.grid_thw[: batch.media.items_in(0, start, end)]
    patches = int(grids.prod(dim=1).sum())
    logits = model(input_ids=batch.input_ids[:, start:end], pixel_values=batch.media.pixel_values[:patches],
                   image_grid_thw=grids, mm_token_type_ids=batch.media.token_types[:, start:end]).logits
    assert torch.isfinite(logits).all()
