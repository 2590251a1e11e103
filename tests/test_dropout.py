"""`train.disable_dropout` (on by default): every dropout of the model off while training -- its config's
probabilities, read by field name, and every dropout module -- so that `longfit check` proves the step exact; the
export keeps the checkpoint's values; with `false` a model whose dropout longfit would have to apply is refused in
one line naming the switch. And the verdict cache of the train preflight, keyed by what the check rehearses.

Models: transformers' default configs of Seed-OSS (attention_dropout 0.1, residual_dropout 0.1) and GPT-2 (attn_pdrop,
resid_pdrop, embd_pdrop 0.1), shrunk by the check; a tiny Seed-OSS checkpoint written by transformers for training.
Default suite: Seed-OSS exact in fp32, refusals, the trainer's model, the note and the export, the verdict keys.
Slow: GPT-2 exact in fp32, both in the GPU regime (bf16 autocast, its memory techniques), Seed-OSS on two gloo ranks
(ring and Ulysses), GPT-2's preflight refusal,
the refusals of a random module (GPT-NeoX-Japanese's dropout with the switch off, PhiMoE's sparsemixer router),
apply_longfit on a transformers Trainer's model.
"""

from __future__ import annotations

import json

import pytest
import torch

import longfit.check.gate as gate
from longfit.check.parity import NotExact, check_run
from longfit.cli import main
from longfit.config import ConfigError, load_config
from longfit.models.dropout import DROPOUT_NAME, dropout_modules

pytestmark = pytest.mark.usefixtures("one_thread")

DEFAULT_DROPOUT = {"seed_oss": {"attention_dropout": 0.1, "residual_dropout": 0.1},
                   "gpt2": {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "summary_first_dropout": 0.1}}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    """Directories holding only the config.json transformers writes for each type's default config."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("dropout-configs")
    for model_type in ("seed_oss", "gpt2", "gpt_neox_japanese", "phimoe"):
        AutoConfig.for_model(model_type).save_pretrained(root / model_type)
    AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=384).save_pretrained(root / "gpt2-tiny")
    return {name: str(root / name) for name in ("seed_oss", "gpt2", "gpt_neox_japanese", "phimoe", "gpt2-tiny")}


@pytest.fixture(scope="module")
def seed_oss_dir(tmp_path_factory):
    """A tiny Seed-OSS checkpoint (transformers' default config, its dropout included, at small widths) with the byte
    tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer

    path = tmp_path_factory.mktemp("seed-oss-tiny")
    config = AutoConfig.for_model("seed_oss", vocab_size=384, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "longfit" / "check_verdicts"


def run_config(model, *settings: str, seq_len: int = 512):
    return load_config(None, [f"model={model}", f"seq_len={seq_len}", "train.device=cpu", *settings])


def live_dropout(model: torch.nn.Module) -> list[str]:
    """The dropout modules and dropout numbers of `model`'s modules that are not 0."""
    found = [n for n, m in model.named_modules() if isinstance(m, dropout_modules()) and m.p]
    return found + [f"{n}.{a}" for n, m in model.named_modules() for a, v in vars(m).items()
                    if DROPOUT_NAME.search(a) and isinstance(v, float) and v]


@pytest.mark.parametrize("model_type", ["seed_oss", "gpt2"])
def test_the_runs_model_config_has_its_dropout_at_zero(configs, model_type: str) -> None:
    from longfit.models.dropout import dropout_values
    from longfit.models.loading import resolve_model_config

    model = configs[model_type]
    assert dropout_values(resolve_model_config(model)) == DEFAULT_DROPOUT[model_type]
    assert dropout_values(resolve_model_config(model, run_config(model))) == {}
    kept = resolve_model_config(model, run_config(model, "train.disable_dropout=false"))
    assert dropout_values(kept) == DEFAULT_DROPOUT[model_type]


def test_a_routers_jitter_is_not_dropout(configs) -> None:
    """PhiMoE's router_jitter_noise is its sparsemixer's sampling margin (at 0 the router gets no gradient): kept."""
    from longfit.models.loading import resolve_model_config

    config = resolve_model_config(configs["phimoe"], run_config(configs["phimoe"]))
    assert config.router_jitter_noise == 0.01 and config.attention_dropout == 0.0


def test_the_trainers_model_has_every_dropout_off_but_loras(configs, seed_oss_dir) -> None:
    from longfit.models.build import build_model

    gpt2 = configs["gpt2-tiny"]
    model = build_model(run_config(gpt2), torch.float32, "meta")
    assert live_dropout(model) == []
    kept = build_model(run_config(gpt2, "train.disable_dropout=false"), torch.float32, "meta")
    assert {"transformer.drop", "transformer.h.0.attn.attn_dropout", "transformer.h.0.mlp.dropout"} <= set(
        live_dropout(kept))
    lora = build_model(run_config(gpt2, "lora.enabled=true", "lora.dropout=0.1", "lora.target_modules=[c_attn]"),
                       torch.float32, "meta")
    assert live_dropout(lora) and all("lora_dropout" in name for name in live_dropout(lora))
    seed_oss = build_model(run_config(seed_oss_dir, "train.disable_dropout=false"), torch.float32, "meta")
    assert "model.layers.0.self_attn.residual_dropout" in live_dropout(seed_oss)


def test_a_model_built_elsewhere_gets_its_modules_dropout_off(seed_oss_dir) -> None:
    """apply_longfit's way: the modules of a model transformers built with dropout; its config stays."""
    from transformers import AutoModelForCausalLM

    from longfit.models.dropout import disable_dropout_modules

    model = AutoModelForCausalLM.from_pretrained(seed_oss_dir)
    changed = disable_dropout_modules(model)
    assert "model.layers.0.self_attn.attention_dropout" in changed and "model.layers.0.mlp.residual_dropout" in changed
    assert live_dropout(model) == [] and model.config.attention_dropout == 0.1


def test_seed_oss_is_exact_with_its_dropout_off(configs) -> None:
    """fp32 (one document, packed, with the techniques) and train.dtype=bf16 (autocast, packed)."""
    report = check_run(run_config(configs["seed_oss"], "train.dtype=bf16"), "cpu")
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons][2:] == ["one process, fp32, techniques, packed",
                                                        "one process, bf16 autocast, techniques, packed"]
    assert not any("dropout" in note for note in report.shrunk.notes)


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "device"), [("gpt2", "cpu"), ("seed_oss", "cuda"), ("gpt2", "cuda")])
def test_exact_with_dropout_off_in_both_regimes(configs, model_type: str, device: str) -> None:
    """fp32 (train.device=cpu) and the GPU regime: train.dtype=bf16 with the memory techniques of a GPU run."""
    cfg = load_config(None, [f"model={configs[model_type]}", "seq_len=32768"])
    report = check_run(cfg, device)
    assert report.exact, report.refusal
    if device == "cuda":
        assert report.techniques[:3] == ["train.dtype=bf16", "activation checkpointing", "offload of the layer inputs"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_exact_with_dropout_off_on_two_gloo_ranks(configs, method: str) -> None:
    """Seed-OSS under parallel.cp=2 (GPT-2's blocks name their attention `attn`, which context parallelism does not
    route yet: the check says so, and the preflight refuses it)."""
    report = check_run(run_config(configs["seed_oss"], "parallel.cp=2", "parallel.dp_shard=1",
                                  f"parallel.cp_method={method}"), "cpu")
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons][-2:] == [f"rank {r} of 2, {method}, techniques, packed" for r in (0, 1)]


