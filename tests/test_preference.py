"""Preference objectives with each pair's prompt computed once (#56): loss, rewards and every gradient against a plain
one-process reference that runs prompt + chosen and prompt + rejected as separate sequences through transformers' eager
model, and the objectives' formulas written out here from TRL's trainers.

The longfit side lays pairs out as the trainer does (longfit.data.preferences: prompt, chosen, rejected in one row, the
rejected answer seeing the prompt as its prefix) and runs PreferenceLoss with longfit's attention; the reference never
sees that layout. Tiny Llama, Qwen3 and Qwen3-MoE (transformers' own classes, tests/test_families.py's sizes), fp32
and under bf16 autocast (tests/test_bf16.py's bound); one pair per row, and several pairs packed in one row beside
padding. Qwen3-MoE with output_router_logits adds its experts' load-balancing loss as TRL's DPOTrainer does: the
reference takes it from transformers' own forward over the 2 P separate sequences padded into one batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_bf16 import BF16, FP32, Step, assert_bf16_close, bf16_valued_model  # noqa: E402
from test_families import SMALL, VOCAB  # noqa: E402

from longfit.check.parity import trl_router_loss
from longfit.data.preferences import Pair, PairLoader
from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
from longfit.models.attention import register_attention

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {"llama": dict(SMALL, model_type="llama"), "qwen3": dict(SMALL, model_type="qwen3"),
            "mistral": dict(SMALL, model_type="mistral", sliding_window=24),
            "qwen3-moe": dict(SMALL, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True)}
# Its experts' load-balancing loss on, weighted so that its gradient is of the objective's size (transformers: 0.001)
FAMILIES["qwen3-moe-router"] = dict(FAMILIES["qwen3-moe"], output_router_logits=True, router_aux_loss_coef=0.5)
# Under bf16 with the routers trained: every expert chosen (test_families_moe.py: a top-k choice flips near-tied routes
# under bf16 in any implementation, so no bf16-sized bound holds on the routers' gradient), coef 0.01 as there
FAMILIES["qwen3-moe-router-every-expert"] = dict(FAMILIES["qwen3-moe"], num_experts_per_tok=4,
                                                 output_router_logits=True, router_aux_loss_coef=0.01)
# (prompt, chosen, rejected) token counts: answers of unequal length, one a single token
SHAPES = [(13, 5, 7), (9, 6, 1), (20, 3, 8)]
# Pairs of at most 16 tokens filling a row of 96 (no longer padding document): under cp=2 (zigzag chunks of 24) the
# ring exchanges only its halo of 15 keys (parallel/ring.py); the second pair's rejected answer crosses into the next
# chunk 14 tokens after its prompt's start, further back than any document without its prompt reaches (13).
SHORT = [(4, 3, 3), (6, 5, 5), (10, 3, 3), (8, 3, 5), (9, 2, 5), (7, 4, 5), (2, 2, 2)]


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
    return bf16_valued_model(FAMILIES[family], attn_implementation, ["q_proj", "v_proj", "down_proj"] if lora else None)


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


def reference_step(
    model, pairs: list[Pair], objective: PreferenceObjective, autocast: bool
) -> tuple[Step, torch.Tensor]:
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
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        router = trl_router_loss(model, pairs)
    loss = trl_losses(objective, c, r, c_ref, r_ref, lengths[:, 0], lengths[:, 1], nll).mean() + router
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    rewards = objective.beta * ((policy - reference) if reference is not None else policy / lengths)
    return Step(loss.detach().float(), grads), rewards.detach()


def longfit_step(model, batch, objective: PreferenceObjective, autocast: bool, **loss) -> tuple[Step, torch.Tensor]:
    loss_module = PreferenceLoss(model, objective, **loss)
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
    ("qwen3", "dpo", True, False),
    ("qwen3", "dpo", True, True),
    ("llama", "ipo", True, True),
    ("llama", "simpo", False, True),
    ("qwen3", "orpo", False, True),
    ("qwen3-moe", "dpo", True, True),  # output_router_logits off, as its default config
    ("qwen3-moe-router", "dpo", True, False),  # + the router loss: the prompt routed in both separate sequences
    ("qwen3-moe-router", "simpo", False, True),  # the routers' own weights trained by it too
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


def test_the_router_loss_over_accumulated_micro_batches():
    """train.grad_accum: each pair a micro-batch of its own row; the step's routing counts from the counting forward
    (memory.loss.step_router_counts) make the router term TRL's over all of the step's pairs in one batch (each
    micro-batch's own counts would give another aux), loss and every gradient (the routers' weights among them)."""
    from longfit.memory.loss import step_router_counts

    objective = PreferenceObjective("simpo", beta=0.5)
    pairs = make_pairs()
    want, _ = reference_step(tiny_model("qwen3-moe-router", "eager", False), pairs, objective, autocast=False)
    model = tiny_model("qwen3-moe-router", register_attention(), False)
    loss_module = PreferenceLoss(model, objective)
    micro_batches = [pair_batch([pair], seq_len=48) for pair in pairs]
    step = StepPairs(len(pairs), sum(len(pair.chosen) for pair in pairs))
    counts = step_router_counts(loss_module, micro_batches)
    loss = 0
    for batch in micro_batches:
        value, _ = pair_loss_sum(loss_module, batch, step, counts)
        (value / step.pairs).backward()
        loss += value.detach() / step.pairs
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    assert_fp32_equal(Step(loss, grads), want, "qwen3-moe router loss accumulated")


def test_the_chunked_loss_computes_the_same_answers():
    """memory.chunked_loss in chunks of 3 tokens, fewer than most answers: the same loss and gradients."""
    objective = PreferenceObjective("dpo", beta=0.5)
    pairs = make_pairs()
    want, _ = reference_step(tiny_model("llama", "eager", True), pairs, objective, autocast=False)
    got, _ = longfit_step(tiny_model("llama", register_attention(), True), pair_batch(pairs, 96), objective, False,
                          chunked_loss=True, loss_chunk=3)
    assert_fp32_equal(got, want, "chunked loss")


@pytest.mark.parametrize("family,name,lora", [("llama", "dpo", True), ("qwen3", "simpo", False),
                                              ("qwen3-moe-router", "dpo", True)])
def test_pairs_within_the_bf16_bound(family, name, lora):
    """Under bf16 autocast the shared-prompt rows are within tests/test_bf16.py's bound of the fp32 truth, measured
    against the bf16 error of the separate sequences through transformers' eager and SDPA attention."""
    objective = PreferenceObjective(name, beta=0.5)
    pairs = make_pairs()
    batch = pair_batch(pairs, seq_len=96)
    truth, _ = reference_step(tiny_model(family, "eager", lora), pairs, objective, autocast=False)
    references = [reference_step(tiny_model(family, attention, lora), pairs, objective, autocast=True)[0]
                  for attention in ("eager", "sdpa")]
    got, _ = longfit_step(tiny_model(family, register_attention(), lora), batch, objective, autocast=True)
    assert_bf16_close(got, references, truth, f"{family} {name} bf16")


