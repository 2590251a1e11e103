"""`longfit check`: exact for the families longfit trains, a named refusal for what it cannot compute, and a
refusal naming the layer and part for a deliberately broken attention.

The copies are made from configs alone (presets, or a config.json written by transformers: no weights), as a
user's `model=` directory would give them. Default suite: one process in fp32 and bf16 with the techniques of a
GPU run, and one spawn of two gloo ranks (ring, bf16, tiled layers, LoRA); more cp combinations under `slow`.
"""

from __future__ import annotations

import pytest
import torch

import longfit.models.attention as attention
from longfit.check.parity import NotExact, check_run
from longfit.check.shrink import CHECK_WINDOW, MAX_GROUP, WIDTHS, shrink_config
from longfit.cli import main
from longfit.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def config_dir(tmp_path, model_type: str, **values) -> str:
    """A model directory holding only the config.json that transformers writes for `model_type`."""
    from transformers import AutoConfig

    path = tmp_path / model_type
    AutoConfig.for_model(model_type, **values).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("configs")
    return {
        "llama": "llama-3.1-8b",
        "qwen2": "qwen2.5-7b",
        "mistral": config_dir(root, "mistral", num_hidden_layers=4, sliding_window=4096),
        "gemma3": "gemma-3-4b",
        "qwen3-moe": config_dir(root, "qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0]),
        # transformers' default configs (full size) of families found exact outside the presets
        **{family: config_dir(root, family) for family in ("qwen3", "olmo2", "olmo3", "phi3", "smollm3", "glm4",
                                                           "granite")},
        "ministral": config_dir(root, "ministral", head_dim=128),  # its default config leaves head_dim None
        "gemma4": config_dir(root, "gemma4"),  # multimodal: its text model is checked
        "qwen3.5": config_dir(root, "qwen3_5_text"),  # hybrid: Gated DeltaNet and full-attention layers
        "gpt-oss": config_dir(root, "gpt_oss", num_hidden_layers=4),
        "gemma2": config_dir(root, "gemma2"),
        "deepseek-v2-lite": config_dir(root, "deepseek_v2", num_hidden_layers=4, first_k_dense_replace=1,
                                       n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
                                       kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128),
        "cohere2": config_dir(root, "cohere2"),
    }


def check(model: str, *overrides: str, device: str = "cpu"):
    return check_run(load_config(None, [f"model={model}", *overrides]), device)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3", "qwen3-moe", "qwen3", "olmo2", "olmo3",
                                    "phi3", "smollm3", "glm4", "granite", "ministral", "gemma4", "gpt-oss", "gemma2",
                                    "deepseek-v2-lite", "qwen3.5"])
def test_check_says_exact_for_the_families_longfit_trains(configs, family: str) -> None:
    report = check(configs[family])
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons] == [
        "one process, fp32, one document per row", "one process, fp32, packed", "one process, fp32, techniques, packed"]
    assert all(c.ok and c.grad_error < 1e-5 for c in report.comparisons)
    assert report.lines()[-1] == "exact"


def test_check_rehearses_a_gpu_runs_techniques_in_bf16(configs) -> None:
    """On a GPU a 128K run gets bf16, offload, tiled layers and the chunked loss (auto), each rehearsed."""
    report = check(configs["gemma3"], "seq_len=131072", "lora.enabled=true", device="cuda")
    assert report.exact, report.refusal
    assert report.techniques[0] == "train.dtype=bf16"
    assert {"tiled layers", "offload of the layer inputs", "chunked loss"} <= set(report.techniques)
    assert all(c.offloaded_bytes > 0 for c in report.comparisons if "techniques" in c.name)  # the store took inputs
    bf16 = report.comparisons[-1]
    assert bf16.name == "one process, bf16 autocast, techniques, packed" and bf16.ok
    assert 1e-4 < bf16.grad_error < 2.0**-4  # bf16 really ran, within a bf16-sized error


