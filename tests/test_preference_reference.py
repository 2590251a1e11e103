"""Full fine-tuning dpo / ipo against stored reference log-probabilities (#56): the pass before training
(longfit.train.reference) over the shared-prompt rows, the file it is kept in, and the held-out pairs' evaluation
(longfit.eval.preference) with TRL's metric names.

The plain reference runs prompt + chosen and prompt + rejected as separate sequences through transformers' eager model,
its reference model a frozen copy of the initial weights; the policy is those weights moved (as by training steps), so
the rewards and the loss differ from their values at the start. The longfit side computes the reference table with the
initial weights, moves them the same way, and trains on rows packed in another (shuffled) order than the pass's, which
the table is read back in by each batch's pair ids.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_bf16 import BF16, FP32, Step, assert_bf16_close  # noqa: E402
from test_preference import (SHAPES, SHORT, answer_logps, assert_fp32_equal, make_pairs, tiny_model,  # noqa: E402
                             trl_losses)

from longfit.check.parity import trl_router_loss
from longfit.config import ConfigError, load_config
from longfit.data.preferences import PairLoader
from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
from longfit.models.attention import register_attention
from longfit.parallel.dims import ParallelDims
from longfit.train.reference import read_reference, reference_pass, write_reference

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ_LEN = 96


def run_config(cp: int = 1, *extra: str):
    return load_config(None, [f"seq_len={SEQ_LEN}", "train.objective=dpo", "data.path=pairs.jsonl",
                              f"parallel.cp={cp}", *extra])


def mesh_of(cfg, world: int, model):
    text = model.config
    dims = ParallelDims.from_config(cfg, world, text.num_attention_heads,
                                    num_key_value_heads=text.num_key_value_heads, text_config=text)
    return dims.build_mesh("cpu")


def train_weights(model, rounded: bool) -> None:
    """Move every weight as training steps would (seeded; `rounded`: kept bf16 values, test_bf16's rule)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
            if rounded:
                param.copy_(param.to(BF16).float())


def frozen_reference_step(model, pairs, objective: PreferenceObjective, autocast: bool) -> tuple[Step, torch.Tensor]:
    """(mean loss and every gradient, rewards (P, 2)) of the separate sequences, the reference a frozen copy of the
    initial `model`, the policy `model` after `train_weights`."""
    reference_model = copy.deepcopy(model).requires_grad_(False)
    train_weights(model, rounded=autocast)

    def both(net):
        return torch.stack([torch.stack([answer_logps(net, p.prompt, p.chosen), answer_logps(net, p.prompt,
                                                                                            p.rejected)])
                            for p in pairs])

    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        policy = both(model)  # (P, 2)
        with torch.no_grad():
            reference = both(reference_model)
        router = trl_router_loss(model, pairs)
    lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in pairs], dtype=torch.float32)
    loss = trl_losses(objective, policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], lengths[:, 0],
                      lengths[:, 1], None).mean() + router
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return Step(loss.detach().float(), grads), (objective.beta * (policy - reference)).detach()


def stored_reference_step(model, pairs, objective: PreferenceObjective, cfg, mesh, autocast: bool, rank: int = 0,
                          world: int = 1):
    """longfit: the reference pass with the initial weights, the weights moved, then a step on rows packed in a
    shuffled order (this cp rank's shard)."""
    from longfit.parallel.batch import cp_layout, shard_batch

    loss_module = PreferenceLoss(model, objective)
    loss_module.pair_group, loss_module.router_group = mesh.cp_group, mesh.world_group  # as parallelize sets them
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        table = reference_pass(loss_module, pairs, cfg, mesh, torch.device("cpu"), BF16 if autocast else None, 0,
                               show_progress=False)
    train_weights(model, rounded=autocast)
    loss_module.stored_reference = table
    batch = next(PairLoader(pairs, "test pairs", SEQ_LEN, 1, pad_id=0, seed=3, shuffle=True, epochs=1))
    if len(pairs) > 1:
        assert batch.pair_ids.tolist() != sorted(batch.pair_ids.tolist())  # not the pass's order
    local = shard_batch(batch, rank, world, cp_layout(cfg.parallel.cp_method))
    step = StepPairs(batch.pairs, int(batch.answer_lengths.view(-1, 2)[:, 0].sum()))
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        value, sums = pair_loss_sum(loss_module, local, step)
    (value / step.pairs).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    rewards = torch.stack([sums["rewards/chosen"], sums["rewards/rejected"]]) / step.pairs
    return Step(value.detach().float() / step.pairs, grads), rewards


