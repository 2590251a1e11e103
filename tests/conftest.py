"""Fixtures shared by the trainer tests (a tiny local model directory, a small JSONL corpus), and the `gpu` marker's skip.

The default run deselects `gpu` tests (pyproject's addopts) and every test that trains pins itself to the
CPU (train.device=cpu, --device cpu), so the suite computes the same on a CPU-only and a GPU machine.
`python -m pytest -m gpu` runs the CUDA tests; without a GPU they skip.

Ctrl-C stops the suite at once: the session's SIGINT handler raises KeyboardInterrupt, as Python's does, and
also remembers the signal, so a test whose code caught the KeyboardInterrupt (`longfit.cli.main` turns it into
exit status 130) still ends the session after it, with pytest's "interrupted" status (2). The trainer leaves a
handler the program set to the program (`longfit.train.signals`), so it does not hold the signal back either.
"""

import json
import signal
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """`tiny_llama_dir(layers)`: a local Hugging Face directory (config + safetensors + tokenizer) of a tiny Llama of
    that many layers, written once per session and layer count."""
    from transformers import AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer
    from longfit.models.presets import preset_config

    written: dict[int, Path] = {}

    def write(layers: int) -> Path:
        if layers not in written:
            path = tmp_path_factory.mktemp(f"tiny-llama-{layers}-layers")
            config = preset_config("llama-tiny")
            config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, layers
            config.num_attention_heads, config.num_key_value_heads = 4, 2
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
            byte_tokenizer().save_pretrained(path)
            written[layers] = path
        return written[layers]

    return write


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama_dir) -> Path:
    """A local Hugging Face directory (config + safetensors + tokenizer) of a 2-layer Llama."""
    return tiny_llama_dir(2)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1)}) for i in range(60)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def one_thread():
    """Torch on one thread for the test, as the parallel harness's ranks run: on tensors this small, OpenMP
    threads spinning on each kernel cost ~7-15x the CPU time of one thread on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _SuiteInterrupt:
    """The session's SIGINT handler (see the module docstring)."""

    def __init__(self):
        self.received = False
        self.previous = signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame):
        self.received = True
        raise KeyboardInterrupt

    def restore(self):
        signal.signal(signal.SIGINT, self.previous)


_INTERRUPT = pytest.StashKey[_SuiteInterrupt]()


def pytest_sessionstart(session):
    session.config.stash[_INTERRUPT] = _SuiteInterrupt()


def pytest_sessionfinish(session):
    session.config.stash[_INTERRUPT].restore()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:
        if item.config.stash[_INTERRUPT].received:
            raise KeyboardInterrupt  # over the failure the caught interrupt caused (main's 130)
