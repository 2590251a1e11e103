"""`longfit train` asks `longfit check` before it builds anything: a model the check does not call exact under the
run's techniques is refused in one line and nothing is trained; the verdict is cached on disk by architecture and
techniques and read back by the next run; `train.accept_inexact=true` turns the refusal into a warning."""

from __future__ import annotations

import pytest

import longfit.check.gate as gate
import longfit.models.attention as attention
from longfit.cli import main
from longfit.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def verdicts(tmp_path, monkeypatch):
    """A cache of verdicts of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "longfit" / "check_verdicts"


def window_one_token_short(monkeypatch) -> None:
    """A mutation of longfit's attention: sliding windows one token shorter than the config's."""
    original = attention.blockwise_attention

    def one_token_short(q, k, v, scale, documents, window, softcap, sinks):
        return original(q, k, v, scale, documents, None if window is None else window - 1, softcap, sinks)

    monkeypatch.setattr(attention, "blockwise_attention", one_token_short)


def test_train_trains_nothing_on_a_model_the_check_calls_not_exact(tmp_path, verdicts, monkeypatch, capsys) -> None:
    """Mistral's sliding window, one token short in longfit's attention: `longfit train` refuses it in one line
    naming the layer and part, creates no output_dir; a second run reads the verdict from the cache."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer

    model = tmp_path / "mistral"
    config = AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=4096, vocab_size=384, hidden_size=64,
                                  intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)  # weights: `longfit train` asks for them first
    byte_tokenizer().save_pretrained(model)
    capsys.readouterr()  # transformers' progress bars
    window_one_token_short(monkeypatch)
    run = ["train", f"model={model}", "seq_len=4096", "train.device=cpu", f"output_dir={tmp_path / 'run'}"]
    assert main(run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longfit: error: "), err
    assert "is not computed exactly: layer 0, dense" in err[0] and "the output of self_attn differs" in err[0]
    assert "train.accept_inexact=true" in err[0]
    assert not (tmp_path / "run").exists()
    assert len(list(verdicts.glob("*.json"))) == 2  # under what is rehearsed and under the run's inputs

    def no_check(cfg, device_type):
        raise AssertionError("the cached verdict is read, not checked again")

    monkeypatch.setattr(gate, "run_check", no_check)
    assert main(run) == 2
    assert "the output of self_attn differs" in capsys.readouterr().err
    cfg = load_config(None, run[1:] + ["train.accept_inexact=true"])
    warnings: list[str] = []
    verdict = gate.require_exact(cfg, "cpu", log=warnings.append)
    assert verdict.cached and not verdict.exact
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "self_attn differs" in warnings[0]


def test_a_directory_without_weights_is_refused_before_the_check(tmp_path, verdicts, monkeypatch, capsys) -> None:
    """A config-only directory (what `longfit check` and `longfit plan` need): `longfit train` says it holds no
    weights before the check and the plan spend their seconds on it."""
    from transformers import AutoConfig

    model = tmp_path / "mistral"
    AutoConfig.for_model("mistral", num_hidden_layers=2).save_pretrained(model)

    def no_check(cfg, device_type):
        raise AssertionError("checked before the directory was looked at")

    monkeypatch.setattr(gate, "run_check", no_check)
    assert main(["train", f"model={model}", "train.device=cpu", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longfit: error: model=") and "holds no weights" in err[0], err


def test_an_exact_verdict_is_cached_by_architecture_and_techniques(verdicts, monkeypatch) -> None:
    cfg = load_config(None, ["model=llama-tiny", "seq_len=256"])
    verdict = gate.require_exact(cfg, "cpu")
    assert verdict.exact and not verdict.cached
    monkeypatch.setattr(gate, "run_check", lambda cfg, device_type: pytest.fail("checked again"))
    assert gate.require_exact(cfg, "cpu").cached
    keys = {gate.verdict_key(c, device) for c, device in [
        (cfg, "cpu"), (cfg, "cuda"), (load_config(None, ["model=llama-tiny", "seq_len=256", "memory.tiled_mlp=true"]), "cpu"),
        (load_config(None, ["model=llama-60m", "seq_len=256"]), "cpu")]}
    assert len(keys) == 4
    assert gate.verdict_key(load_config(None, ["model=llama-tiny", "seq_len=256", "train.lr=1e-4"]), "cpu") in keys


def test_a_model_longfit_cannot_compute_is_refused_before_training(tmp_path, verdicts) -> None:
    """A refusal of the check (Mamba layers, which run per document on one rank, under context parallelism) is the
    preflight's one line too."""
    from transformers import AutoConfig

    model = tmp_path / "falcon_mamba"
    AutoConfig.for_model("falcon_mamba", num_hidden_layers=2).save_pretrained(model)
    with pytest.raises(ConfigError, match="runs per document on one rank") as refusal:
        gate.require_exact(load_config(None, [f"model={model}", "seq_len=256", "parallel.cp=2"]), "cpu")
    assert "\n" not in str(refusal.value)


def test_longfit_check_answers_again_from_the_cache_without_checking(verdicts, monkeypatch, capsys) -> None:
    """A second `longfit check` of the same run prints the first one's lines from the cache (#52), nothing rebuilt."""
    import longfit.check.parity as parity

    run = ["check", "model=llama-tiny", "seq_len=256", "--device", "cpu"]
    assert main(run) == 0
    first = capsys.readouterr().out.splitlines()
    assert first[-1] == "exact"
    monkeypatch.setattr(parity, "check_run", lambda *args: pytest.fail("checked again"))
    monkeypatch.setattr(gate, "verdict_key", lambda *args: pytest.fail("the rehearsal's key computed again"))
    assert main(run) == 0
    again = capsys.readouterr().out.splitlines()
    assert "cached" in again[0] and again[1:] == first


def _tiny_llama(directory, **values) -> str:
    from transformers import AutoConfig

    AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, **values).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize(("change", "rehearsed"), [
    ("the model's config.json", True), ("memory.tiled_mlp=true", True), ("train.dtype=bf16", True),
    ("parallel.cp=2", True), ("parallel.tp=2", True), ("lora.enabled=true", True), ("device cuda", True), ("longfit's code", True),
    ("data.path's file", False), ("train.lr=1e-4", False)])
def test_a_cached_verdict_answers_only_for_the_same_inputs(tmp_path, verdicts, monkeypatch, change, rehearsed) -> None:
    """Each input of the run is in the key of the verdict read before anything is built (`gate.input_key`, #52): a
    change of any of them misses it, and where it changes what is rehearsed the check runs again."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one document"}\n')
    model = _tiny_llama(tmp_path / "llama")
    items = [f"model={model}", "seq_len=256", f"data.path={data}"]
    checks: list = []
    monkeypatch.setattr(gate, "run_check", lambda cfg, device: checks.append(cfg) or gate.Verdict(True, ""))
    before = gate.input_key(load_config(None, items), "cpu")
    assert gate.require_exact(load_config(None, items), "cpu") and len(checks) == 1
    assert gate.require_exact(load_config(None, items), "cpu").cached and len(checks) == 1
    device = "cpu"
    if change == "the model's config.json":
        _tiny_llama(model, rms_norm_eps=1e-5)  # the same directory, another config
    elif change == "device cuda":
        device = "cuda"
    elif change == "longfit's code":
        monkeypatch.setattr(gate, "code_digest", lambda: "another digest")
    elif change == "data.path's file":
        data.write_text('{"text": "another document, longer"}\n')
    else:
        items.append(change)
    assert gate.input_key(load_config(None, items), device) != before
    gate.require_exact(load_config(None, items), device)
    assert len(checks) == (2 if rehearsed else 1)


def test_the_verdicts_key_and_the_check_share_one_rehearsal(verdicts, monkeypatch) -> None:
    """The rehearsal the verdict is keyed by is the one the check runs (#52): the model's config read and its copy
    shrunk once per check."""
    import longfit.check.parity as parity

    made: list = []
    original = parity._rehearsed
    monkeypatch.setattr(parity, "_rehearsed", lambda *args: made.append(args) or original(*args))
    verdict = gate.require_exact(load_config(None, ["model=llama-tiny", "seq_len=256"]), "cpu")
    assert verdict.exact and not verdict.cached and len(made) == 1


def test_a_model_changed_while_it_is_checked_leaves_no_verdict_under_its_old_inputs(tmp_path, verdicts,
                                                                                     monkeypatch) -> None:
    model = _tiny_llama(tmp_path / "llama")
    items = [f"model={model}", "seq_len=256"]
    before = gate.input_key(load_config(None, items), "cpu")

    def checked_while_edited(cfg, device_type):
        _tiny_llama(model, rms_norm_eps=1e-5)
        return gate.Verdict(True, "")

    monkeypatch.setattr(gate, "run_check", checked_while_edited)
    assert gate.require_exact(load_config(None, items), "cpu").exact
    assert not (verdicts / f"{before}.json").exists()


def test_the_ranks_of_a_launch_read_the_launchers_verdict_under_their_inputs(tmp_path, verdicts, monkeypatch) -> None:
    """`longfit train --nproc 2` checks before torchrun starts the ranks; each rank then asks again with the config
    as given (#52). The launcher's preflight sets an empty parallel.pp_layers to its cut, and the verdict it stored
    was keyed by that: every rank missed it and computed the rehearsal's key (seconds of imports). A rank finds the
    verdict under its own inputs now."""
    import longfit.launch as launch

    launched: list = []
    monkeypatch.setattr(launch, "launch_torchrun", lambda how, argv, rdzv_id: launched.append(argv) or 0)
    run = ["train", "model=llama-tiny", "seq_len=256", "parallel.pp=2", "train.device=cpu",
           f"output_dir={tmp_path / 'run'}"]
    assert main([*run, "--nproc", "2"]) == 0 and len(launched) == 1
    monkeypatch.setattr(gate, "verdict_key", lambda *args: pytest.fail("a rank computed the rehearsal's key"))
    monkeypatch.setattr(gate, "run_check", lambda *args: pytest.fail("a rank checked again"))
    rank = load_config(None, run[1:])  # a rank's config: the same command line, read again
    assert rank.parallel.pp_layers == [] and gate.require_exact(rank, "cpu").cached
