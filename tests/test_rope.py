"""The run's RoPE (`rope.*`, longfit.models.rope): each scaling given on the command line, exact against transformers.

The model is a tiny Qwen3 written by transformers from its default config shrunk, with a window of WINDOW
positions, trained on rows of 64 tokens (4x the window). Per scaling type:
- the command-line settings resolve to the transformers `rope_parameters` they say, and the model the trainer builds
  has transformers' frequencies for them (not the checkpoint's);
- longfit's loss and every gradient equal transformers' eager model of the scaled config on one document and on
  packed documents, with the run's memory techniques (`longfit.check.parity`'s steps; fp32);
- slow: `longfit check` with the setting on the command line, under parallel.cp=2 ring and Ulysses with tiled
  layers, in fp32 and under train.dtype=bf16 (`test_check_parallel`).
Also: dynamic NTK and LongRoPE made static at seq_len (transformers' own frequencies for a full row), the
validation errors, the note past the window, the export (transformers reloads it with the scaling and equal
logits) and the resume that refuses a changed scaling.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from longfit.check import parity
from longfit.config import ConfigError, load_config

WINDOW, ROW = 16, parity.ROW
HALF = 8  # head_dim 16: 8 rotated frequency pairs
SHORT, LONG = [1.0 + i / 8 for i in range(HALF)], [1.0 + i for i in range(HALF)]
TYPES = {
    "linear": ["rope.type=linear"],
    "dynamic": ["rope.type=dynamic"],
    "yarn": ["rope.type=yarn", "rope.beta_fast=16"],
    "llama3": ["rope.type=llama3", "rope.factor=8"],
    "longrope": ["rope.type=longrope", f"rope.short_factor={SHORT}", f"rope.long_factor={LONG}"],
    "raised-base": ["rope.type=default", "rope.theta=1e6"],
}
EXPECTED = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": WINDOW,
             "beta_fast": 16.0, "beta_slow": 1.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": WINDOW,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": WINDOW, "short_factor": LONG, "long_factor": LONG},
    "raised-base": {"rope_type": "default", "rope_theta": 1e6},
}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 (transformers' default config, small widths, a window of WINDOW positions) with the byte tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer

    path = tmp_path_factory.mktemp("qwen3-window16")
    config = AutoConfig.for_model("qwen3", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=WINDOW)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def run_config(model_dir, *settings: str, seq_len: int = ROW):
    return load_config(None, [f"model={model_dir}", f"seq_len={seq_len}", *settings])


def scaled(model_dir, name: str):
    from longfit.models.loading import resolve_model_config

    return resolve_model_config(str(model_dir), run_config(model_dir, *TYPES[name]))


def dynamic_base(seq_len: int, window: int, factor: float, dim: int = 16, theta: float = 10000.0) -> float:
    """transformers' dynamic NTK base for a row of seq_len tokens (_compute_dynamic_ntk_parameters)."""
    return theta * ((factor * seq_len / window) - (factor - 1)) ** (dim / (dim - 2))


@pytest.mark.parametrize("name", TYPES)
def test_settings_become_rope_parameters_and_the_trainers_frequencies(qwen3_dir, name):
    from transformers import AutoModelForCausalLM

    from longfit.models.loading import load_model

    config = scaled(qwen3_dir, name)
    expected = EXPECTED.get(name) or {"rope_type": "default", "rope_theta": dynamic_base(ROW, WINDOW, 4.0)}
    assert config.rope_parameters == pytest.approx(expected)
    assert config.max_position_embeddings == (WINDOW * 8 if name == "llama3" else ROW)
    trained = load_model(str(qwen3_dir), run=run_config(qwen3_dir, *TYPES[name])).model.rotary_emb
    reference = AutoModelForCausalLM.from_config(config).model.rotary_emb  # transformers' own, from the scaled config
    plain = AutoModelForCausalLM.from_pretrained(qwen3_dir).model.rotary_emb
    torch.testing.assert_close(trained.inv_freq, reference.inv_freq, rtol=0, atol=0)
    assert trained.attention_scaling == reference.attention_scaling
    assert not torch.equal(trained.inv_freq, plain.inv_freq) or trained.attention_scaling != 1.0


