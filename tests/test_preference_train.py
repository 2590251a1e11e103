"""Preference pairs end to end (#56): the pairs JSONL checked before the first step (one `longfit: error:` line naming
the row), chat prompts through the template, and `longfit train train.objective=dpo lora.enabled=true` on one process
(resumed bit-identically, exported) and on two (`--nproc 2 parallel.cp=2`: the one process's losses)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longfit.config import load_config
from longfit.data.documents import DataError
from longfit.data.preferences import build_pair_loader, read_pairs
from longfit.models.loading import load_tokenizer


def write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pair_rows(count: int = 8) -> list[dict]:
    """Text prompts and chat prompts alternately, answers of unequal lengths."""
    rows = []
    for i in range(count):
        document = " ".join(["alpha", "beta", "gamma", "delta"][(i * j) % 4] for j in range(10 + 3 * i))
        question = f"Read: {document}. What is item {i}?"
        prompt = question if i % 2 == 0 else [{"role": "user", "content": question}]
        rows.append({"prompt": prompt, "chosen": f"item {i} is {7 * i}", "rejected": f"no idea{'!' * i}"})
    return rows


def config(model_dir, data, out, *extra):
    return load_config(None, [f"model={model_dir}", f"data.path={data}", f"output_dir={out}", "seq_len=256",
                              "train.device=cpu", "train.objective=dpo", "lora.enabled=true", *extra])


@pytest.mark.parametrize("row,where", [
    ({"prompt": "a question", "chosen": "yes"}, "line 2: the preference row has no `rejected`"),
    ({"prompt": "a question", "chosen": "yes", "rejected": [{"role": "assistant", "content": "no"}]},
     "line 2: a text `prompt` takes text answers"),
    ({"prompt": "x" * 300, "chosen": "yes", "rejected": "no"}, "line 2: the pair takes 308 tokens"),
])
def test_a_bad_row_is_one_error_naming_it(tiny_model_dir, tmp_path, row, where):
    data = write_pairs(tmp_path / "pairs.jsonl", [pair_rows(1)[0], row])
    with pytest.raises(DataError, match=where):
        read_pairs(config(tiny_model_dir, data, tmp_path / "out"), load_tokenizer(str(tiny_model_dir)))


def test_chat_prompts_render_through_the_template(tiny_model_dir, tmp_path):
    """A chat prompt is the template's rendering with its generation prompt; each answer the rest of prompt + answer up
    to its end-of-turn token; a text prompt is BOS + text, its answers text + EOS."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    data = write_pairs(tmp_path / "pairs.jsonl", pair_rows(2))
    text, chat = read_pairs(config(tiny_model_dir, data, tmp_path / "out"), tokenizer)
    assert text.prompt[0] == tokenizer.bos_token_id and text.chosen[-1] == tokenizer.eos_token_id
    messages = pair_rows(2)[1]["prompt"]
    render = lambda chat, **kw: tokenizer.apply_chat_template(chat, return_dict=True, **kw)["input_ids"]  # noqa: E731
    assert chat.prompt.tolist() == render(messages, add_generation_prompt=True)
    full = render(messages + [{"role": "assistant", "content": "item 1 is 7"}])
    assert full[: len(chat.prompt) + len(chat.chosen)] == chat.prompt.tolist() + chat.chosen.tolist()
    assert tokenizer.decode(chat.chosen) == "item 1 is 7<|end|>"  # the separator after the end-of-turn token is cut


def test_pairs_pack_and_resume(tiny_model_dir, tmp_path):
    """Pairs pack greedily into rows; a loader restored from a state gives the same next batches."""
    data = write_pairs(tmp_path / "pairs.jsonl", pair_rows(8))
    cfg = config(tiny_model_dir, data, tmp_path / "out", "train.micro_batch=2")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    loader = build_pair_loader(cfg, tokenizer)
    first = next(loader)
    assert first.input_ids.shape == (2, 256) and first.pairs >= 3
    state = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    again = build_pair_loader(cfg, tokenizer)
    again.load_state_dict(json.loads(json.dumps(state)))
    for want, got in zip(expected, (next(again) for _ in range(3))):
        assert torch.equal(want.input_ids, got.input_ids) and want.documents.prefixes == got.documents.prefixes


def longfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longfit", *args], capture_output=True, text=True, timeout=900)


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


ARGS = ["seq_len=256", "train.device=cpu", "train.objective=dpo", "lora.enabled=true", "train.steps=3",
        "train.warmup_steps=1", "train.lr=1e-2", "train.grad_accum=2", "memory.tiled_mlp=false"]