@pytest.mark.parametrize("family,name,packed", [("llama", "dpo", True), ("qwen3", "ipo", True),
                                                ("qwen3-moe", "dpo", True), ("qwen3-moe-router", "dpo", False),
                                                ("qwen3-moe-router", "ipo", True)])
def test_full_finetune_equals_a_frozen_reference_fp32(family, name, packed):
    """Loss, rewards and every gradient of a full fine-tune against the stored table equal the separate sequences
    against a frozen copy of the initial model (Qwen3-MoE with its router loss: TRL's term, every router's weight)."""
    objective = PreferenceObjective(name, beta=0.5)
    pairs = make_pairs(SHAPES + [(6, 4, 2)] if packed else SHAPES[:1])
    want, want_rewards = frozen_reference_step(tiny_model(family, "eager", False), pairs, objective, autocast=False)
    model = tiny_model(family, register_attention(), False)
    got, got_rewards = stored_reference_step(model, pairs, objective, run_config(), mesh_of(run_config(), 1, model),
                                             autocast=False)
    assert_fp32_equal(got, want, f"{family} {name} full")
    torch.testing.assert_close(got_rewards, want_rewards.mean(0), **FP32)
    assert want_rewards.abs().min() > 0 and want_rewards.abs().max() > 1e-2  # the policy has moved from its reference


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-moe-router-every-expert"])
def test_full_finetune_within_the_bf16_bound(family):
    """Under bf16 autocast (the pass and the step alike) within tests/test_bf16.py's bound of the fp32 truth, against
    the separate sequences' bf16 error through transformers' eager and SDPA attention."""
    objective = PreferenceObjective("dpo", beta=0.5)
    pairs = make_pairs(SHAPES + [(6, 4, 2)])
    truth, _ = frozen_reference_step(tiny_model(family, "eager", False), pairs, objective, autocast=False)
    references = [frozen_reference_step(tiny_model(family, attention, False), pairs, objective, autocast=True)[0]
                  for attention in ("eager", "sdpa")]
    model = tiny_model(family, register_attention(), False)
    got, _ = stored_reference_step(model, pairs, objective, run_config(), mesh_of(run_config(), 1, model),
                                   autocast=True)
    assert_bf16_close(got, references, truth, f"{family} dpo full bf16")


def test_the_reference_file_verifies_its_data_model_and_bytes(tmp_path):
    """Written atomically (no staging file left), read back bit for bit; a flipped byte, other data or another model
    is refused with the reason."""
    path = tmp_path / "reference_logps.safetensors"
    tables = {"train": torch.randn(5, 2), "eval": torch.randn(2, 2)}
    identity = {"data": "d1", "model": "m1"}
    write_reference(path, tables, identity)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    read, why = read_reference(path, identity)
    assert why == "" and all(torch.equal(read[name], tables[name]) for name in tables)
    assert read_reference(path, {"data": "d2", "model": "m1"}) == (None, f"{path.name} was computed for other data")
    assert read_reference(path, {"data": "d1", "model": "m2"}) == (None, f"{path.name} was computed for another model")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a byte of the last table's values
    path.write_bytes(bytes(raw))
    assert read_reference(path, identity) == (None, f"{path.name} is damaged (its checksum does not match its tables)")
    assert read_reference(tmp_path / "none", identity)[1] == "there is no none"