@pytest.mark.parametrize("name", TYPES)
def test_exact_against_transformers(qwen3_dir, name, one_thread):
    """Loss and every gradient, fp32, against eager: one document per row; packed documents with checkpointing,
    the tiled MLP and the chunked loss."""
    config = scaled(qwen3_dir, name)
    memory = ["memory.activation_checkpointing=true", "memory.tiled_mlp=true", f"memory.mlp_tiles={parity.TILES}",
              "memory.chunked_loss=true", f"memory.loss_chunk={parity.LOSS_CHUNK}"]
    setup = parity.Setup(config.to_dict(), [], memory, True, torch.float32, "ring", seed=0)
    for batch_name, batch in parity.batches(config.vocab_size, 0).items():
        got = parity.longfit_step(setup, batch, techniques=batch.cu_seqlens is not None)
        comparison = parity.compare_fp32(f"{name}, {batch_name}", got,
                                         parity.eager_step(parity.build(setup, "eager"), batch))
        assert comparison.ok, comparison.line()


def test_longfit_check_takes_the_setting_on_the_command_line(qwen3_dir, capsys):
    from longfit.cli import main

    assert main(["check", f"model={qwen3_dir}", f"seq_len={ROW}", "rope.type=yarn", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "exact" in out.splitlines()[-1]


def test_dynamic_and_longrope_are_transformers_frequencies_of_a_full_row(qwen3_dir):
    """Static at seq_len: dynamic NTK's frequencies are transformers' for a row of seq_len tokens (the largest
    position a forward may see), whatever positions a rank or a packed row holds; LongRoPE's long factors."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from longfit.models.loading import resolve_model_config

    for seq_len in (ROW, 4 * ROW):
        dynamic = AutoConfig.from_pretrained(qwen3_dir, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                          "rope_theta": 10000.0})
        theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](dynamic, "cpu", seq_len=seq_len)
        ours = resolve_model_config(str(qwen3_dir), run_config(qwen3_dir, "rope.type=dynamic", "rope.factor=4", seq_len=seq_len))
        base = ours.rope_parameters["rope_theta"]
        torch.testing.assert_close(1.0 / base ** (torch.arange(0, 16, 2).float() / 16), theirs)
    longrope = AutoConfig.from_pretrained(qwen3_dir)
    longrope.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "short_factor": SHORT,
                                "long_factor": LONG, "original_max_position_embeddings": WINDOW}
    past, scale = ROPE_INIT_FUNCTIONS["longrope"](longrope, "cpu", seq_len=WINDOW + 1)
    ours = scaled(qwen3_dir, "longrope")
    static, static_scale = ROPE_INIT_FUNCTIONS["longrope"](ours, "cpu", seq_len=1)  # a short document: the same
    torch.testing.assert_close(static, past)
    assert static_scale == scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(WINDOW)))


def test_a_checkpoints_dynamic_scaling_is_made_static_too(qwen3_dir, tmp_path):
    from transformers import AutoConfig

    from longfit.models.loading import resolve_model_config

    config = AutoConfig.from_pretrained(qwen3_dir, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                             "rope_theta": 10000.0})
    config.save_pretrained(tmp_path)
    ours = resolve_model_config(str(tmp_path), run_config(tmp_path, seq_len=ROW))
    assert ours.rope_parameters == pytest.approx({"rope_type": "default", "rope_theta": dynamic_base(ROW, WINDOW, 2.0)})


@pytest.mark.parametrize("settings, error", [
    (["rope.factor=4"], r"rope.factor is set but rope.type=checkpoint does not read it: choose the scaling"),
    (["rope.type=yarn", "rope.factor=0.5"], r"rope.factor=0.5: a context extension factor is >= 1"),
    (["rope.type=linear", "rope.beta_fast=8"], r"rope.beta_fast is set but rope.type=linear does not read it"),
    (["rope.type=yarn", "rope.beta_fast=1"], r"rope.beta_fast=1.0 must be above rope.beta_slow=1.0"),
    (["rope.type=llama3", "rope.high_freq_factor=1"], r"rope.high_freq_factor=1.0 must be above"),
])
def test_settings_refused_before_anything_runs(settings, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, settings)


@pytest.mark.parametrize("settings, seq_len, error", [
    (["rope.type=yarn"], 8, r"rope.factor=auto: seq_len=8 is within qwen3's original window of 16 positions"),
    (["rope.type=longrope"], ROW, r"rope.type=longrope needs its per-frequency factors: .* 8 numbers each"),
    (["rope.type=longrope", "rope.short_factor=[1,1]", "rope.long_factor=[1,2]"], ROW, r"rotate 16 dimensions"),
])
def test_settings_the_model_refuses(qwen3_dir, settings, seq_len, error):
    from longfit.models.loading import resolve_model_config

    with pytest.raises(ConfigError, match=error):
        resolve_model_config(str(qwen3_dir), run_config(qwen3_dir, *settings, seq_len=seq_len))


def test_gemma3_scales_its_global_layers_and_keeps_their_base():
    from longfit.models.loading import resolve_model_config

    config = resolve_model_config("gemma-3-tiny", load_config(None, ["model=gemma-3-tiny", "seq_len=4096",
                                                                     "rope.type=yarn", "rope.original_window=1024"]))
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.rope_parameters["full_attention"] == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                        "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                                                        "beta_slow": 1.0}
    with pytest.raises(ConfigError, match=r"already scales its RoPE .* extend it with rope.type=linear"):
        resolve_model_config("gemma-3-4b", load_config(None, ["model=gemma-3-4b", "seq_len=262144", "rope.type=yarn"]))


@pytest.mark.parametrize("model_type", ["gemma3_text", "llama"])
def test_nested_rope_parameters_are_read_without_transformers_helper(monkeypatch, model_type):
    """#52: transformers 5.17 (the GPU machines') has no `nested_rope_parameter_keys`, which reading the RoPE groups
    called: every run failed building its model. Without it the groups are read by the same rule: Gemma 3's per layer
    type (its sliding layers not scaled), Llama's one flat dict."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    from longfit.models.rope import model_window, scaled_groups

    config = AutoConfig.for_model(model_type)
    with_helper = scaled_groups(config), model_window(config)
    monkeypatch.delattr(RotaryEmbeddingConfigMixin, "nested_rope_parameter_keys", raising=False)
    assert not hasattr(config, "nested_rope_parameter_keys")
    assert (scaled_groups(config), model_window(config)) == with_helper
    assert list(with_helper[0]) == (["full_attention"] if model_type == "gemma3_text" else [None])


def train(argv: list[str]) -> int:
    from longfit.cli import main

    return main(["train", *argv, "train.device=cpu", "eval.retrieval=false", "train.warmup_steps=0"])


def test_training_past_the_window_says_so_once(qwen3_dir, corpus, tmp_path, capsys):
    assert train([f"model={qwen3_dir}", f"data.path={corpus}", f"seq_len={ROW}", f"output_dir={tmp_path / 'run'}",
                  "train.steps=1", "train.export=false"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: seq_len=64 is 4x the 16 positions") == 1
    assert "rope.type=yarn (rope.factor=auto: 4)" in out


def test_export_reloads_with_the_scaling_and_equal_logits_and_resume_keeps_it(qwen3_dir, corpus, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from longfit.models.loading import load_model

    settings = [f"model={qwen3_dir}", f"data.path={corpus}", f"seq_len={ROW}", "train.steps=2", "train.lr=1e-2",
                *TYPES["yarn"]]
    out = tmp_path / "run"
    assert train([*settings, f"output_dir={out}"]) == 0
    assert "note: seq_len" not in capsys.readouterr().out
    written = json.loads((out / "final" / "config.json").read_text())
    assert written["rope_parameters"] == EXPECTED["yarn"] and written["max_position_embeddings"] == ROW

    reloaded = AutoModelForCausalLM.from_pretrained(out / "final", attn_implementation="eager").eval()
    as_trained = load_model(str(qwen3_dir), run=run_config(qwen3_dir, *TYPES["yarn"])).eval()
    as_trained.load_state_dict(reloaded.state_dict())  # the trained weights in the model the run built
    unscaled = load_model(str(qwen3_dir)).eval()
    unscaled.load_state_dict(reloaded.state_dict())
    tokens = torch.randint(0, 384, (1, ROW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = reloaded(tokens).logits
        torch.testing.assert_close(as_trained(tokens).logits, logits, rtol=1e-5, atol=1e-5)
        assert (unscaled(tokens).logits - logits).abs().max() > 1e-3  # the scaling is what makes them equal

    resumed = [*settings, f"output_dir={out}", f"seq_len={2 * ROW}", "train.steps=3", "--allow-changes", "seq_len"]
    assert train(resumed) == 2  # refused: rope.factor=auto would scale by 8 now
    err = capsys.readouterr().err
    assert "trained with the RoPE" in err and "keep the old scaling with rope.factor=4.0" in err


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("name", TYPES)
def test_check_parallel(qwen3_dir, name, method, dtype):
    """`longfit check` with the setting on the command line: one process, techniques (tiled layers), the dtype and
    two gloo ranks of ring or Ulysses attention, each against transformers' eager model."""
    from longfit.check.parity import check_run

    cfg = run_config(qwen3_dir, *TYPES[name], "parallel.cp=2", f"parallel.cp_method={method}",
                     "memory.tiled_layers=true", f"train.dtype={dtype}")
    report = check_run(cfg, "cpu")
    assert report.exact, "\n".join(report.lines() + [report.refusal or ""])
    assert any("rank 1 of 2" in c.name for c in report.comparisons)
    assert report.shrunk.config.rope_parameters == scaled(qwen3_dir, name).rope_parameters


def test_a_model_built_elsewhere_gets_the_same_scaling(qwen3_dir):
    """apply_longfit's path: a Trainer's model, loaded by the user, rescaled in place, computes what longfit builds."""
    from transformers import AutoModelForCausalLM

    from longfit.models.loading import load_model
    from longfit.models.rope import apply_rope_to_model

    cfg = run_config(qwen3_dir, *TYPES["yarn"])
    theirs = AutoModelForCausalLM.from_pretrained(qwen3_dir).eval()
    apply_rope_to_model(theirs, cfg)
    ours = load_model(str(qwen3_dir), run=cfg).eval()
    ours.load_state_dict(theirs.state_dict())
    assert theirs.config.rope_parameters == EXPECTED["yarn"]
    tokens = torch.arange(ROW).unsqueeze(0) % 384
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens).logits)


def test_eval_reports_the_loss_by_position_across_and_past_the_window(qwen3_dir, corpus, tmp_path, capsys):
    """The buckets split the rows' target tokens by position at the window's quarter, half, the window and its
    doublings; their token-weighted mean is the eval loss; a rope.* setting changes what the model predicts."""
    from longfit.cli import main
    from longfit.eval.positions import position_edges

    assert position_edges(ROW, WINDOW) == [0, 4, 8, 16, 32, 64]
    reports = {}
    for name, settings in (("plain", []), ("yarn", ["rope.type=yarn"])):
        path = tmp_path / f"{name}.json"
        argv = ["eval", "--model", str(qwen3_dir), "--data", str(corpus), "--seq-len", str(ROW), "--rows", "4",
                "--positions", "--device", "cpu", "--json", str(path), *settings]
        assert main(argv) == 0
        reports[name] = json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "loss by position (original window 16 positions)" in out and "4x window" in out
    plain = reports["plain"]
    buckets = plain["positions"]
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 4), (4, 8), (8, 16), (16, 32), (32, 64)]
    assert sum(b["tokens"] for b in buckets) == plain["tokens"]
    mean = sum(b["loss"] * b["tokens"] for b in buckets) / plain["tokens"]
    assert mean == pytest.approx(plain["loss"], rel=1e-5)
    within, past = buckets[2]["loss"], reports["yarn"]["positions"][2]["loss"]
    assert reports["yarn"]["positions"][-1]["loss"] != buckets[-1]["loss"] and within != past  # YaRN rotates all


def test_an_adapter_of_a_scaled_run_carries_its_base_with_the_scaling(qwen3_dir, corpus, tmp_path):
    """A LoRA export names its base: the checkpoint's own config.json would run the adapter unscaled, so the base
    is saved beside the adapter with the run's RoPE, and peft loads the adapter on it."""
    out = tmp_path / "lora"
    assert train([f"model={qwen3_dir}", f"data.path={corpus}", f"seq_len={ROW}", f"output_dir={out}",
                  "train.steps=1", "lora.enabled=true", *TYPES["llama3"]]) == 0
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    base = json.loads((out / "final" / "base" / "config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((out / "final" / "base").resolve())
    assert base["rope_parameters"] == EXPECTED["llama3"] and base["max_position_embeddings"] == WINDOW * 8