def test_check_rehearses_tiled_layers_on_a_hybrid_model(configs) -> None:
    """A 128K Qwen3.5 run on one GPU gets tiled layers (auto), its Gated DeltaNet layers carrying their state from
    tile to tile: exact in fp32 and within the bf16 bound."""
    report = check(configs["qwen3.5"], "seq_len=131072", device="cuda")
    assert report.exact, report.refusal
    assert {"tiled layers", "offload of the layer inputs", "chunked loss"} <= set(report.techniques)
    assert [c.name for c in report.comparisons][-2:] == ["one process, fp32, techniques, packed",
                                                         "one process, bf16 autocast, techniques, packed"]


def test_the_copy_keeps_one_layer_of_each_kind(configs) -> None:
    from longfit.models.loading import resolve_model_config

    gemma = shrink_config(resolve_model_config("gemma-3-4b"), 64)
    assert [k.name for k in gemma.kinds] == ["sliding_attention", "full_attention"]
    assert gemma.kinds[1].layers == (5, 11, 17, 23, 29) and len(gemma.kinds[0].layers) == 29
    assert gemma.config.sliding_window == CHECK_WINDOW and gemma.config.num_hidden_layers == 2
    assert gemma.config.num_attention_heads // gemma.config.num_key_value_heads == 2  # 8 / 4 heads: the same groups
    moe = shrink_config(resolve_model_config(configs["qwen3-moe"]), 64)
    assert [(k.name, k.layers) for k in moe.kinds] == [("dense", (0,)), ("experts", (1, 2, 3))]
    assert moe.config.mlp_only_layers == [0] and moe.config.num_experts == 4 and moe.config.num_experts_per_tok == 2
    gemma4 = shrink_config(resolve_model_config(configs["gemma4"]), 64)  # per_layer_config: by layer index
    # the last layer of each type stores its keys and values for the shared layers (`store_full_length_kv`, #52)
    assert [(k.name, k.layers[0]) for k in gemma4.kinds] == [("sliding_attention", 0), ("full_attention", 5),
                                                             ("sliding_attention", 28), ("full_attention", 29)]
    global_layers = {"head_dim": 32}  # 2x the head_dim
    assert gemma4.config.to_dict()["per_layer_config"] == {"1": global_layers, "3": global_layers}
    hybrid = shrink_config(resolve_model_config(configs["qwen3.5"]), 64)
    assert [(k.name, len(k.layers)) for k in hybrid.kinds] == [("linear_attention", 24), ("full_attention", 8)]