def test_a_run_reuses_recomputes_or_refuses_the_stored_file(tmp_path):
    """A fresh run writes the file, and reuses it when it was computed for its data and model; other data: a fresh run
    computes it again, a resumed run is refused in one line naming the reason and the fix."""
    from longfit.train.reference import FILE, stored_reference

    model = tiny_model("llama", register_attention(), False)
    cfg = run_config(1, f"output_dir={tmp_path}", "model=llama-tiny")
    mesh, lines = mesh_of(cfg, 1, model), []
    loss_module = PreferenceLoss(model, PreferenceObjective("dpo"))

    def stored(pairs, resumed):
        return stored_reference(loss_module, {"train": pairs}, cfg, mesh, torch.device("cpu"), None, 0, resumed,
                                lines.append, show_progress=False)["train"]

    pairs, other = make_pairs(SHAPES), make_pairs(SHAPES, seed=1)
    first = stored(pairs, resumed=False)
    assert lines[-1].startswith("reference log-probabilities: 3 pairs through the initial weights in ")
    assert lines[-1].endswith(f"(there is no {FILE}), written to {tmp_path / FILE}")
    assert torch.equal(stored(pairs, resumed=True), first) and lines[-1].endswith("(3 train pairs)")
    assert not torch.equal(stored(other, resumed=False), first) and f"({FILE} was computed for other data)" in lines[-1]
    with pytest.raises(ConfigError, match=f"but {FILE} was computed for other data in {tmp_path}: restore that file"):
        stored(pairs, resumed=True)


def test_full_finetune_without_a_table_is_refused():
    model = tiny_model("llama", register_attention(), False)
    batch = next(PairLoader(make_pairs(), "test pairs", SEQ_LEN, 1, pad_id=0, epochs=1))
    with pytest.raises(ConfigError, match="reads the reference log-probabilities stored before the first step"):
        PreferenceLoss(model, PreferenceObjective("dpo")).reference_log_probs(batch)


def test_held_out_pairs_give_trls_eval_metrics():
    """longfit.eval.preference on held-out pairs: TRL's eval_ names, each the mean over the pairs of the separate
    sequences' values (LoRA, the reference the adapter off); the model is left in training mode."""
    from longfit.eval.preference import evaluate_pairs
    from test_preference import reference_step

    objective = PreferenceObjective("dpo", beta=0.5)
    pairs = make_pairs(SHAPES)
    model = tiny_model("llama", "eager", True)
    want, rewards = reference_step(model, pairs, objective, autocast=False)
    with torch.no_grad():
        logps = torch.stack([torch.stack([answer_logps(model, p.prompt, p.chosen),
                                          answer_logps(model, p.prompt, p.rejected)]) for p in pairs])
    net = tiny_model("llama", register_attention(), True)
    loss_module = PreferenceLoss(net, objective)
    loader = PairLoader(pairs, "held-out pairs", 32, 1, pad_id=0, epochs=1)  # a row each: three batches
    result = evaluate_pairs(loss_module, loader, 3, torch.device("cpu"), None, mesh_of(run_config(), 1, net))
    assert loss_module.training and result.pairs == 3 and result.rows == 3
    metrics = result.metrics()
    expected = {"eval_loss": want.loss.item(), "eval_rewards/chosen": rewards[:, 0].mean().item(),
                "eval_rewards/rejected": rewards[:, 1].mean().item(),
                "eval_rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean().item(),
                "eval_rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().mean().item(),
                "eval_logps/chosen": logps[:, 0].mean().item(), "eval_logps/rejected": logps[:, 1].mean().item()}
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert 0 < metrics["eval_rewards/accuracies"] < 1  # neither all nor none right: the comparison is counted


# -- context parallelism on gloo ranks --------------------------------------------------------------------


def _cp_worker(rank: int, world: int, family: str, name: str, method: str, shapes):
    import torch.distributed as dist

    from longfit.parallel.parallelize import apply_context_parallel

    torch.set_num_threads(1)
    cfg = run_config(world, f"parallel.cp_method={method}")
    model = tiny_model(family, register_attention(), False)
    mesh = mesh_of(cfg, world, model)
    apply_context_parallel(model, mesh.cp_group, method)
    step, rewards = stored_reference_step(model, make_pairs(shapes), PreferenceObjective(name, beta=0.5), cfg, mesh,
                                          autocast=False, rank=rank, world=world)
    dist.all_reduce(step.loss)  # each rank holds loss / cp
    for grad in step.grads.values():
        dist.all_reduce(grad)  # the trainer's gradient reduction sums the ranks' shares
    return step, rewards


@pytest.mark.slow
@pytest.mark.parametrize("family,name,method,shapes", [
    ("llama", "dpo", "ring", SHAPES), ("llama", "dpo", "ulysses", SHORT), ("qwen3", "ipo", "ring", SHORT),
    ("qwen3-moe-router", "dpo", "ring", SHAPES), ("qwen3-moe-router", "dpo", "ulysses", SHORT),
], ids=["llama-dpo-ring", "llama-dpo-ulysses", "qwen3-ipo-ring-halo", "qwen3-moe-router-dpo-ring",
        "qwen3-moe-router-dpo-ulysses"])