def test_a_sliding_window_counts_positions_past_the_other_answer():
    """Mistral's window (24) on a prompt of 20: the rejected answer's window reaches into the prompt by positions,
    which continue from the prompt's end past the chosen answer (models/blockwise.py's shared prompts)."""
    objective = PreferenceObjective("simpo", beta=0.5)
    pairs = make_pairs([(20, 9, 12), (30, 4, 6)])
    want, _ = reference_step(tiny_model("mistral", "eager", False), pairs, objective, autocast=False)
    got, _ = longfit_step(tiny_model("mistral", register_attention(), False), pair_batch(pairs, 96), objective, False)
    assert_fp32_equal(got, want, "mistral window")


def test_layout_of_a_pair():
    """Positions continue from the prompt in both answers; the prompt's last token predicts both first tokens."""
    pair = make_pairs([(4, 2, 3)])[0]
    batch = pair_batch([pair], seq_len=12)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 0, 1, 2]
    assert batch.documents.rows == (((0, 6), (6, 9), (9, 12)),) and batch.documents.prefixes == ((None, (0, 4), None),)
    assert batch.labels[0, 3:5].tolist() == pair.chosen.tolist() and batch.branch_labels[0, 3] == pair.rejected[0]
    assert batch.labels[0, 6:8].tolist() == pair.rejected[1:].tolist()
    assert batch.sequences[0].tolist() == [-1, -1, -1, 0, 0, -1, 1, 1, -1, -1, -1, -1]
    assert batch.branch_sequences[0].tolist() == [-1, -1, -1, 1] + [-1] * 8
    assert batch.answer_lengths.tolist() == [2, 3] and batch.documents.longest == 9


# -- context parallelism on gloo ranks --------------------------------------------------------------------


