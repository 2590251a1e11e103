"""Image-text checkpoints (issue 43): Qwen3.5, Qwen3.5-MoE, Gemma 3, Gemma 4, Llama 4 and Mistral 3 in, the same
model out.

Each checkpoint is written by transformers' own wrapper class (`AutoModelForImageTextToText`) from transformers'
default config of its type with the language model and the towers shrunk, with longfit's byte tokenizer beside it
and the family's image processor where one builds without torchvision. longfit trains the language model:
- its loss and every gradient equal the wrapper's own (eager attention, packed documents each run alone) on one
  document per row and on packed rows;
- `longfit train` trains it, and its export is the wrapper again: loaded by `AutoModelForImageTextToText` and by the
  family's class, the same config, every non-language tensor (vision, audio, projector) bit-identical to the source,
  the language model's as trained (text logits equal the trained model's), the other files copied;
- a LoRA adapter attaches to the wrapper (`PeftModel.from_pretrained`) with the trained model's logits, and its merged
  export is the wrapper;
- `longfit plan` and `longfit check` read the directories (and transformers' default Gemma 4 config, whose layers
  the tiled MLP cannot run: `auto` leaves it off, `true` says why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from family_runs import cp2_losses, one_rank_losses, short_documents  # noqa: E402,F401 (fixtures)

from longfit.check import parity  # noqa: E402
from longfit.config import ConfigError, load_config  # noqa: E402

TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
LINEAR = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
WRAPPERS = {
    "qwen3_5": dict(text_config=dict(TEXT, **LINEAR), vision_config=QWEN_VISION),
    "qwen3_5_moe": dict(text_config=dict(TEXT, **LINEAR, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=2), vision_config=QWEN_VISION),
    "gemma3": dict(text_config=dict(TEXT, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                                    query_pre_attn_scalar=16),
                   vision_config=dict(VISION, image_size=32, patch_size=8), mm_tokens_per_image=4),
    "gemma4": dict(text_config=dict(TEXT, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                    per_layer_config={"03": {"head_dim": 32}}, hidden_size_per_layer_input=8,
                                    vocab_size_per_layer_input=384),
                   vision_config=dict(VISION, num_key_value_heads=2, head_dim=16),
                   audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=64)),
    "llama4": dict(text_config=dict(TEXT, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
                                    moe_layers=[1, 3], interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
                                    attention_chunk_size=16, layer_types=["chunked_attention"] * 3 + ["full_attention"]),
                   vision_config=dict(VISION, vision_output_dim=64, image_size=28, patch_size=14,
                                      projector_input_dim=64, projector_output_dim=64)),
    "mistral3": dict(text_config=dict(TEXT, model_type="mistral"),
                     vision_config=dict(VISION, head_dim=16, image_size=32, patch_size=8)),
}
"""transformers' default config of each type, its language model and towers shrunk (the other settings its own)."""
IDS = torch.tensor([[256, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]])  # <|bos|>hello world


def save_image_processor(model_type: str, path: Path) -> None:
    """The family's image processor, where one builds here (transformers falls back to PIL without torchvision)."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or ()
    for name in names.values() if isinstance(names, dict) else [names] if isinstance(names, str) else names:
        try:
            getattr(transformers, name)().save_pretrained(path)
            return
        except (ImportError, AttributeError):
            continue


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """model_type -> a tiny checkpoint written by its wrapper class (a second for all six)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from longfit.data.tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("wrappers")
    paths = {}
    for model_type, sizes in WRAPPERS.items():
        path = paths[model_type] = root / model_type
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **sizes))
        model.save_pretrained(path, max_shard_size="1MB" if model_type == "gemma4" else "1GB")  # Gemma 4's: 4 shards
        byte_tokenizer().save_pretrained(path)
        save_image_processor(model_type, path)
    return paths


@pytest.fixture(scope="session")
def default_gemma4(tmp_path_factory) -> Path:
    """transformers' default Gemma 4 config (5B language model), a config.json only."""
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("gemma4-default")
    AutoConfig.for_model("gemma4").save_pretrained(path)
    return path / "config.json"


def wrapper(path: Path, **kwargs):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, **kwargs)


