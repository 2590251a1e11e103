"""The README and the documentation site cannot drift from the code.

Every `longfit ...` command the README and docs/ show in a shell block (and every inline one that sets config keys)
parses with `longfit`'s own argparse tree and its key=value settings pass config validation, without running
anything. The README stays a five-minute read: at most 250 lines, the install + main job command and the test
command (the one `.ci/run` runs) in its first 60, every relative link resolving, and its families table what
`python docs/gen/docgen.py readme` makes. The generated pages (docs/gen/docgen.py, run by `mkdocs build`) cover
every config key, every subcommand and every facade name; `.ci/run` builds the site with `--strict`.
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "gen"))

import docgen  # noqa: E402

README = ROOT / "README.md"
DOCS = sorted(path for path in (ROOT / "docs").rglob("*.md") if "gen" not in path.relative_to(ROOT / "docs").parts)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
INLINE = re.compile(r"`(longfit [^`]+)`")
SYNOPSIS = re.compile(r"[|\[\]<>]|\.\.\.")  # `longfit export OUTPUT_DIR [--step N]`, `longfit bench memory|cp`
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
MAIN_JOB = "longfit train examples/smollm2_retrieval.yaml"


def shown_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) of each `longfit` command a markdown file shows: in shell blocks, `$ longfit` lines of
    other blocks, and inline spans that set config keys (key=value)."""
    text, found = path.read_text(), []
    for block in FENCE.finditer(text):
        first = text[:block.start()].count("\n") + 2
        body = block.group(2).replace("\\\n", " ")
        for offset, line in enumerate(body.splitlines()):
            if block.group(1) not in SHELL:
                if not line.startswith("$ longfit"):
                    continue
                line = line[2:]
            found += [(first + offset, command) for command in _longfit_commands(line)]
    for number, line in enumerate(text.splitlines(), 1):
        for span in INLINE.findall(line):
            if "=" in span and not SYNOPSIS.search(span):
                found.append((number, span))
    return found


def _longfit_commands(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    commands, segment = [], []
    for word in [*words, "&&"]:
        if word in ("&&", "||", ";", "|"):
            while segment and ENV.match(segment[0]):
                segment.pop(0)
            if segment[:1] == ["longfit"]:
                commands.append(shlex.join(segment))
            elif "-m" in segment and segment[segment.index("-m") + 1:][:1] == ["longfit"]:  # torchrun / python -m
                commands.append(shlex.join(["longfit", *segment[segment.index("-m") + 2:]]))
            segment = []
        else:
            segment.append(word)
    return commands


@functools.cache
def _parser():
    from longfit.cli import build_parser

    return build_parser()


@pytest.fixture(scope="module", autouse=True)
def docstrings_read_once():
    """`longfit.config.field_docs` parses config.py's source at each call, seven times per load_config: read once."""
    from longfit import config

    original = config.field_docs
    config.field_docs = functools.cache(original)
    yield
    config.field_docs = original


def check_command(command: str) -> None:
    """Parse `command` as `longfit` would and validate the config its items and --set settings make."""
    from longfit.cli import parse
    from longfit.config import ConfigError, load_config, split_config_items

    argv = shlex.split(command)[1:]
    try:
        args = parse(_parser(), argv)
    except SystemExit as stop:
        if stop.code == 0 and "--help" in argv:
            return
        raise AssertionError(f"`{command}` does not parse (argparse exit {stop.code})") from None
    settings = [*(getattr(args, "overrides", None) or []), *(getattr(args, "sets", None) or [])]
    path, overrides = split_config_items(getattr(args, "items", None) or [])
    if path is not None and not (ROOT / path).is_file():
        path = None  # my_run.yaml: a file of the reader's; its overrides are still checked
    try:
        load_config(None if path is None else ROOT / path, [*overrides, *settings])
    except ConfigError as error:
        raise AssertionError(f"`{command}`: {error}") from None


def _each_once() -> list[tuple[Path, int, str]]:
    """Every shown command once, where it is first shown."""
    first: dict[str, tuple[Path, int, str]] = {}
    for path in (README, *DOCS):
        for line, command in shown_commands(path):
            first.setdefault(command, (path, line, command))
    return list(first.values())


COMMANDS = _each_once()


@pytest.mark.parametrize("path,line,command", COMMANDS,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in COMMANDS])
def test_every_command_the_docs_show_parses(path: Path, line: int, command: str) -> None:
    check_command(command)