def test_a_window_one_token_short_is_refused_naming_the_layer(configs, tmp_path, monkeypatch, capsys) -> None:
    """The sliding-window attention longfit runs gets the window it reads minus one: the check names Gemma 3's
    sliding layer and its attention, not the full-attention layer after it, and `longfit check` fails."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the mutation's verdict is no verdict of longfit's code
    original = attention.blockwise_attention

    def one_token_short(q, k, v, scale, documents, window, softcap, sinks):
        return original(q, k, v, scale, documents, None if window is None else window - 1, softcap, sinks)

    monkeypatch.setattr(attention, "blockwise_attention", one_token_short)
    report = check(configs["gemma3"])
    assert not report.exact
    assert report.refusal.startswith("layer 0, sliding_attention (as 29 of the model's layers: 0-4, 6-10,")
    assert "the output of self_attn differs by" in report.refusal
    assert report.refusal.endswith("(one process, fp32, one document per row)")
    with pytest.raises(NotExact, match="not computed exactly: layer 0, sliding_attention"):
        report.raise_if_not_exact()
    assert main(["check", f"model={configs['mistral']}", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "DIFFERS" in out and "exact" not in out.splitlines()[-1]
    assert "longfit: error: " in err and "layer 0, dense" in err and "self_attn differs" in err


@pytest.mark.parametrize("kernel", ["conv", "delta_rule"])
def test_a_state_not_reset_at_a_document_start_is_refused_naming_the_layer(configs, kernel: str, monkeypatch) -> None:
    """Qwen3.5's linear-attention kernels told nothing of the documents (tests/test_families_hybrid.py's
    `documents_ignored`): the state (recurrent or convolutional) runs on from one packed document into
    the next. One document per row is still exact; packed, the check names the linear-attention layer."""
    from test_families_hybrid import documents_ignored

    documents_ignored(monkeypatch, kernel)
    report = check(configs["qwen3.5"])
    assert not report.exact
    assert report.comparisons[0].ok and not report.comparisons[1].ok
    assert report.refusal.startswith("layer 0, linear_attention (as 24 of the model's layers: 0-2, 4-6,"), report.refusal
    assert "the output of linear_attn differs by" in report.refusal
    assert report.refusal.endswith("(one process, fp32, packed)")


def test_a_broken_backward_is_refused_naming_the_gradient(configs, monkeypatch) -> None:
    """A forward that is right and a backward that is not (the attention's gradient scaled by 1.05, through
    a custom autograd function around longfit's local attention) is named by the gradient it spoils."""
    original = attention.local_attention

    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.05

    def wrong_backward(q, k, v, *args, **kwargs):
        return original(ScaledGradient.apply(q), k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "local_attention", wrong_backward)
    report = check(configs["llama"])
    assert not report.exact
    assert "the forward agrees, the gradient of self_attn.q_proj.weight differs" in report.refusal
    assert report.refusal.startswith("layer 0, dense")


def test_a_logit_scale_outside_any_module_is_applied_and_a_missing_one_named(configs, monkeypatch) -> None:
    """Cohere 2 multiplies its logits by `logit_scale` in its causal LM's forward, outside any module: longfit's loss
    applies it (exact); without it the check says the loss differs where every module agrees."""
    import longfit.memory.loss as loss

    assert check(configs["cohere2"]).exact
    monkeypatch.setattr(loss, "logit_multiplier", lambda config: 1.0)
    report = check(configs["cohere2"])
    assert not report.exact
    assert report.refusal.startswith("every module's output agrees and the loss differs by"), report.refusal


@pytest.mark.parametrize(("model_type", "values"), [("granite", {"logits_scaling": 8.0}),
                                                     ("hyperclovax", {"logits_scaling": 0.25}),
                                                     ("minicpm3", {})])
def test_logit_scales_of_every_meaning_are_exact(tmp_path, model_type: str, values: dict) -> None:
    """`logits_scaling` divides Granite's logits, multiplies HyperCLOVA X's and divides MiniCPM3's last hidden
    states: each exact in fp32."""
    report = check(config_dir(tmp_path, model_type, **values))
    assert report.exact, report.refusal


def test_a_copy_keeping_heads_times_head_dim_as_the_hidden_size_is_exact(tmp_path) -> None:
    """Helium's o_proj maps hidden_size to hidden_size: a copy with hidden_size != heads x head_dim was a model
    transformers itself could not run (mat1 and mat2 shapes); the copy keeps the relation and is exact."""
    report = check(config_dir(tmp_path, "helium"))
    assert report.exact, report.refusal


@pytest.mark.parametrize(("model_type", "part", "settings"), [
    ("deepseek_v4", "attention is sparse (index_topk=512", []),
    ("minimax_m3_vl", "differs in its block top-k indexer", []),
    ("axk2", "differs in AXK2Attention's output gate", []),
    ("gpt_neo", "picks its attention class by name", []),
    ("bloom", "the bloom model's attention adds an ALiBi position bias", []),
    ("mpt", "the mpt model's attention adds an ALiBi position bias", []),
    ("trocr", "self_attn computes its attention itself, not through transformers' AttentionInterface", []),
    ("xglm", "self_attn computes its attention itself, not through transformers' AttentionInterface", []),
    ("gpt2", "layer 0, dense (as 12 of the model's layers: 0-11): attn: attention dropout (0.1)",
     ["train.disable_dropout=false"])])
def test_what_longfit_cannot_compute_is_refused_in_one_line(tmp_path, model_type: str, part: str, settings) -> None:
    """Sparse indexed attention (read off the config), an attention longfit cannot install, ALiBi, an attention module
    that computes its scores itself (TrOCR's, found by the check: longfit's attention never called in its layer),
    attention dropout (kept by train.disable_dropout=false): each a NotExact of one line naming the part."""
    with pytest.raises(NotExact) as refusal:
        check(config_dir(tmp_path, model_type), *settings).raise_if_not_exact()
    assert "is refused by longfit" in str(refusal.value) and part in str(refusal.value), str(refusal.value)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("error", [1.02, 0.98])
def test_a_wrong_bf16_kernel_is_caught_under_the_same_routing(configs, monkeypatch, error: float) -> None:
    """Qwen3-MoE in the GPU regime: its experts are compared in bf16 with every expert chosen (the copy is exact so),
    and an attention kernel off by 2% in bf16 only -- fp32 untouched -- is named by the bf16 step."""
    report = check(configs["qwen3-moe"], device="cuda")
    assert report.exact, report.refusal
    assert any("every expert chosen" in note for note in report.notes)
    original = attention.local_attention

    def wrong_in_bf16(q, k, v, *args, **kwargs):
        out = original(q, k, v, *args, **kwargs)
        return out * error if out.dtype == torch.bfloat16 else out

    monkeypatch.setattr(attention, "local_attention", wrong_in_bf16)
    report = check(configs["qwen3-moe"], device="cuda")
    assert not report.exact
    assert "differs (one process, bf16 autocast, techniques, packed)" in report.refusal, report.refusal


@pytest.mark.parametrize(("model_type", "read"), [
    ("gpt2", lambda c: (c.n_layer, c.n_embd, c.n_head)),  # GPT-2's own names: the attribute map's
    ("ministral", lambda c: (c.num_hidden_layers, c.hidden_size, c.head_dim)),  # head_dim None by default
    ("cwm", lambda c: (c.num_hidden_layers, c.hidden_size, c.bos_token_id)),  # token ids must be ints
])
def test_any_config_is_read_through_its_config_object(model_type: str, read) -> None:
    """transformers' default configs shrink: GPT-2-style keys read through the attribute map, None widths derived,
    token ids beyond the copy's vocabulary kept inside it."""
    from transformers import AutoConfig

    shrunk = shrink_config(AutoConfig.for_model(model_type), 64)
    layers, hidden, third = read(shrunk.config)
    assert layers == len(shrunk.kinds) and hidden <= 2 * MAX_GROUP * WIDTHS["head_dim"]  # at most 16 heads of 16
    assert third == {"gpt2": 2, "ministral": 16, "cwm": 511}[model_type]


def test_packed_rows_are_checked_against_each_document_alone() -> None:
    """gpt-oss's eager masks attend across the documents of a packed row (longfit computes its attention sinks
    exactly): the packed reference runs each document alone and lays every module's output back into the rows."""
    from longfit.check.parity import Setup, batches, build, eager_step
    from longfit.data.packing import PackedBatch

    setup = Setup({"model_type": "gpt_oss", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 32,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                   "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}, [], [], False,
                  torch.float32, "ring", seed=0)
    packed = batches(128, 0)["packed"]
    truth = eager_step(build(setup, "eager"), packed, record=True)
    out = truth.modules["model.layers.1.self_attn"][1]
    assert out.shape == (2, 64, 32)
    assert truth.modules["model.layers.1.mlp.router"][1].shape[0] == 128  # tokens flattened: concatenated in order
    first = PackedBatch(packed.input_ids[:1, 10:47], packed.labels[:1, 10:47], packed.position_ids[:1, 10:47], None,
                        36)  # the row's second document alone
    alone = eager_step(build(setup, "eager"), first, record=True)
    assert torch.equal(alone.modules["model.layers.1.self_attn"][1][0], out[0, 10:47])
    whole_row = PackedBatch(packed.input_ids, packed.labels, packed.position_ids, None, packed.num_label_tokens)
    across = eager_step(build(setup, "eager"), whole_row, record=True)  # transformers' eager mask on the packed rows
    assert not torch.allclose(across.modules["model.layers.1.self_attn"][1][0, 10:47], out[0, 10:47], atol=1e-3)


@pytest.mark.timeout(300)
@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_context_parallel_check_on_two_gloo_ranks(configs) -> None:
    report = check(configs["gemma3"], "parallel.cp=4", "lora.enabled=true", "memory.tiled_layers=true",
                   "train.dtype=bf16")
    assert report.exact, report.refusal
    ranks = [c for c in report.comparisons if c.name.startswith("rank ")]
    assert [c.name for c in ranks] == [f"rank {r} of 2, ring, techniques, packed" for r in (0, 1)]
    assert "parallel.cp=4 ring (checked on 2 gloo ranks)" in report.techniques


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides,ranks", [
    (["parallel.tp=2"], "tp=2"),
    # slow: four gloo ranks
    pytest.param(["parallel.tp=4", "parallel.cp=2", "train.dtype=bf16"], "ring x tp=2", marks=pytest.mark.slow)])