@pytest.mark.slow
def test_dpo_trains_resumes_exactly_and_exports(tiny_model_dir, tmp_path):
    """One process: TRL's metrics logged, a run stopped after step 1 and resumed logs the straight run's losses to
    the bit, and the LoRA adapter is exported."""
    from longfit.train.loop import train

    data = write_pairs(tmp_path / "pairs.jsonl", pair_rows(8))
    straight = train(config(tiny_model_dir, data, tmp_path / "straight", *ARGS[4:]))
    rows = metric_rows(tmp_path / "straight")
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert rows[-1]["rewards/accuracies"] > 0 and rows[-1]["rewards/margins"] > 0 and straight.last_loss < 0.69
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert all(key in row for row in rows)
    interrupted = config(tiny_model_dir, data, tmp_path / "interrupted", *ARGS[4:])
    train(interrupted, stop_after_steps=1)
    assert train(interrupted).resumed_from == 1
    assert [row["loss"] for row in metric_rows(tmp_path / "interrupted")] == [row["loss"] for row in rows]
    assert (tmp_path / "straight" / "final" / "adapter_model.safetensors").is_file()


FULL = ["train.steps=3", "train.warmup_steps=1", "train.lr=1e-3", "train.grad_accum=2", "memory.tiled_mlp=false",
        "lora.enabled=false", "data.eval_fraction=0.3", "train.eval_every=2", "seq_len=384"]
TIMED = ("tokens_per_s", "step_time_s", "eval_time_s", "peak_mem_bytes")


def untimed(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key not in TIMED} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,first", [("fp32", 1e-6), ("bf16", 1e-2)])
def test_full_dpo_stores_its_reference_resumes_exactly_and_evaluates(tiny_model_dir, tmp_path, dtype, first):
    """A full fine-tune: the reference pass writes reference_logps.safetensors before step 1; a run stopped after
    step 1 refuses to resume without that file, and with it logs the straight run's losses and held-out metrics (TRL's
    eval_ names) to the bit; held-out pairs are not trained on. `first`: how far from log 2 the first loss may be
    (the pass and step 1 pack the pairs differently, which bf16 rounds differently)."""
    from longfit.config import ConfigError
    from longfit.train.loop import train
    from longfit.train.reference import FILE

    data = write_pairs(tmp_path / "pairs.jsonl", pair_rows(12))
    lines = []
    straight = train(config(tiny_model_dir, data, tmp_path / "straight", *FULL, f"train.dtype={dtype}"),
                     log=lines.append)
    assert any(line.startswith("reference log-probabilities: ") and "written to" in line for line in lines)
    rows = metric_rows(tmp_path / "straight")
    trained = [row for row in rows if "loss" in row]
    evals = [row for row in rows if "eval_loss" in row]
    assert [row["step"] for row in trained] == [1, 2, 3] and [row["step"] for row in evals] == [2, 3]
    assert trained[0]["loss"] == pytest.approx(0.6931472, abs=first)  # the policy is its reference at step 1
    assert trained[-1]["rewards/margins"] > 0 and straight.last_loss < 0.69
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert all(f"eval_{key}" in row for row in evals)
    assert 0 < evals[0]["eval_pairs"] < 12 and evals[-1]["eval_loss"] != pytest.approx(0.6931472, abs=1e-4)

    interrupted = config(tiny_model_dir, data, tmp_path / "interrupted", *FULL, f"train.dtype={dtype}")
    train(interrupted, stop_after_steps=1)
    stored = tmp_path / "interrupted" / FILE
    stored.rename(tmp_path / "aside")
    with pytest.raises(ConfigError, match=f"but there is no {FILE} in .*: restore that file, or train from step 0"):
        train(interrupted)
    (tmp_path / "aside").rename(stored)
    lines = []
    assert train(interrupted, log=lines.append).resumed_from == 1
    assert any(line.startswith(f"reference log-probabilities: read from {stored}") for line in lines)
    assert untimed(metric_rows(tmp_path / "interrupted")) == untimed(rows)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["lora.enabled=false", "train.lr=1e-3", "data.eval_fraction=0.3",
                                        "train.eval_every=2", "seq_len=384"]], ids=["lora", "full-held-out"])