def test_the_command_check_finds_what_drifted() -> None:
    assert len(COMMANDS) > 60  # the shell blocks of the README and of every job page are read
    check_command("longfit train examples/lora_chat.yaml train.lr=1e-4 --nproc 2")
    for broken, message in [("longfit train my_run.yaml train.lr=-1", "train.lr=-1.0: must be > 0"),
                            ("longfit plan parallel.cpp=2", "unknown config key 'parallel.cpp'"),
                            ("longfit bench cp --set memory.tiled_mlp=maybe", "memory.tiled_mlp"),
                            ("longfit train --nprocs 2", "does not parse"),
                            ("longfit evaluate --model x", "does not parse")]:
        with pytest.raises(AssertionError, match=re.escape(message)):
            check_command(broken)
    assert _longfit_commands('WANDB_MODE=offline longfit train "train.report_to=[wandb]" # a comment') == [
        "longfit train 'train.report_to=[wandb]'"]
    assert _longfit_commands("torchrun --nproc-per-node 8 -m longfit train a.yaml parallel.cp=4") == [
        "longfit train a.yaml parallel.cp=4"]
    assert _longfit_commands("pip install -e . && longfit check model=x") == ["longfit check model=x"]


def test_readme_is_short_with_the_two_commands_first() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the site holds the rest"
    head = "\n".join(lines[:60])
    ci = (ROOT / ".ci" / "run").read_text()
    ci_test_command = next(line for line in ci.splitlines() if line.startswith("pip install") and "pytest" in line)
    assert ci_test_command.replace(" -q", "") in head.splitlines(), "the README's test command is not what .ci/run runs"
    install = next(line for line in head.splitlines() if line.endswith(MAIN_JOB))
    assert install.startswith("pip install torch==2.13.0 && pip install -e ")


