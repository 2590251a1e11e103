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
