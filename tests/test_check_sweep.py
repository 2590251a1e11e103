"""The sweep of `longfit check` over transformers' decoder-only causal LMs (longfit.check.sweep): the types it takes,
how it reads the check's answers, and (slow) a run on a few types writing the results files the docs read."""

from __future__ import annotations

import json

import pytest

from longfit.check.sweep import VERDICTS, classify, decoder_only_types, main


def test_the_sweep_takes_decoders_alone() -> None:
    types = decoder_only_types()
    assert {"llama", "gpt2", "gpt_neox", "qwen3_5", "gemma3", "mamba"} <= set(types)
    assert not {"bart", "bert", "roberta", "whisper", "musicgen"} & set(types)  # encoder-decoders, BERT-style encoders


@pytest.mark.parametrize(("message", "verdict"), [
    ("DIR is not computed exactly: layer 0, dense (...): the output of self_attn differs by 1e-2 (...)", "not exact"),
    ("DIR is refused by longfit: the x model has Mamba (state-space) layers", "refused"),
    ("DIR is not computed exactly: layer 0, dense (...): self_attn fails in longfit's step: TypeError: x", "traceback"),
    ("DIR: longfit check cannot build a shrunken copy of this x config: ValueError: y", "cannot shrink"),
    ("DIR: transformers cannot build the x model of this config (KeyError: 'y')", "transformers fails"),
])
def test_a_check_line_is_read_as_its_verdict(message: str, verdict: str) -> None:
    assert classify(message) == verdict


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_sweep_writes_a_row_per_type_in_both_regimes(tmp_path) -> None:
    main(["--out", str(tmp_path), "--types", "llama", "gpt2", "deepseek_v32", "bloom", "gemma4_assistant"])
    results = json.loads((tmp_path / "check_sweep.json").read_text())
    assert {"transformers", "torch", "rows"} <= set(results)
    rows = {row["model_type"]: row for row in results["rows"]}
    assert rows["llama"]["architecture"] == "LlamaForCausalLM"
    for row in rows.values():
        assert {row[regime]["verdict"] for regime in ("fp32", "gpu")} <= set(VERDICTS)
    assert rows["llama"]["fp32"] == rows["llama"]["gpu"] == {"verdict": "exact", "detail": ""}
    assert rows["gpt2"]["fp32"] == rows["gpt2"]["gpu"] == {"verdict": "exact", "detail": ""}  # its dropout off
    assert rows["deepseek_v32"]["fp32"] == rows["deepseek_v32"]["gpu"] == {"verdict": "exact", "detail": ""}  # #57
    assert rows["bloom"]["gpu"]["verdict"] == "refused" and "ALiBi" in rows["bloom"]["gpu"]["detail"]
    assert rows["gemma4_assistant"]["fp32"]["verdict"] == "transformers fails"
    table = (tmp_path / "check_sweep.md").read_text()
    assert table.startswith("# ") and "| exact | 3 | 3 |" in table and "| gpt2 | GPT2LMHeadModel | exact" in table
