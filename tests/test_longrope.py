"""LongRoPE at real head widths through `longfit train` (#52): a run's `rope.type=longrope` and a Phi-3.5-mini-shaped
checkpoint, both with factors of a real head_dim, which `longfit check` once refused ("short_factor field must have
length 8, got 48": its copy narrowed the heads and kept the factors).

- "phi-3.5-mini": a phi3 checkpoint written by transformers from Phi-3.5-mini-instruct's published rope_parameters
  (48 short and 48 long factors), original_max_position_embeddings (4096), max_position_embeddings (131072) and
  head_dim (96), at tiny width: 2 heads of 96, 2 layers. Its rows of 128 tokens are within the original window, so
  they train under the short factors (transformers' choice for such rows), with Phi-3.5's attention scaling.
- "qwen3-longrope": a tiny Qwen3 with Qwen3's head_dim (128) and a window of 16 positions, run with
  rope.type=longrope and 64 short and 64 long factors on the command line (constructed, the length its heads need):
  rows of 128 tokens past the window, so the long factors at every position (longfit.models.rope makes LongRoPE
  static at seq_len).

Each: `longfit check` at the default seq_len (8192: past Phi-3.5's 4096, its long factors) says exact and keeps
the head width (one process; cp=2 ring and Ulysses with tiled layers, fp32 and train.dtype=bf16); `longfit train` on
one process logs the first loss of transformers' eager model on the same rows, one document per row and packed (each
document alone), within longfit check's fp32 bound; `longfit train --nproc 2 parallel.cp=2`, ring and Ulysses, logs
every step's loss of the one-process run (fp32 within 1e-4, as tests/test_families_attention.py; train.dtype=bf16
within 2e-2, tests/test_multinode.py's bf16 bound). All slow (each a `longfit check` or `longfit train`); the default
suite keeps tests/test_check_shrink.py's LongRoPE cases (the copy's frequencies are the checkpoint's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from batch_helpers import per_document_loss  # noqa: E402
from family_runs import cp2_losses, logged_losses, short_documents, train_argv  # noqa: E402,F401 (fixture)
from phi35_mini import PHI35_MINI  # noqa: E402

from longfit.config import load_config

QWEN3_HALF = 64  # Qwen3's heads of 128: 64 rotated frequencies
SHORT, LONG = [1.0 + i / 64 for i in range(QWEN3_HALF)], [1.0 + i / 4 for i in range(QWEN3_HALF)]
SETTINGS = {
    "phi-3.5-mini": [],
    "qwen3-longrope": ["rope.type=longrope", f"rope.short_factor={SHORT}", f"rope.long_factor={LONG}"],
}
TINY = dict(vocab_size=384, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=96,
            bos_token_id=256, eos_token_id=257, pad_token_id=258)  # the byte tokenizer's


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer

    phi = {key: value for key, value in PHI35_MINI.items() if key != "model_type"}
    configs = {
        "phi-3.5-mini": AutoConfig.for_model("phi3", **{**phi, **TINY, "hidden_size": 2 * 96}),  # head_dim 96
        "qwen3-longrope": AutoConfig.for_model("qwen3", **TINY, hidden_size=64, head_dim=2 * QWEN3_HALF,
                                               max_position_embeddings=16),
    }
    root = tmp_path_factory.mktemp("longrope-checkpoints")
    for name, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        byte_tokenizer().save_pretrained(root / name)
    return {name: root / name for name in configs}


@pytest.fixture(scope="module")
def long_documents(tmp_path_factory) -> Path:
    """Documents of 300-400 tokens: every row of 128 holds one document (a piece of it)."""
    path = tmp_path_factory.mktemp("long-documents") / "corpus.jsonl"
    documents = (json.dumps({"text": f"doc {i}: " + "the quick brown fox jumps. " * (11 + i % 4)}) for i in range(12))
    path.write_text("".join(f"{document}\n" for document in documents))
    return path


def one_rank_losses(checkpoint: Path, corpus: Path, out: Path, *settings: str) -> list[float]:
    from longfit.cli import main

    assert main(["train", *train_argv(checkpoint, corpus, out), *settings]) == 0
    return logged_losses(out)


def eager_reference(checkpoint: Path, cfg):
    """transformers' eager model of the run's config (its RoPE as `rope.*` sets it) with the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    from longfit.models.loading import resolve_model_config

    config = resolve_model_config(str(checkpoint), cfg)
    return AutoModelForCausalLM.from_pretrained(checkpoint, config=config, attn_implementation="eager")