def text_model(model):
    """What computes a wrapper's text: the wrapper, except Llama 4's, whose forward in transformers 5.24 runs its
    language model (`Llama4ForCausalLM`, loaded by the wrapper class) and then fails to build its output object on
    text alone (the language model's output has no `image_outputs`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(base).__name__ == "Llama4ForConditionalGeneration":
        return base.language_model  # peft's adapters sit in its modules
    return model


# -- the reader ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", WRAPPERS)
def test_the_reader_reads_the_language_model_and_the_tie_of_the_wrapper_class(checkpoints, model_type: str) -> None:
    from longfit.models.loading import resolve_model_config
    from longfit.models.model_config import read_config
    from longfit.plan.shapes import model_shape

    read = read_config(str(checkpoints[model_type]))
    source = wrapper(checkpoints[model_type])
    assert read.is_wrapper and read.architecture == type(source).__name__
    assert type(read.text) is type(source.config.get_text_config())
    tied = source.get_output_embeddings().weight is source.get_input_embeddings().weight
    assert read.tied_embeddings == tied  # Mistral 3: the wrapper's top-level tie, its text config says false
    assert resolve_model_config(str(checkpoints[model_type])).tie_word_embeddings == tied
    shape = model_shape(str(checkpoints[model_type]))
    assert (shape.layers, shape.hidden, shape.vocab, shape.tied_embeddings) == (4, 64, 384, tied)


def test_the_reader_answers_by_attribute(tmp_path) -> None:
    """GPT-2 names its layers `n_layer`; Qwen3.5-MoE's language model has no intermediate_size (the meta model's
    expert width); Gemma 4's global layers have their own head size."""
    from transformers import AutoConfig

    from longfit.plan.shapes import model_shape

    AutoConfig.for_model("gpt2", n_layer=3, n_embd=64, n_head=4).save_pretrained(tmp_path / "gpt2")
    gpt2 = model_shape(str(tmp_path / "gpt2"))
    assert (gpt2.layers, gpt2.hidden, gpt2.heads, gpt2.intermediate) == (3, 64, 4, 256)
    AutoConfig.for_model("qwen3_5_moe").save_pretrained(tmp_path / "qwen3_5_moe")
    moe = model_shape(str(tmp_path / "qwen3_5_moe" / "config.json"))
    assert moe.intermediate == 512 and moe.counted is not None and moe.linear_value_heads == 32


def test_the_tiled_mlp_is_never_chosen_where_it_cannot_run(default_gemma4) -> None:
    from longfit.memory.switches import resolve_memory_switches
    from longfit.plan.shapes import model_shape

    shape = model_shape(str(default_gemma4))
    assert "has no single MLP module" in shape.untileable_mlp
    auto = load_config(None, [f"model={default_gemma4}", "seq_len=32768"])
    assert not resolve_memory_switches(auto, "cuda", shape.vocab, untileable_mlp=shape.untileable_mlp).tiled_mlp
    asked = load_config(None, [f"model={default_gemma4}", "seq_len=32768", "memory.tiled_mlp=true"])
    with pytest.raises(ConfigError, match="memory.tiled_mlp=true: the tiled MLP cannot run .*decoder layer 0"):
        resolve_memory_switches(asked, "cuda", shape.vocab, untileable_mlp=shape.untileable_mlp)


# -- exactness -------------------------------------------------------------------------------------------------

def language_model_grads(grads: dict, causal_lm) -> dict:
    """The wrapper's gradients under the causal LM's names (the towers get none from text)."""
    from longfit.models.weights import source_names

    names = source_names(causal_lm, grads)
    return {names[key][0]: grad for key, grad in grads.items() if key in names}


@pytest.mark.parametrize("packed", [False, True], ids=["one-document-per-row", "packed"])
@pytest.mark.parametrize("model_type", WRAPPERS)
def test_loss_and_gradients_equal_the_wrapper(checkpoints, model_type: str, packed: bool, one_thread) -> None:
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.loading import load_model

    batch = parity.batches(TEXT["vocab_size"], seed=0)["packed" if packed else "one document per row"]
    model = load_model(str(checkpoints[model_type]))
    loss = batch_loss_sum(CausalLMLoss(model), batch) / batch.num_label_tokens
    loss.backward()
    got = parity.Step(loss.detach().float(), parity._grads(model))
    reference = parity.eager_step(text_model(wrapper(checkpoints[model_type], attn_implementation="eager")), batch)
    want = parity.Step(reference.loss, language_model_grads(reference.grads, model))
    assert got.grads.keys() == want.grads.keys()
    comparison = parity.compare_fp32(model_type, got, want)
    # Twice longfit check's fp32 bound: these weights are transformers' initialisation (std 0.02), whose Gemma 4 norm
    # gradients cancel more than the check's std-0.1 weights' (measured: 1.06x the bound, the wrapper's gradients
    # equal to its causal LM's bit for bit, the difference longfit attention's fp32 summation order).
    assert comparison.worst[1] <= 2, comparison.line()


