"""Per family: longfit's loss and every gradient equal transformers' eager attention (fp32).

Llama, Qwen2 (q/k/v biases), Mistral (a sliding window on every layer, wider than a cp=2 chunk) and Gemma 3
(local and global layers, a window narrower than a chunk, q/k norms, query_pre_attn_scalar unlike head_dim,
final-logit softcapping, tied embeddings): tiny random models on rows of 64 tokens, longer than every window.
The reference is transformers' own model with attn_implementation="eager" -- transformers builds its masks
(causal, sliding window) -- and the cross-entropy of its logits; for packed rows, each document run alone
(`parity.eager_step`). longfit runs its training objective (CausalLMLoss, chunked loss) on one
process, with one document per row and with packed documents, and on two gloo ranks with ring and Ulysses
context parallelism under FSDP2 (`parallelize`, activation checkpointing on), packed documents.

The steps and the comparison are `longfit check`'s (`longfit.check.parity`: its models with seeded std-0.1
weights, its batches, its fp32 bound -- every element within 1e-5 of the tensor's own scale, stricter than
1e-5 absolute, which the query and key projections' gradients of these models, below 1e-5, pass whatever
they are); here on hand-written tiny configs, where `longfit check` shrinks a user's config. A new family is
an entry of FAMILIES.
"""

from __future__ import annotations

import copy

import pytest
import torch

from longfit.check import parity
from longfit.check.parity import Setup
from longfit.data.packing import PackedBatch
from longfit.models.kernels import accumulation_dtype

L, VOCAB = 64, 384
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FAMILIES = {
    "llama": dict(SMALL, model_type="llama"),
    "qwen2": dict(SMALL, model_type="qwen2"),
    "mistral": dict(SMALL, model_type="mistral", sliding_window=24),
    "gemma3": dict(SMALL, model_type="gemma3_text", num_hidden_layers=4, sliding_window=13, sliding_window_pattern=2,
                   query_pre_attn_scalar=24, final_logit_softcapping=2.0),
}
DOCS = parity.DOCS  # per row: shorter than, longer than and about the windows
assert L == parity.ROW
SINGLE_PROCESS = ["memory.activation_checkpointing=false", "memory.tiled_mlp=false", "memory.chunked_loss=true",
                  "memory.loss_chunk=24"]  # the training objective, chunked
CONTEXT_PARALLEL = ["memory.tiled_mlp=false", "memory.loss_chunk=24"]  # activation checkpointing on (the default)


def setup(family: str, memory: list[str]) -> Setup:
    return Setup(copy.deepcopy(FAMILIES[family]), [], memory, True, torch.float32, "ring", seed=0)


def build(family: str, attn_implementation: str):
    """The family's tiny model with the same random weights for every implementation (std 0.1: logits
    large enough for the softcap to bend them)."""
    return parity.build(setup(family, []), attn_implementation)


def make_batch(packed: bool) -> PackedBatch:
    """Two rows of L tokens: DOCS packed, or one document per row (cu_seqlens None)."""
    return parity.batches(VOCAB, seed=0)["packed" if packed else "one document per row"]


def eager_reference(family: str, batch: PackedBatch) -> parity.Step:
    return parity.eager_step(build(family, "eager"), batch)


def assert_matches(got: parity.Step, ref: parity.Step, name: str) -> None:
    assert got.grads.keys() == ref.grads.keys(), name
    for param, grad in ref.grads.items():
        assert grad.abs().max() > 0, f"{name}: {param} has no gradient to compare"
    comparison = parity.compare_fp32(name, got, ref)
    assert comparison.ok, comparison.line()