def test_cp2_full_finetune_equals_a_frozen_reference(family, name, method, shapes):
    """cp=2 on gloo ranks: the pass's sums completed over the cp ranks, then a step on the shuffled rows: the loss,
    rewards and every gradient of the separate sequences against a frozen copy of the initial model (ipo: its
    length-normalised log-ratios of the completed sums; the router loss's counts completed over the ranks as the
    log-probabilities are)."""
    from parallel_harness import run_distributed

    objective = PreferenceObjective(name, beta=0.5)
    want, want_rewards = frozen_reference_step(tiny_model(family, "eager", False), make_pairs(shapes), objective,
                                               autocast=False)
    for got, rewards in run_distributed(_cp_worker, 2, family, name, method, shapes):
        assert_fp32_equal(got, want, f"{family} {name} full {method}")
        torch.testing.assert_close(rewards, want_rewards.mean(0), **FP32)


# -- longfit plan and longfit check read train.objective ---------------------------------------------------------


def test_the_plan_counts_the_pairs_and_their_reference():
    """The reference's forward is a third of a full fine-tune's step of the same row (2 of its 6 FLOPs per weight,
    1 of its 3 attention terms), and the plan names where the reference comes from: stored (full fine-tuning), the
    adapter off (LoRA), none (simpo)."""
    import dataclasses

    from longfit.plan import plan_config
    from longfit.plan.flops import forward_flops, step_flops
    from longfit.plan.report import plan_text

    # test_plan_cli's run (its layer trace cached for the suite), with pairs
    cfg = load_config(None, ["model=llama-tiny", "seq_len=4096", "train.device=cpu", "train.objective=dpo",
                             "data.path=pairs.jsonl"])
    result = plan_config(cfg, 1, device_type="cpu")
    s = result.setup
    forward = forward_flops(s.shape, 4096)
    assert 3 * forward == pytest.approx(step_flops(s.shape, 4096, checkpointed=False).model)
    text = plan_text(result, None, "cpu")
    assert "train.objective=dpo: a row of pairs (each prompt once, both answers after it) is counted as a packed row " \
           "of 4096 tokens" in text
    assert f"reference: log-probabilities stored before step 1 (OUTPUT_DIR/reference_logps.safetensors, 8 bytes a " \
           f"pair), a forward without gradient over every row of pairs once ({forward:.3g} FLOPs per row" in text
    lora = dataclasses.replace(result, setup=dataclasses.replace(s, lora=True))
    assert "reference: the weights with the adapter off" in plan_text(lora, None, "cpu")
    simpo = dataclasses.replace(s, config=dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                                             objective="simpo")))
    assert "no reference model" in plan_text(dataclasses.replace(result, setup=simpo), None, "cpu")


@pytest.mark.parametrize("model,name,lora", [("llama-tiny", "dpo", False), ("llama-tiny", "orpo", True),
                                              ("qwen3-moe-router", "dpo", False)])
def test_the_checks_pair_step_is_exact(tmp_path, model, name, lora):
    """`longfit check`'s step 5 on the model's shrunken copy: the pairs sharing their prompts against the separate
    sequences within the check's fp32 bound, the policy away from its reference where LoRA moves it; a Qwen3-MoE
    config asking for its router loss adds TRL's term on both sides."""
    from transformers import AutoConfig

    from longfit.check.parity import compare_fp32, pair_steps, rehearsal
    from test_preference import FAMILIES

    if model in FAMILIES:  # a directory holding only the config.json transformers writes
        values = dict(FAMILIES[model])
        AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path / model)
        model = tmp_path / model
    cfg = load_config(None, [f"model={model}", f"train.objective={name}", "data.path=pairs.jsonl",
                             f"lora.enabled={str(lora).lower()}", "train.dtype=fp32"])
    setup = rehearsal(cfg, "cpu").setup
    assert getattr(setup.config(), "output_router_logits", False) == ("router" in str(model))  # kept in the copy
    truth, got = pair_steps(setup, name)
    comparison = compare_fp32(name, got, truth)
    assert comparison.ok, comparison.worst
    assert all(grad.abs().max() > 0 for grad in truth.grads.values())