# -- train and export ------------------------------------------------------------------------------------------

def run_argv(checkpoint: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return [f"model={checkpoint}", f"data.path={corpus}", f"output_dir={out}", "seq_len=64", "train.device=cpu",
            "train.steps=2", "train.micro_batch=2", "train.lr=1e-2", "train.warmup_steps=0", "eval.retrieval=false",
            *extra]


@pytest.fixture(scope="module")
def trained(checkpoints, short_documents, tmp_path_factory):
    """(model_type, train.dtype) -> (run's output_dir, its export) of `longfit train` (full fine-tuning, 2 steps),
    once per pair."""
    from longfit.train.loop import train

    runs = {}

    def run(model_type: str, dtype: str = "fp32") -> tuple[Path, Path]:
        if (model_type, dtype) not in runs:
            out = tmp_path_factory.mktemp(f"train-{model_type}-{dtype}") / "run"
            argv = run_argv(checkpoints[model_type], short_documents, out, f"train.dtype={dtype}")
            runs[model_type, dtype] = (out, Path(train(load_config(None, argv)).export_dir))
        return runs[model_type, dtype]

    return run


def trained_model(out: Path):
    """The run's model as it ended (its last checkpoint, rebuilt as `longfit export` does), in fp32 (its values
    unchanged: a bf16 run's stored weights widen exactly)."""
    from longfit.train.export_command import checkpoint_config, choose_checkpoint, rebuild_model

    checkpoint = choose_checkpoint(out, None)
    return rebuild_model(checkpoint, checkpoint_config(checkpoint, None)).float()


def text_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return text_model(model)(input_ids=IDS, use_cache=False).logits


def assert_same_model_out(source: Path, export: Path, trained_lm) -> None:
    """The export is the source checkpoint with the trained language model in it (module docstring)."""
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from longfit.models.weights import INDEX, checkpoint_files, tensors_as_saved

    loaded = wrapper(export)
    assert type(loaded).__name__ == AutoConfig.from_pretrained(source).architectures[0]
    family = getattr(transformers, type(loaded).__name__).from_pretrained(export)
    assert type(family) is type(loaded)
    configs = [AutoConfig.from_pretrained(path).to_dict() for path in (export, source)]
    assert configs[0] | {"_name_or_path": ""} == configs[1] | {"_name_or_path": ""}
    shards = sorted(path.name for path in source.glob("*.safetensors"))
    assert sorted(path.name for path in export.glob("*.safetensors")) == shards
    before, after = ({key: t for name in shards for key, t in load_file(root / name).items()} for root in (source, export))
    assert before.keys() == after.keys()
    for name in shards:
        assert load_file(export / name).keys() == load_file(source / name).keys()
    if (source / INDEX).is_file():
        assert json.loads((export / INDEX).read_text())["weight_map"] == json.loads((source / INDEX).read_text())["weight_map"]
    language = set(tensors_as_saved(trained_lm, trained_lm.state_dict(), checkpoint_files(source)))
    others = sorted(set(before) - language)
    assert any("vision" in key or "visual" in key for key in others)  # the towers are there to compare
    for key in others:
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    assert any(not torch.equal(after[key], before[key]) for key in language)
    torch.testing.assert_close(text_logits(loaded), text_logits(trained_lm), rtol=1e-5, atol=1e-5)
    copied = [p.name for p in source.iterdir()
              if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", INDEX)]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(copied)
    for name in copied:
        assert (export / name).read_bytes() == (source / name).read_bytes(), name


@pytest.mark.parametrize("model_type,dtype", [("gemma4", "fp32"), ("mistral3", "fp32"), ("mistral3", "bf16")])
def test_the_export_is_the_wrapper_that_came_in(checkpoints, trained, model_type: str, dtype: str) -> None:
    """Gemma 4 (vision and audio towers, per-layer inputs, 4 shards) and Mistral 3 (lm_head tied by the wrapper, also
    trained under train.dtype=bf16) in the default suite; the other families: test_every_family_exports_its_wrapper
    (slow)."""
    out, export = trained(model_type, dtype)
    assert_same_model_out(checkpoints[model_type], export, trained_model(out))


@pytest.mark.slow  # 6 runs of 2 steps and their exports: about 60 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe", "gemma3", "llama4"])
def test_every_family_exports_its_wrapper(checkpoints, trained, model_type: str) -> None:
    out, export = trained(model_type)
    assert_same_model_out(checkpoints[model_type], export, trained_model(out))


def test_a_text_only_export_is_still_possible(checkpoints, trained, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from longfit.cli import main

    out, _ = trained("mistral3")
    assert main(["export", str(out), "--text-only", "--out", str(tmp_path / "text")]) == 0
    text = AutoModelForCausalLM.from_pretrained(tmp_path / "text")
    assert type(text).__name__ == "MistralForCausalLM"
    torch.testing.assert_close(text_logits(text), text_logits(trained_model(out)), rtol=1e-5, atol=1e-5)


def lora_run(checkpoint: Path, corpus: Path, out: Path) -> Path:
    from longfit.train.loop import train

    return Path(train(load_config(None, run_argv(checkpoint, corpus, out, "lora.enabled=true", "lora.r=4"))).export_dir)


def assert_adapter_attaches(source: Path, out: Path, adapter: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    from longfit.train.export_command import checkpoint_config, choose_checkpoint, export_checkpoint

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(source.resolve())
    attached = PeftModel.from_pretrained(wrapper(source), adapter)
    adapted = {name.rsplit(".lora_", 1)[0] for name, _ in attached.named_parameters() if ".lora_" in name}
    assert adapted and all("language_model" in name for name in adapted)  # none in the towers
    trained_lm = trained_model(out)
    torch.testing.assert_close(text_logits(attached), text_logits(trained_lm), rtol=1e-5, atol=1e-5)
    checkpoint = choose_checkpoint(out, None)
    merged = export_checkpoint(checkpoint, checkpoint_config(checkpoint, True), tmp_path / "merged")
    assert_same_model_out(source, merged, trained_lm.merge_and_unload())


def test_the_lora_adapter_attaches_to_the_wrapper(checkpoints, short_documents, tmp_path) -> None:
    out = tmp_path / "run"
    adapter = lora_run(checkpoints["gemma3"], short_documents, out)
    assert_adapter_attaches(checkpoints["gemma3"], out, adapter, tmp_path)


@pytest.mark.slow  # 5 LoRA runs and their exports
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe", "gemma4", "llama4", "mistral3"])
def test_every_family_lora_adapter_attaches(checkpoints, short_documents, tmp_path, model_type: str) -> None:
    out = tmp_path / "run"
    adapter = lora_run(checkpoints[model_type], short_documents, out)
    assert_adapter_attaches(checkpoints[model_type], out, adapter, tmp_path)


@pytest.mark.slow  # two `longfit train --nproc 2` runs per family
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_type", WRAPPERS)
def test_context_parallel_training_equals_one_process(checkpoints, short_documents, one_rank_losses, tmp_path,
                                                      model_type: str) -> None:
    want = one_rank_losses(model_type)
    for method in ("ring", "ulysses"):
        got = cp2_losses(checkpoints[model_type], short_documents, tmp_path / method, method)
        assert got == pytest.approx(want, rel=1e-4), method


# -- plan and check ----------------------------------------------------------------------------------------------

@pytest.mark.slow  # a plan traces each layer kind, up to the longest seq_len that fits: ~50 s per family, busy cores
@pytest.mark.parametrize("model_type", WRAPPERS)
def test_longfit_plan_and_check_read_the_wrapper(checkpoints, model_type: str, capsys) -> None:
    from longfit.cli import main

    path = checkpoints[model_type]
    assert main(["plan", f"model={path}", "seq_len=1024", "--gpu-mem", "1GiB", "--host-mem", "8GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]
    assert main(["check", f"model={path}", "train.device=cpu"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exact")


@pytest.mark.slow  # the default Gemma 4's plan traces a 5B model's layer kinds: minutes on a busy 2-core machine
def test_longfit_plan_and_check_of_the_default_gemma4(default_gemma4, capsys) -> None:
    from longfit.cli import main

    assert main(["plan", f"model={default_gemma4}", "seq_len=32768", "--gpu", "h100-80gb", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert plan is not None
    assert main(["check", f"model={default_gemma4.parent}", "seq_len=32768", "--device", "cuda"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exact")