CHECKS = [pytest.param(name, [], id=f"{name}-one-process") for name in SETTINGS] + [
    pytest.param(name, ["parallel.cp=2", f"parallel.cp_method={method}", "memory.tiled_layers=true",
                        f"train.dtype={dtype}"], id=f"{name}-cp2-{method}-{dtype}")
    for name in SETTINGS for method in ("ring", "ulysses") for dtype in ("fp32", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("name,settings", CHECKS)
def test_longfit_check_says_exact(checkpoints, name, settings) -> None:
    """`longfit check` of the run (its rope.* settings): exact, its copy with the checkpoint's head width (and so
    the factors as given); under cp=2 with tiled layers, the two gloo ranks' steps compared too."""
    from longfit.check.parity import check_run

    cfg = load_config(None, [f"model={checkpoints[name]}", "train.device=cpu", *SETTINGS[name], *settings])
    report = check_run(cfg, "cpu")
    assert report.exact, "\n".join(report.lines() + [report.refusal or ""])
    head = 96 if name == "phi-3.5-mini" else 2 * QWEN3_HALF
    assert any(f"head_dim={head} kept" in note for note in report.shrunk.notes)
    assert sum(c.name.startswith("rank ") for c in report.comparisons) == (2 if settings else 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one-document", "packed"])
@pytest.mark.parametrize("name", SETTINGS)
def test_longfit_train_on_one_rank_matches_eager(checkpoints, long_documents, short_documents, tmp_path, name, layout):
    """The first logged loss is transformers' eager model's on the same rows (each document alone), within longfit
    check's fp32 bound; the loss falls over the 3 steps."""
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer

    corpus = long_documents if layout == "one-document" else short_documents
    losses = one_rank_losses(checkpoints[name], corpus, tmp_path / "run", *SETTINGS[name])
    cfg = load_config(None, [*train_argv(checkpoints[name], corpus, tmp_path), *SETTINGS[name]])
    first = next(iter(build_dataloader(cfg, load_tokenizer(cfg.model))))
    documents = first.cu_seqlens.numel() - 1 if first.cu_seqlens is not None else first.input_ids.shape[0]
    rows = first.input_ids.shape[0]
    assert documents == rows if layout == "one-document" else documents > 2 * rows, (documents, rows)
    with torch.no_grad():
        reference = per_document_loss(eager_reference(checkpoints[name], cfg), first)
    assert abs(losses[0] - reference.item()) <= 1e-5 * reference.item(), (losses[0], reference.item())
    assert len(losses) == 3 and losses[-1] < losses[0], losses


@pytest.fixture(scope="module")
def packed_one_rank(checkpoints, short_documents, tmp_path_factory):
    """(name, dtype) -> the losses `longfit train` logs on one process on packed rows (run once each)."""
    runs: dict[tuple[str, str], list[float]] = {}

    def losses(name: str, dtype: str) -> list[float]:
        if (name, dtype) not in runs:
            out = tmp_path_factory.mktemp(f"one-rank-{name}-{dtype}") / "run"
            runs[name, dtype] = one_rank_losses(checkpoints[name], short_documents, out, *SETTINGS[name],
                                                f"train.dtype={dtype}")
        return runs[name, dtype]

    return losses


BOUND = {"fp32": 1e-4, "bf16": 2e-2}  # tests/test_families_attention.py's cp=2 bound; tests/test_multinode.py's bf16


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("name", SETTINGS)
def test_longfit_train_cp2_matches_one_rank(checkpoints, short_documents, packed_one_rank, tmp_path, name, method,
                                            dtype):
    """`longfit train --nproc 2 parallel.cp=2` on packed rows: every step's loss that of one process (each step after
    the first depends on the gradients before it)."""
    losses = cp2_losses(checkpoints[name], short_documents, tmp_path / "cp2", method, *SETTINGS[name],
                        f"train.dtype={dtype}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(packed_one_rank(name, dtype)), rtol=BOUND[dtype],
                               atol=0)