@pytest.mark.parametrize("packed", [False, True], ids=["one-document-per-row", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_matches_eager(family: str, packed: bool) -> None:
    batch = make_batch(packed)
    got = parity.longfit_step(setup(family, SINGLE_PROCESS), batch, techniques=True)
    assert_matches(got, eager_reference(family, batch), family)


def test_the_families_really_exercise_windows_and_gemma_specifics() -> None:
    """Guards the configs above: windows shorter than the rows, local and global Gemma layers, the softcap bending."""
    mistral, gemma = build("mistral", "eager"), build("gemma3", "eager")
    assert mistral.config.sliding_window < L and gemma.config.sliding_window < L
    assert set(gemma.config.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma.model.layers[0].self_attn.scaling != gemma.config.head_dim**-0.5
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight
    batch = make_batch(packed=True)
    logits = gemma(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    assert logits.abs().max() > 1.0  # tanh(x / 2) * 2 differs from x well beyond the tolerance there


def cp_worker(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    """longfit check's context-parallel step (`parallelize`, this rank's shard, the global mean loss) per case."""
    results = {}
    for family, method in cases:
        case = setup(family, CONTEXT_PARALLEL)
        case.cp_method = method
        results[f"{family}-{method}"] = parity.cp_worker(rank, world_size, case, cp=world_size, tp=1)
    return results


CP_CASES = [(family, method) for family in FAMILIES for method in ("ring", "ulysses")]


@pytest.fixture(scope="module")
def cp_results() -> list[dict]:
    from longfit.check.ranks import run_on_ranks

    return run_on_ranks(cp_worker, 2, CP_CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,method", CP_CASES, ids=[f"{f}-{m}" for f, m in CP_CASES])
def test_context_parallel_matches_eager(cp_results, family: str, method: str) -> None:
    ref = eager_reference(family, make_batch(packed=True))
    for rank, results in enumerate(cp_results):
        got = results[f"{family}-{method}"]
        assert got.loss.dtype == accumulation_dtype(torch.float32)
        assert_matches(got, ref, f"rank {rank} {family}-{method}")


# Decoder layers that call their attention without the keyword arguments the model body gave them (cu_seq_lens_q,
# longfit_documents), only with position_ids: the documents reach longfit's attention through the call's position_ids
# (`attention.remember_documents`). StableLM (partial rotary, per-head q/k norms, q/k/v biases) and Nemotron
# (partial rotary, layer norms with a bias), transformers' default configs at SMALL's widths.
POSITIONS_ONLY = {
    "stablelm": dict(SMALL, model_type="stablelm", qk_layernorm=True, use_qkv_bias=True),
    "nemotron": dict(SMALL, model_type="nemotron"),
}
CHECKPOINTED = ["memory.activation_checkpointing=true", "memory.checkpoint_fraction=1.0", "memory.tiled_mlp=false",
                "memory.chunked_loss=true", "memory.loss_chunk=24"]  # the recomputation passes position_ids again


def positions_only_setup(family: str, memory: list[str], dtype: torch.dtype = torch.float32) -> Setup:
    return Setup(copy.deepcopy(POSITIONS_ONLY[family]), [], memory, True, dtype, "ring", seed=0)


@pytest.mark.parametrize("family,packed", [("stablelm", False), ("stablelm", True), ("nemotron", True),
                                           pytest.param("nemotron", False, marks=pytest.mark.slow)])
def test_documents_reach_attention_called_without_keywords(family: str, packed: bool) -> None:
    batch = make_batch(packed)
    got = parity.longfit_step(positions_only_setup(family, CHECKPOINTED), batch, techniques=True)
    ref = parity.eager_step(parity.build(positions_only_setup(family, []), "eager"), batch)
    assert_matches(got, ref, family)


def test_without_the_remembered_documents_packed_rows_differ(monkeypatch) -> None:
    """The layers really drop the keywords: without the layout remembered for position_ids, the documents of a
    packed row attend to each other."""
    import longfit.memory.loss as loss

    monkeypatch.setattr(loss, "remember_documents", lambda position_ids, documents: None)
    batch = make_batch(packed=True)
    got = parity.longfit_step(positions_only_setup("stablelm", CHECKPOINTED), batch, techniques=True)
    ref = parity.eager_step(parity.build(positions_only_setup("stablelm", []), "eager"), batch)
    assert not parity.compare_fp32("stablelm", got, ref).ok


@pytest.mark.parametrize("family", ["stablelm", pytest.param("nemotron", marks=pytest.mark.slow)])
def test_documents_reach_attention_called_without_keywords_under_bf16(family: str) -> None:
    setup_bf16 = positions_only_setup(family, CHECKPOINTED, parity.BF16)
    batch = make_batch(packed=True)
    truth = parity.eager_step(parity.build(setup_bf16, "eager"), batch)
    references = [parity.eager_step(parity._as_reference(setup_bf16, attn), batch, autocast=parity.BF16)
                  for attn in parity.bf16_references(setup_bf16)]
    got = parity.longfit_step(setup_bf16, batch, techniques=True, autocast=True)
    comparison = parity.compare_bf16(family, got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def positions_only_cp_worker(rank: int, world_size: int, method: str) -> dict:
    results = {}
    for family in POSITIONS_ONLY:
        case = positions_only_setup(family, CONTEXT_PARALLEL)
        case.cp_method = method
        results[family] = parity.cp_worker(rank, world_size, case, cp=world_size, tp=1)
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_documents_reach_attention_called_without_keywords_under_cp(method: str) -> None:
    from longfit.check.ranks import run_on_ranks

    results = run_on_ranks(positions_only_cp_worker, 2, method)
    batch = make_batch(packed=True)
    for family in POSITIONS_ONLY:
        ref = parity.eager_step(parity.build(positions_only_setup(family, []), "eager"), batch)
        for rank, ranked in enumerate(results):
            assert_matches(ranked[family], ref, f"rank {rank} {family}-{method}")


# ModernBERT-decoder's causal LM applies a prediction head (dense, activation, norm: its `lm_head`) to the last hidden
# states before its output projection (`decoder`): longfit's loss runs it too (`structure.prediction_head`).
PREDICTION_HEAD = dict(model_type="modernbert-decoder", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)


@pytest.mark.parametrize("dtype", [torch.float32, parity.BF16], ids=["fp32", "bf16"])
def test_a_prediction_head_before_the_output_projection_is_trained(dtype: torch.dtype) -> None:
    case = Setup(dict(PREDICTION_HEAD), [], CHECKPOINTED, True, dtype, "ring", seed=0)
    batch = make_batch(packed=True)
    truth = parity.eager_step(parity.build(case, "eager"), batch)
    if dtype == torch.float32:
        got = parity.longfit_step(case, batch, techniques=True)
        assert got.grads["lm_head.dense.weight"] is not None
        assert_matches(got, truth, "modernbert-decoder")
        return
    references = [parity.eager_step(parity._as_reference(case, attn), batch, autocast=parity.BF16)
                  for attn in parity.bf16_references(case)]
    got = parity.longfit_step(case, batch, techniques=True, autocast=True)
    comparison = parity.compare_bf16("modernbert-decoder", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_without_the_prediction_head_its_weights_get_no_gradient(monkeypatch) -> None:
    import longfit.memory.loss as loss

    monkeypatch.setattr(loss, "prediction_head", lambda model: None)
    case = Setup(dict(PREDICTION_HEAD), [], [], False, torch.float32, "ring", seed=0)
    got = parity.longfit_step(case, make_batch(packed=False), techniques=False)
    assert got.grads["lm_head.dense.weight"] is None