def test_tensor_parallel_check_runs_the_text_rows_on_two_tp_ranks(configs, overrides: list[str], ranks: str) -> None:
    """`longfit check` with parallel.tp rehearses the text rows' step on two tp ranks (before, it said tp was not
    rehearsed), cp x tp ranks with parallel.cp."""
    report = check(configs["gemma3"], *overrides)
    assert report.exact, report.refusal
    world = 2 * len(ranks.split(" x "))
    assert [c.name for c in report.comparisons if c.name.startswith("rank ")] == [
        f"rank {r} of {world}, {ranks}, techniques, packed" for r in range(world)]
    assert any(technique.startswith(f"{overrides[0]} (") for technique in report.techniques), report.techniques
    assert not any("is not rehearsed" in line for line in report.lines()), report.lines()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3", "gpt-oss"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_check_every_family_fp32(configs, family: str, method: str) -> None:
    report = check(configs[family], "parallel.cp=2", f"parallel.cp_method={method}", "memory.tiled_mlp=true")
    assert report.exact, report.refusal
    assert sum(c.name.startswith("rank ") for c in report.comparisons) == 2


@pytest.mark.slow  # importing TRL and building its trainer: about 15 s on an idle machine
def test_check_trainer_checks_the_run_apply_longfit_would_make(tmp_path) -> None:
    """The library entry of a TRL script: the trainer's own settings (bf16=True here) and apply_longfit's."""
    pytest.importorskip("trl")
    from test_integrations_hf import sft_trainer

    from longfit.integrations.hf import check_trainer

    trainer = sft_trainer(str(tmp_path), "llama-tiny", 1, bf16=True)
    report = check_trainer(trainer, "model=llama-tiny", "memory.tiled_mlp=true", device_type="cpu")
    assert report.exact, report.refusal
    assert report.techniques[:1] == ["train.dtype=bf16"] and "tiled MLP" in report.techniques