def test_with_the_switch_off_the_check_and_the_preflight_refuse_in_one_line(configs, seed_oss_dir, verdicts, tmp_path,
                                                                            capsys) -> None:
    assert main(["check", f"model={configs['seed_oss']}", "seq_len=512", "train.device=cpu", "train.disable_dropout=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longfit: error: "), err
    assert "is refused by longfit: layer 0, dense" in err[0] and "self_attn: attention dropout (0.1)" in err[0]
    assert "train.disable_dropout=true" in err[0]
    run = ["train", f"model={seed_oss_dir}", "seq_len=512", "train.device=cpu", "train.disable_dropout=false",
           f"output_dir={tmp_path / 'run'}"]
    assert main(run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.disable_dropout=true" in err[0] and "train.accept_inexact=true" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_gpt2_with_the_switch_off_is_refused_by_the_preflight(configs, verdicts) -> None:
    with pytest.raises(ConfigError, match=r"attn: attention dropout \(0\.1\).*train\.disable_dropout=true"):
        gate.require_exact(run_config(configs["gpt2"], "train.disable_dropout=false"), "cpu")


@pytest.mark.slow
def test_a_random_module_is_refused_naming_the_switch_only_when_it_is_dropout(configs) -> None:
    """GPT-NeoX-Japanese applies its attention dropout in a module of its own: with the switch off it is random in
    training, and the switch is named (with it on, nothing is random); PhiMoE's router samples its experts whatever the switch: refused without naming it, from any random state."""
    with pytest.raises(NotExact) as dropout:
        check_run(run_config(configs["gpt_neox_japanese"], "train.disable_dropout=false"), "cpu").raise_if_not_exact()
    assert "is random in training" in str(dropout.value) and "train.disable_dropout=true" in str(dropout.value)
    off = check_run(run_config(configs["gpt_neox_japanese"]), "cpu")  # its attention differs (#44): not dropout
    assert "random" not in (off.refusal or "")
    for start in (0, 1, 2):  # the verdict does not depend on the random state the check starts from (it did)
        torch.manual_seed(start)
        with pytest.raises(NotExact) as router:
            check_run(run_config(configs["phimoe"]), "cpu").raise_if_not_exact()
        assert "the output of mlp is random in training" in str(router.value)
        assert "disable_dropout" not in str(router.value)


def test_a_run_says_dropout_is_off_and_exports_the_checkpoints_values(seed_oss_dir, corpus, tmp_path, verdicts,
                                                                      capsys) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert main(["train", f"model={seed_oss_dir}", f"data.path={corpus}", "seq_len=64", f"output_dir={out}",
                 "train.steps=1", "train.device=cpu", "eval.retrieval=false"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("note: dropout off while training (train.disable_dropout): attention_dropout=0.1, "
                         "residual_dropout=0.1") == 1
    written = json.loads((out / "final" / "config.json").read_text())
    assert (written["attention_dropout"], written["residual_dropout"]) == (0.1, 0.1)
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.residual_dropout == 0.1


# -- the verdict's key ------------------------------------------------------------------------------------------

def test_the_verdict_is_keyed_by_what_the_check_rehearses(tmp_path) -> None:
    """Output paths, the learning rate, the steps, the seed, tile and chunk sizes and cp past the check's two ranks
    read the same verdict; a technique turned on, LoRA, cp, the dtype and the dropout switch do not."""
    base = ["model=llama-tiny", "seq_len=4096"]

    def key(*settings: str, device: str = "cpu") -> str:
        return gate.verdict_key(load_config(None, [*base, *settings]), device)

    same = {key(), key(f"output_dir={tmp_path / 'a'}", "train.lr=1e-4", "train.steps=7", "train.seed=3",
                   "memory.loss_chunk=512", "memory.mlp_tiles=5",
                   "lora.r=8", "lora.alpha=4", "data.path=other.jsonl", "train.accept_inexact=true")}
    assert len(same) == 1
    assert key("parallel.cp=2", "parallel.dp_shard=1") == key("parallel.cp=4", "parallel.dp_shard=1")
    differ = [key(), key("memory.tiled_mlp=true"), key("memory.activation_checkpointing=false"),
              key("lora.enabled=true"), key("lora.enabled=true", "lora.target_modules=[q_proj]"),
              key("parallel.cp=2", "parallel.dp_shard=1"),
              key("parallel.cp=2", "parallel.dp_shard=1", "parallel.cp_method=ulysses"),
              key("memory.offload_activations=true"),
              key("memory.offload_activations=true", f"memory.offload_dir={tmp_path / 'b'}"),
              key("train.dtype=bf16"), key("train.disable_dropout=false"), key("model=llama-60m")]
    assert len(set(differ)) == len(differ)
    assert key(device="cuda") != key()  # train.dtype=auto: bf16 on a GPU


def test_a_run_differing_only_in_what_the_check_does_not_rehearse_reads_the_cached_verdict(tmp_path, verdicts,
                                                                                           monkeypatch) -> None:
    checked = []

    def check(cfg, device_type):
        checked.append(cfg)
        return gate.Verdict(True, "")

    monkeypatch.setattr(gate, "run_check", check)
    base = ["model=llama-tiny", "seq_len=4096"]
    assert not gate.require_exact(load_config(None, [*base, f"output_dir={tmp_path / 'a'}"]), "cpu").cached
    again = load_config(None, [*base, f"output_dir={tmp_path / 'b'}", "train.lr=1e-4", "train.steps=100"])
    assert gate.require_exact(again, "cpu").cached and len(checked) == 1
    assert not gate.require_exact(load_config(None, [*base, "memory.tiled_mlp=true"]), "cpu").cached
    assert len(checked) == 2


@pytest.mark.slow
def test_apply_longfit_turns_a_trainers_model_dropout_off(seed_oss_dir, tmp_path, verdicts) -> None:
    """A transformers Trainer's model, loaded by the user with its dropout: off in its modules after apply_longfit,
    its config (which the Trainer saves) the checkpoint's."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from longfit.integrations.hf import apply_longfit

    model = AutoModelForCausalLM.from_pretrained(seed_oss_dir)
    args = TrainingArguments(str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=1, report_to=[],
                             use_cpu=True)
    trainer = Trainer(model=model, args=args)
    assert live_dropout(trainer.model)
    apply_longfit(trainer, f"model={seed_oss_dir}", "seq_len=64")
    assert live_dropout(trainer.model) == [] and trainer.model.config.residual_dropout == 0.1