def _cp_worker(rank: int, world: int, family: str, name: str, method: str, shapes):
    import torch.distributed as dist

    from longfit.parallel.batch import shard_batch
    from longfit.parallel.parallelize import apply_context_parallel

    torch.set_num_threads(1)
    objective = PreferenceObjective(name, beta=0.5)
    batch = pair_batch(make_pairs(shapes), seq_len=96)
    model = tiny_model(family, register_attention(), lora=objective.needs_reference)
    layout = apply_context_parallel(model, dist.group.WORLD, method)
    local = shard_batch(batch, rank, world, layout)
    loss_module = PreferenceLoss(model, objective)
    loss_module.pair_group = loss_module.router_group = dist.group.WORLD  # as parallelize sets them
    step = StepPairs(batch.pairs, int(batch.answer_lengths.view(-1, 2)[:, 0].sum()))
    value, sums = pair_loss_sum(loss_module, local, step)
    (value / step.pairs).backward()
    loss = value.detach() / step.pairs
    dist.all_reduce(loss)  # each rank holds loss / cp: the sum is the loss
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    for grad in grads.values():
        dist.all_reduce(grad)  # the trainer's gradient reduction sums the ranks' shares (memory/preference.py)
    return Step(loss, grads), torch.stack([sums["rewards/chosen"], sums["rewards/rejected"]]) / step.pairs


@pytest.mark.slow
@pytest.mark.parametrize("family,name,method,shapes", [
    ("llama", "dpo", "ring", SHAPES), ("llama", "dpo", "ulysses", SHAPES), ("qwen3", "orpo", "ring", SHORT),
    ("qwen3", "orpo", "ulysses", SHORT), ("qwen3-moe-router", "dpo", "ring", SHAPES),
    ("qwen3-moe-router", "dpo", "ulysses", SHORT),
], ids=["llama-dpo-ring", "llama-dpo-ulysses", "qwen3-orpo-ring-halo", "qwen3-orpo-ulysses", "qwen3-moe-router-ring",
        "qwen3-moe-router-ulysses"])
def test_cp2_pairs_equal_separate_sequences(family, name, method, shapes):
    """cp=2 on gloo ranks: pairs packed in a row of 96 tokens, spread over the ranks (ring: zigzag chunks of 24
    tokens, so answers and prompts cross chunks; SHORT: the ring's halo path): loss, rewards and every gradient equal
    the separate sequences."""
    from parallel_harness import run_distributed

    objective = PreferenceObjective(name, beta=0.5)
    want, want_rewards = reference_step(tiny_model(family, "eager", objective.needs_reference), make_pairs(shapes),
                                        objective, autocast=False)
    results = run_distributed(_cp_worker, 2, family, name, method, shapes)
    for got, rewards in results:
        assert_fp32_equal(got, want, f"{family} {name} {method}")
        torch.testing.assert_close(rewards, want_rewards.mean(0), **FP32)


def test_a_batch_of_padding_alone_backpropagates_nothing():
    """A dp rank's share of the data's last step may be padding alone: its loss is 0, tied to the model, and every
    gradient 0 (its backward runs as the other ranks' do)."""
    loader = PairLoader(make_pairs(SHAPES[:1]), "test pairs", 64, 1, pad_id=0, dp_rank=1, dp_size=2, epochs=1)
    batch = next(loader)
    assert batch.pairs == 0
    model = tiny_model("llama", register_attention(), True)
    value, sums = pair_loss_sum(PreferenceLoss(model, PreferenceObjective("dpo")), batch, StepPairs(1, 5))
    value.backward()
    assert value.item() == 0 and all(v.item() == 0 for v in sums.values())
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_a_shard_without_answer_tokens_backpropagates_through_lm_head():
    """Under cp a rank may hold none of a micro-batch's answer tokens (its positions lie in other ranks' shards; here
    the batch's answer positions dropped, as such a rank sees them): its share of the loss is 0, tied to the body and
    lm_head alike, so its backward gives every parameter a gradient (0), as the other ranks' do: FSDP2 reduces the
    gradients of the parameters that have one (a `longfit train --nproc 2 parallel.cp=2` step failed without)."""
    import dataclasses

    batch = pair_batch(make_pairs([(40, 3, 3)]), seq_len=64)
    none = torch.full_like(batch.sequences, -1)
    elsewhere = dataclasses.replace(batch, sequences=none, branch_sequences=none)
    model = tiny_model("llama", register_attention(), False)
    value, _ = pair_loss_sum(PreferenceLoss(model, PreferenceObjective("simpo")), elsewhere, StepPairs(1, 3))
    value.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
