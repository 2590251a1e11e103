"""Preference objectives with each pair's prompt computed once (#56): loss, rewards and every gradient against a plain
one-process reference that runs prompt + chosen and prompt + rejected as separate sequences through transformers' eager
model, and the objectives' formulas written out here from TRL's trainers.

The longfit side lays pairs out as the trainer does (longfit.data.preferences: prompt, chosen, rejected in one row, the
rejected answer seeing the prompt as its prefix) and runs PreferenceLoss with longfit's attention; the reference never
sees that layout. Tiny Llama and Qwen3 (transformers' own classes, tests/test_families.py's sizes), fp32 and under bf16
autocast (tests/test_bf16.py's bound); one pair per row, and several pairs packed in one row beside padding.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_bf16 import BF16, FP32, Step, assert_bf16_close  # noqa: E402
from test_families import SMALL, VOCAB  # noqa: E402

from longfit.data.preferences import Pair, PairLoader
from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
from longfit.models.attention import register_attention

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {"llama": dict(SMALL, model_type="llama"), "qwen3": dict(SMALL, model_type="qwen3")}
# (prompt, chosen, rejected) token counts: answers of unequal length, one a single token
SHAPES = [(13, 5, 7), (9, 6, 1), (20, 3, 8)]


def make_pairs(shapes=SHAPES, seed: int = 0) -> list[Pair]:
    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(1, VOCAB, (n,), generator=generator).numpy().astype(np.int64)  # noqa: E731
    return [Pair(draw(p), draw(c), draw(r)) for p, c, r in shapes]


def pair_batch(pairs: list[Pair], seq_len: int, rows: int = 1):
    loader = PairLoader(pairs, "test pairs", seq_len, rows, pad_id=0, epochs=1)
    return next(loader)


def tiny_model(family: str, attn_implementation: str, lora: bool):
    """A tiny `family` model with seeded std-0.1 weights rounded to bf16 values (test_bf16.family_model's rule); with
    `lora`, random adapters (peft's zero B would make the policy the reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = copy.deepcopy(FAMILIES[family])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_((torch.randn(param.shape, generator=generator) * 0.1).to(BF16).float())
    model.config.use_cache = False
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(BF16).float())
    return model


def answer_logps(model, prompt: np.ndarray, answer: np.ndarray) -> torch.Tensor:
    """log p(answer | prompt) of one separate sequence prompt + answer through the model's own forward."""
    ids = torch.from_numpy(np.concatenate([prompt, answer])).unsqueeze(0)
    logits = model(input_ids=ids, use_cache=False).logits[0].float()  # (T, V)
    targets = ids[0, len(prompt):]
    return logits[len(prompt) - 1 : -1].log_softmax(-1).gather(1, targets.unsqueeze(1)).sum()


def trl_losses(objective: PreferenceObjective, c, r, c_ref, r_ref, n_c, n_r, nll):
    """TRL's per-pair losses, written out from DPOTrainer (sigmoid, ipo), CPOTrainer (simpo) and ORPOTrainer."""
    beta, eps = objective.beta, objective.label_smoothing
    if objective.name == "dpo":
        d = (c - c_ref) - (r - r_ref)
        return -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    if objective.name == "ipo":
        return ((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / (2 * beta)) ** 2
    a_c, a_r = c / n_c, r / n_r
    if objective.name == "simpo":
        logits = a_c - a_r - objective.simpo_gamma / beta
        return -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
    log_odds = (a_c - a_r) - (torch.log1p(-torch.exp(a_c)) - torch.log1p(-torch.exp(a_r)))
    return -beta * F.logsigmoid(log_odds) + nll


def reference_step(model, pairs: list[Pair], objective: PreferenceObjective, autocast: bool) -> tuple[Step, torch.Tensor]:
    """(the mean loss over the pairs and every trainable gradient, rewards (P, 2)) from separate sequences."""
    def both(net):
        return [torch.stack([answer_logps(net, p.prompt, p.chosen), answer_logps(net, p.prompt, p.rejected)])
                for p in pairs]

    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        policy = torch.stack(both(model))  # (P, 2)
        reference = None
        if objective.needs_reference:
            with torch.no_grad(), model.disable_adapter():
                reference = torch.stack(both(model))
    lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in pairs], dtype=torch.float32)
    chosen_tokens = lengths[:, 0].sum()
    nll = -policy[:, 0].sum() / chosen_tokens  # ORPO's mean token NLL of the chosen answers
    c, r = policy[:, 0], policy[:, 1]
    c_ref, r_ref = (reference[:, 0], reference[:, 1]) if reference is not None else (None, None)
    loss = trl_losses(objective, c, r, c_ref, r_ref, lengths[:, 0], lengths[:, 1], nll).mean()
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    rewards = objective.beta * ((policy - reference) if reference is not None else policy / lengths)
    return Step(loss.detach().float(), grads), rewards.detach()


def longfit_step(model, batch, objective: PreferenceObjective, autocast: bool) -> tuple[Step, torch.Tensor]:
    loss_module = PreferenceLoss(model, objective)
    step = StepPairs(batch.pairs, int(batch.answer_lengths.view(-1, 2)[:, 0].sum()))
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        value, sums = pair_loss_sum(loss_module, batch, step)
    (value / step.pairs).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    rewards = torch.stack([sums["rewards/chosen"], sums["rewards/rejected"]]) / step.pairs
    return Step(value.detach().float() / step.pairs, grads), rewards


def assert_fp32_equal(got: Step, want: Step, name: str) -> None:
    torch.testing.assert_close(got.loss, want.loss, **FP32, msg=lambda m: f"{name} loss: {m}")
    assert got.grads.keys() == want.grads.keys()
    for param, exact in want.grads.items():
        assert exact.abs().max() > 0, f"{name}: {param} has no gradient to compare"
        scale = exact.abs().max()
        torch.testing.assert_close(got.grads[param] / scale, exact / scale, **FP32,
                                   msg=lambda m: f"{name} grad {param}: {m}")


CASES = [  # (family, objective, lora, pairs packed in one row)
    ("llama", "dpo", True, False),
    ("llama", "dpo", True, True),
    ("qwen3", "dpo", True, True),
    ("llama", "ipo", True, True),
    ("llama", "simpo", False, True),
    ("qwen3", "orpo", False, True),
]


@pytest.mark.parametrize("family,name,lora,packed", CASES)
def test_pairs_equal_separate_sequences_fp32(family, name, lora, packed):
    """Loss, rewards and every gradient of the shared-prompt rows equal prompt + chosen and prompt + rejected run
    separately through transformers' eager model."""
    objective = PreferenceObjective(name, beta=0.5, label_smoothing=0.1 if name in ("dpo", "simpo") else 0.0)
    pairs = make_pairs() if packed else make_pairs()[:1]
    batch = pair_batch(pairs, seq_len=96)
    assert batch.pairs == len(pairs) and len(batch.documents.rows[0]) == 2 * len(pairs) + 1  # + padding
    want, want_rewards = reference_step(tiny_model(family, "eager", lora), pairs, objective, autocast=False)
    got, got_rewards = longfit_step(tiny_model(family, register_attention(), lora), batch, objective, autocast=False)
    assert_fp32_equal(got, want, f"{family} {name}")
    torch.testing.assert_close(got_rewards, want_rewards.mean(0), **FP32)