def test_readme_links_resolve() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert len(links) > 20
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target = ROOT / link.split("#")[0]
        assert target.exists(), f"README links to {link}, which does not exist"
        if target.suffix == ".md" and "#" in link:
            anchor = link.split("#", 1)[1]
            headings = [re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", target.read_text(), re.M)]
            assert anchor in headings, f"README links to {link}: no such heading"


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS:
        assert f" {page.relative_to(ROOT / 'docs').as_posix()}\n" in nav, f"{page} is not in mkdocs.yml's nav"


def test_readme_families_table_is_up_to_date() -> None:
    readme = README.read_text()
    assert docgen.readme_with_families(readme, docgen.readme_families_table()) == readme, (
        "README's families table is stale: run `python docs/gen/docgen.py readme`")


def test_families_are_read_off_the_tests() -> None:
    families = docgen.tested_families()
    assert families["llama"]["parity"] == ["test_families.py"] and families["llama"]["check"] == ["test_check.py"]
    assert families["qwen3_moe"]["parity"] == ["test_families_moe.py"]
    assert set(families["gpt_oss"]["parity"]) == {"test_families_attention.py", "test_families_moe.py"}
    assert families["qwen3_next"]["parity"] == ["test_families_hybrid.py"] and not families["qwen3_next"]["check"]
    assert families["olmo2"] == {"parity": [], "wrapper": [], "check": ["test_check.py"], "refused": []}
    assert families["mistral3"]["wrapper"] == ["test_wrappers.py"] and families["gemma4"]["wrapper"]
    assert families["bamba"]["parity"] == ["test_families_mixers.py"] and not families["bamba"]["refused"]
    assert "gemma3_text" not in {t for t, k in families.items() if k["refused"]}  # its mutation test is no refusal


def test_families_page_renders_the_sweep() -> None:
    sweep = {"transformers": "5.24.0", "torch": "2.13.0", "rows": [
        {"model_type": "llama", "architecture": "LlamaForCausalLM", "fp32": {"verdict": "exact", "detail": ""},
         "gpu": {"verdict": "exact", "detail": ""}},
        {"model_type": "cohere2", "architecture": "Cohere2ForCausalLM",
         "fp32": {"verdict": "refused", "detail": "logit_scale | outside any module"}, "gpu": None}]}
    page = docgen.families_page(sweep)
    assert "transformers 5.24.0 (torch 2.13.0): 2 types; in fp32, 1 exact, 1 refused." in page
    assert "| `cohere2` | `Cohere2ForCausalLM` | refused | not run | logit_scale \\| outside any module |" in page
    assert "| `llama` | loss and gradients vs eager, one process and cp=2; `longfit check` exact |" in page
    assert "1 of 2 exact" in docgen.readme_families_table(sweep)
    assert "is not in this checkout" in docgen.sweep_section(None)


def test_families_page_lists_the_checkpoint_sweep() -> None:
    """The published checkpoints' configs (#52): each checkpoint's check verdict, train step and plan figures."""
    checkpoints = {"transformers": "5.24.0", "torch": "2.13.0", "rows": [
        {"name": "meta-llama--Llama-3.1-8B", "model_type": "llama", "gpu": {"verdict": "exact", "detail": ""},
         "train": {"verdict": "trained", "loss": 6.2, "detail": "loss 6.2000", "seconds": 60.0},
         "plan_32k": {"verdict": "fits", "peak_gib": 30.5, "capacity_gib": 79.2, "max_seq_len": 262144,
                      "seconds": 40.0, "detail": ""},
         "plan_128k": {"verdict": "timed out", "detail": "no plan within 600 s", "seconds": 600}}]}
    page = docgen.families_page({"transformers": "5.24.0", "torch": "2.13.0", "rows": []}, checkpoints=checkpoints)
    assert ("| meta-llama--Llama-3.1-8B | `llama` | exact | trained (loss 6.20) | fits: 30.5 of 79.2 GiB, longest 256K "
            "(40 s) | timed out: no plan within 600 s |") in page
    assert "(1 exact)" in page and "(1 trained)" in page
    assert "is not in this checkout" in docgen.checkpoint_section(None)


def test_generated_references_cover_the_code() -> None:
    import longfit
    from longfit.config import config_reference

    config = docgen.config_reference_page()
    for key, default, doc in config_reference():
        assert f"| `{key}` | `{default}` |" in config
    cli = docgen.cli_reference_page()
    for command in ("`longfit train`", "`longfit plan`", "`longfit check`", "`longfit bench gpu`",
                    "`longfit bench trl`", "`longfit eval`", "`longfit export`"):
        assert command in cli
    assert "--max-context" in cli and "--rdzv-endpoint" in cli
    api = docgen.api_reference_page()
    for name in longfit.__all__:
        assert f"## `longfit.{name}`" in api
    page = docgen.render("# T\n\n<!-- generated: config-reference -->\n")
    assert "<!-- generated" not in page and "`train.lr`" in page


def test_benchmark_tables_and_plots() -> None:
    pytest.importorskip("matplotlib")
    tables = docgen.markdown_tables("x\n\n| a | b |\n| --- | ---: |\n| 1 | **2.5** |\n| 3 | 4 |\n\ntext\n")
    assert tables == [[{"a": "1", "b": "2.5"}, {"a": "3", "b": "4"}]]
    assert docgen.gpu_rows() and docgen.plan_accuracy_rows() and docgen.memory_rows() and docgen.cp_rows()
    plots = docgen.plots()
    assert set(plots) == set(docgen.PLOTS)
    assert all(png.startswith(b"\x89PNG") for png in plots.values())


def test_python_in_the_docs_compiles_and_the_trl_script_is_the_example() -> None:
    import ast

    for path in (README, *DOCS):
        for block in FENCE.finditer(path.read_text()):
            if block.group(1) == "python":
                ast.parse(block.group(2), filename=str(path))
    script = FENCE.search((ROOT / "docs" / "jobs" / "trl.md").read_text()).group(2)
    assert script in (ROOT / "examples" / "trl_sft.py").read_text(), "docs/jobs/trl.md shows another examples/trl_sft.py"