def test_a_config_whose_checkpoint_class_transformers_cannot_build_is_one_line(tmp_path, capsys) -> None:
    """Emu3's default config has no vocabulary map, which its image-text class reads while it is built: the check
    says transformers fails, in one line, not a traceback."""
    assert main(["check", f"model={config_dir(tmp_path, 'emu3')}", "seq_len=512", "train.device=cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longfit: error: transformers cannot build the emu3 model"), err


@pytest.mark.parametrize(("model_type", "values", "refused"), [("falcon", {"alibi": True}, True),  # Falcon-RW
                                                               ("falcon", {}, False),  # rotary
                                                               ("bloom", {}, True),  # always ALiBi: no config key
                                                               ("llama", {}, False)])
def test_alibi_is_refused_where_the_model_is_prepared(model_type: str, values: dict, refused: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.config import ConfigError
    from longfit.models.attention import refuse_alibi

    config = AutoConfig.for_model(model_type, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if not refused:
        refuse_alibi(model)
        return
    with pytest.raises(ConfigError, match=f"the {model_type} model's attention adds an ALiBi position bias, which "
                                          "longfit's attention kernels do not compute"):
        refuse_alibi(model)


def _step(loss: float, grads: dict[str, torch.Tensor]):
    from longfit.check.parity import Step

    return Step(torch.tensor(loss), grads)


def test_the_fp32_bound_accepts_rounding_as_large_as_transformers_own_against_float64() -> None:
    """A deep copy's gradients round beyond the fixed fp32 bound in transformers' own fp32 run (Gemma 3n's 35 layers):
    longfit's as close to the float64 run as transformers' passes; three times further does not."""
    from longfit.check.parity import FP32_FACTOR, compare_fp32

    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(64, 64, generator=generator)
    own = exact + 1e-4 * torch.randn(64, 64, generator=generator)  # transformers' fp32 run
    close = exact + 1e-4 * torch.randn(64, 64, generator=generator)
    truth, float64 = _step(1.0, {"w": own}), _step(1.0, {"w": exact})
    assert not compare_fp32("fixed bound", _step(1.0, {"w": close}), truth).ok
    assert compare_fp32("rounding", _step(1.0, {"w": close}), truth, float64).ok
    far = exact + (FP32_FACTOR + 0.5) * (own - exact)
    assert not compare_fp32("rounding", _step(1.0, {"w": far}), truth, float64).ok


def test_the_fp32_bound_against_float64_still_catches_a_small_attention_error(monkeypatch) -> None:
    """longfit's attention output off by 1e-4 of itself on a tiny Llama: beyond transformers' own fp32 error against
    float64 by far, so the float64 comparison does not excuse it."""
    from longfit.check import parity

    values = dict(model_type="llama", vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    setup = parity.Setup(values, [], [], False, torch.float32, "ring", seed=0)
    batch = parity.batches(384, seed=0)["packed"]
    truth, float64 = parity.eager_step(parity.build(setup, "eager"), batch), parity.float64_step(setup, batch)
    assert parity.compare_fp32("right", parity.longfit_step(setup, batch, techniques=False), truth, float64).ok
    original = attention.local_attention
    monkeypatch.setattr(attention, "local_attention", lambda *args, **kwargs: original(*args, **kwargs) * (1 + 1e-4))
    got = parity.longfit_step(setup, batch, techniques=False)
    assert not parity.compare_fp32("mutated", got, truth, float64).ok


def test_a_short_convolution_outside_gated_deltanet_runs_per_document_where_the_model_is_prepared() -> None:
    """LFM2's short-convolution layers (its checkpoints have them; its default config is all attention): transformers
    runs the convolution across a packed row's documents, so its module runs per document (models/document_mixers.py);
    Qwen3.5's Gated DeltaNet convolutions are routed through longfit's kernels instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.document_mixers import document_mixers
    from longfit.models.linear_attention import prepare_linear_attention

    def meta(model_type: str, **values):
        config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, **values)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    lfm2 = meta("lfm2", layer_types=["conv", "full_attention"])
    assert prepare_linear_attention(lfm2) == 0
    assert {index: type(mixer).__name__ for index, mixer in document_mixers(lfm2).items()} == {0: "Lfm2ShortConv"}
    qwen3_5 = meta("qwen3_5_text", layer_types=["linear_attention", "full_attention"])
    assert prepare_linear_attention(qwen3_5) == 1
    assert document_mixers(qwen3_5) == {}


def test_a_gradient_every_bf16_implementation_gets_wrong_is_bounded_by_their_noise() -> None:
    """Gemma 3n's AltUp correction coefficients: transformers' eager and SDPA bf16 gradients 53% and 71% off the fp32
    ones (differences that cancel). Beyond the ceiling of a bf16-sized error in every reference, the tensor is bounded
    by BF16_FACTOR x their absolute error: longfit's as far passes, four times further does not."""
    from longfit.check.parity import AUTOCAST_CEILING, BF16_FACTOR, compare_bf16

    generator = torch.Generator().manual_seed(0)
    fp32 = torch.randn(4, 4, generator=generator)
    eager, sdpa = (fp32 + scale * torch.randn(4, 4, generator=generator) for scale in (0.5, 0.7))
    truth, references = _step(1.0, {"w": fp32}), [_step(1.0, {"w": eager}), _step(1.0, {"w": sdpa})]
    close = _step(1.0, {"w": fp32 + (sdpa - fp32) * 1.2})
    assert compare_bf16("noise", close, references, truth, AUTOCAST_CEILING).ok
    far = _step(1.0, {"w": fp32 + (sdpa - fp32) * (BF16_FACTOR + 1)})
    assert not compare_bf16("noise", far, references, truth, AUTOCAST_CEILING).ok


def test_the_noise_bound_of_a_few_values_is_what_two_correct_noises_exceed_one_time_in_a_thousand() -> None:
    """A gated DeltaNet's A_log of four value heads, bf16 noise in every implementation (tests/test_media.py's Qwen3.5
    image rows: transformers' bf16 gradient 14% off the fp32 one, longfit's 3.07x as far): the bound of a tensor of
    a few values is the ratio of two independent noises' norms that one pair in NOISE_FALSE_ALARM exceeds (drawn
    here), BF16_FACTOR from ten values on; ten times the references' noise stays beyond it."""
    from longfit.check.parity import AUTOCAST_CEILING, BF16_FACTOR, compare_bf16
    from longfit.check.steps import NOISE_FALSE_ALARM, noise_factor

    generator = torch.Generator().manual_seed(0)
    for values in (2, 4, 6, 8):
        first, second = torch.randn(2, 400_000, values, generator=generator).norm(dim=-1)
        exceeded = float((first / second > noise_factor(values)).double().mean())
        assert 0.5 * NOISE_FALSE_ALARM < exceeded < 1.5 * NOISE_FALSE_ALARM, (values, exceeded)
    assert noise_factor(10) == noise_factor(4096) == BF16_FACTOR

    fp32 = torch.randn(4, generator=generator)
    noise = 0.5 * torch.randn(4, generator=generator)
    truth, references = _step(1.0, {"A_log": fp32}), [_step(1.0, {"A_log": fp32 + noise})]
    assert compare_bf16("noise", _step(1.0, {"A_log": fp32 - 3.07 * noise}), references, truth, AUTOCAST_CEILING).ok
    assert not compare_bf16("noise", _step(1.0, {"A_log": fp32 + 10 * noise}), references, truth, AUTOCAST_CEILING).ok


def test_a_few_values_within_the_ceiling_are_bounded_by_their_noises_ratio() -> None:
    """The same tensor where transformers' bf16 gradient is a bf16-sized error, within the ceiling (tests/
    test_media_video.py's Qwen3.5 video rows: 2.4% off the fp32 one, longfit's 4.8x as far): its relative error is
    bounded by the few values' noise factor too, not BF16_FACTOR; ten times the references' error stays beyond it."""
    from longfit.check.parity import AUTOCAST_CEILING, BF16_FACTOR, compare_bf16
    from longfit.check.steps import noise_factor

    generator = torch.Generator().manual_seed(0)
    fp32 = torch.randn(4, generator=generator)
    noise = 0.01 * fp32.norm() * torch.nn.functional.normalize(torch.randn(4, generator=generator), dim=0)
    truth, references = _step(1.0, {"A_log": fp32}), [_step(1.0, {"A_log": fp32 + noise})]
    assert BF16_FACTOR < 4.8 < noise_factor(4)
    assert compare_bf16("noise", _step(1.0, {"A_log": fp32 - 4.8 * noise}), references, truth, AUTOCAST_CEILING).ok
    assert not compare_bf16("noise", _step(1.0, {"A_log": fp32 + 10 * noise}), references, truth, AUTOCAST_CEILING).ok


def test_a_check_builds_each_copy_once_and_deep_copies_it_after(monkeypatch) -> None:
    """Within one check (`reused_builds`, #52) a second build of the same copy is a deep copy of the first, peft not
    asked again: the same weights, drawn afresh, in a model of its own."""
    import peft

    import longfit.check.parity as parity

    cfg = load_config(None, ["model=llama-tiny", "seq_len=256", "lora.enabled=true"])
    setup = parity.rehearsal(cfg, "cpu").setup
    fresh = parity.build(setup, "eager")
    wrapped: list = []
    original = peft.get_peft_model
    monkeypatch.setattr(peft, "get_peft_model", lambda *args, **kwargs: wrapped.append(1) or original(*args, **kwargs))
    with parity.reused_builds():
        first = parity.build(setup, "eager")
        with torch.no_grad():
            next(first.parameters()).add_(1.0)  # a caller's change stays in its own model
        second = parity.build(setup, "eager")
        sdpa = parity.build(setup, "sdpa")
    assert len(wrapped) == 2  # eager once, SDPA once
    assert second is not first and sdpa.config._attn_implementation == "sdpa"
    for (name, want), (_, got) in zip(fresh.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(want, got), name
    assert {n for n, _ in second.named_modules()} == {n for n, _ in fresh.named_modules()}