def test_cp2_run_logs_the_one_process_losses(tiny_model_dir, tmp_path, extra):
    """--nproc 2 parallel.cp=2 logs the one process's losses and margins; a full fine-tune's stored reference and its
    held-out evaluations are the one process's too."""
    from longfit.train.reference import FILE

    data = write_pairs(tmp_path / "pairs.jsonl", pair_rows(12 if extra else 8))
    runs = {}
    for name, launch, cp in (("single", [], []), ("cp", ["--nproc", "2"], ["parallel.cp=2"])):
        out = tmp_path / name
        done = longfit("train", *launch, f"model={tiny_model_dir}", f"data.path={data}", f"output_dir={out}", *ARGS,
                       *extra, *cp)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = metric_rows(out)
    for single, cp in zip(runs["single"], runs["cp"], strict=True):
        for key in ("loss", "rewards/margins", "eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
            assert (key in cp) == (key in single)
            if key in single:
                assert cp[key] == pytest.approx(single[key], abs=1e-4), key
    if extra:
        from safetensors.torch import load_file

        single, cp = (load_file(tmp_path / name / FILE) for name in ("single", "cp"))
        assert single.keys() == cp.keys() == {"train", "eval"}
        for name in single:
            torch.testing.assert_close(cp[name], single[name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 89 s (load 12)
def test_cp2_run_with_the_router_loss_logs_the_one_process_losses(tmp_path):
    """A tiny Qwen3-MoE whose config asks for its router loss (coef 0.5), fully fine-tuned with dpo over two
    micro-batches a step: --nproc 2 parallel.cp=2 (FSDP2 over the cp ranks, the routing counts reduced over them and
    counted first over the micro-batches) logs the one process's losses, gradient norms and margins; at step 1 the
    policy is its reference, so the loss is ln 2 + coef x aux (1.6955: aux about k = 2, the routers near balance)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_preference import tiny_model

    from longfit.data.tokenizer import byte_tokenizer, byte_tokenizer_special_ids

    model = tiny_model("qwen3-moe-router", "eager", False)
    for name, token in byte_tokenizer_special_ids().items():
        setattr(model.config, name, token)
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    data = write_pairs(tmp_path / "pairs.jsonl", pair_rows(8))
    runs = {}
    for name, launch, cp in (("single", [], []), ("cp", ["--nproc", "2"], ["parallel.cp=2"])):
        out = tmp_path / name
        done = longfit("train", *launch, f"model={tmp_path / 'model'}", f"data.path={data}", f"output_dir={out}",
                       *ARGS, "lora.enabled=false", "train.lr=1e-3", *cp)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = metric_rows(out)
    assert runs["single"][0]["loss"] > math.log(2) + 0.5  # the router term is in the logged loss
    for single, cp in zip(runs["single"], runs["cp"], strict=True):
        for key in ("loss", "grad_norm", "rewards/margins"):
            assert cp[key] == pytest.approx(single[key], abs=1e-5), key


@pytest.mark.slow  # 16 s, most of it TRL's import and DPOTrainer's set-up
def test_apply_longfit_refuses_trls_dpo_trainer(tiny_model_dir, tmp_path):
    """TRL's DPOTrainer is refused in one line that names the longfit command training the same pairs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from longfit.config import ConfigError
    from longfit.data.tokenizer import byte_tokenizer
    from longfit.integrations.hf import apply_longfit
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    dataset = Dataset.from_list([{"prompt": "a question", "chosen": " yes", "rejected": " no"}] * 2)
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, save_strategy="no")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args, train_dataset=dataset,
                         processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"DPOTrainer trains on preference pairs.*`longfit train train.objective=dpo"):
        apply_longfit(trainer, f"model={tiny_model_dir}")


@pytest.mark.slow  # 20 s, most of it TRL's import and DPOTrainer's set-up
def test_dpo_equals_trls_dpo_trainer(tiny_model_dir, tmp_path):
    """TRL's DPOTrainer (sigmoid, beta 0.5, the reference its adapter off) on three pairs, and longfit's objective on
    the same token ids, each prompt computed once: the same loss and every gradient."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from longfit.data.preferences import Pair, PairLoader
    from longfit.data.tokenizer import byte_tokenizer
    from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
    from longfit.models.attention import register_attention

    rows = [{"prompt": f"question {i}: {'x' * (5 * i)}", "chosen": f" answer {i}", "rejected": " no" * (i + 1)}
            for i in range(3)]
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, save_strategy="no", beta=0.5,
                     per_device_train_batch_size=3)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager"),
                         args=args, train_dataset=Dataset.from_list(rows), processing_class=byte_tokenizer(),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = trainer.model
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft's zero B would make the policy its reference
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    inputs = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    assert abs(trl_loss.item() - 0.6931472) > 1e-3  # the policy is not its reference
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    pairs = [Pair(*(torch.tensor(row[key]).numpy() for key in ("prompt_ids", "chosen_ids", "rejected_ids")))
             for row in trainer.train_dataset]
    batch = next(PairLoader(pairs, "trl pairs", 256, 1, pad_id=0, epochs=1))
    model.base_model.model.set_attn_implementation(register_attention())
    loss_module = PreferenceLoss(model, PreferenceObjective("dpo", beta=0.5))
    step = StepPairs(batch.pairs, int(batch.answer_lengths.view(-1, 2)[:, 0].sum()))
    value, _ = pair_loss_sum(loss_module, batch, step)
    (value / step.pairs).backward()
    assert batch.pairs == 3
    torch.testing.assert_close(value.detach() / step.pairs, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, grad in trl_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # 51 s (load 15), most of it TRL's import and DPOTrainer's set-up
def test_full_dpo_with_the_router_loss_equals_trls_dpo_trainer(tmp_path):
    """TRL's DPOTrainer fully fine-tuning a tiny Qwen3-MoE whose config asks for its router loss (output_router_logits,
    coef 0.5: TRL adds coef x the policy forward's aux_loss), its reference a frozen copy of the initial weights, the
    policy moved from them; longfit's dpo on the same token ids, each prompt once, against the reference stored from
    the initial weights: the same loss and every gradient (the routers' own weights among them)."""
    import copy

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    sys.path.insert(0, str(Path(__file__).parent))
    from test_preference import tiny_model
    from test_preference_reference import train_weights

    from longfit.data.preferences import Pair, PairLoader
    from longfit.data.tokenizer import byte_tokenizer
    from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
    from longfit.models.attention import register_attention

    rows = [{"prompt": f"question {i}: {'x' * (5 * i)}", "chosen": f" answer {i}", "rejected": " no" * (i + 1)}
            for i in range(3)]
    initial = tiny_model("qwen3-moe-router", "eager", False)
    policy = copy.deepcopy(initial)
    train_weights(policy, rounded=False)
    # fp32: TRL's default bf16=True puts its models' forward under accelerate's mixed precision, on the CPU too
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, save_strategy="no", beta=0.5,
                     per_device_train_batch_size=3, bf16=False)
    trainer = DPOTrainer(model=policy, ref_model=copy.deepcopy(initial), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=byte_tokenizer())
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5
    inputs = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    assert 0.5 * trainer._metrics["train"]["aux_loss"][-1] > 0.5  # the router term is in TRL's loss, of its size
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    pairs = [Pair(*(torch.tensor(row[key]).numpy() for key in ("prompt_ids", "chosen_ids", "rejected_ids")))
             for row in trainer.train_dataset]
    batch = next(PairLoader(pairs, "trl pairs", 256, 1, pad_id=0, epochs=1))
    model = copy.deepcopy(initial)
    model.set_attn_implementation(register_attention())
    loss_module = PreferenceLoss(model, PreferenceObjective("dpo", beta=0.5))
    loss_module.stored_reference = torch.zeros(len(pairs), 2)
    loss_module.stored_reference[batch.pair_ids] = loss_module.reference_sums(batch)
    model.load_state_dict(policy.state_dict())
    step = StepPairs(batch.pairs, int(batch.answer_lengths.view(-1, 2)[:, 0].sum()))
    value, _ = pair_loss_sum(loss_module, batch, step)
    (value / step.pairs).backward()
    assert batch.pairs == 3
    torch.testing.assert_close(value.detach() / step.pairs, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(model.named_parameters())
    for name, grad in trl_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name].grad, grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("extra,fix", [
    (["parallel.pp=2"], "set parallel.pp=1"),
    (["train.label_smoothing=0.5"], r"must be in \[0, 0.5\)"),
])
def test_what_the_objectives_cannot_compute_is_refused_in_one_line(tmp_path, extra, fix):
    from longfit.config import ConfigError

    with pytest.raises(ConfigError, match=fix):
        config("llama-tiny", tmp_path / "pairs.jsonl", tmp_path / "out", *extra)


def test_tiled_layers_stay_off_for_pairs(tmp_path):
    """`auto` leaves the tiled layers off for the preference objectives even where it turns them on (a long row on
    CUDA), and `true` is refused in one line."""
    from longfit.config import ConfigError
    from longfit.memory.switches import resolve_memory_switches

    long_row = ["seq_len=131072"]
    assert resolve_memory_switches(load_config(None, ["seq_len=131072"]), "cuda", 50000).tiled_layers
    pairs = config("llama-tiny", "pairs.jsonl", tmp_path, *long_row)
    assert not resolve_memory_switches(pairs, "cuda", 50000).tiled_layers
    with pytest.raises(ConfigError, match="memory.tiled_layers=true with train.objective=dpo"):
        resolve_memory_switches(config("llama-tiny", "pairs.jsonl", tmp_path, "memory.tiled_layers=true"), "cpu", 50000)
