"""Sparse indexed attention (#57): DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) against transformers'
eager model, their copies shrunk from transformers' default configs (longfit.check.shrink: 12 keys kept per query
of rows of 64 tokens, 4 index heads).

- The selection: longfit's blockwise top-k (blocks of 5 queries x 7 keys, so the running top-k crosses many
  blocks) picks per query the keys transformers' indexer picks, on its own inputs (forward hooks), one document
  per row and packed (each document against transformers' indexer of the document alone); the rows hold queries
  whose k-th and (k+1)-th scores tie (asserted), which torch.topk breaks by its own partial sort.
- The attention over the selection against a dense masked softmax in float64, forward and every input gradient,
  over several query blocks.
- The model: `longfit check` in the GPU regime (DeepSeek-V3.2's under `slow`) (fp32 one document per row and packed, checkpointing, offload,
  chunked loss, then bf16 autocast), its blocks shrunk so that the running top-k and the attention cross blocks:
  exact, the indexer without gradient on both sides.
- Expert parallelism under context parallelism (slow): ep=2 x cp=2 on 4 gloo ranks (dp_shard=2 derived: each dp
  rank a row), from a checkpoint transformers wrote, against transformers' eager model on each document alone; fp32
  and the bf16 bound of FSDP2, DeepSeek-V3.2 on the ring and GLM-5 on Ulysses.
- Tiled layers are refused in one line; the sparse types longfit does not compute too (tests/test_check.py).
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch

import longfit.models.sparse_attention as sparse
from longfit.check.parity import DOCS, ROW, Step, check_run
from longfit.check.shrink import causal_lm, every_expert, shrink_config
from longfit.config import ConfigError, load_config
from longfit.models.attention import register_attention

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ("deepseek_v32", "glm_moe_dsa")


@functools.cache
def shrunk_config(model_type: str):
    from transformers import AutoConfig

    return shrink_config(AutoConfig.for_model(model_type), ROW).config


def eager_copy(model_type: str, seed: int = 0) -> torch.nn.Module:
    model = causal_lm(copy.deepcopy(shrunk_config(model_type)), attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def indexer_calls(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> list[tuple]:
    """(inputs of longfit's selection, transformers' top-k) of every indexer call of the eager model on `tokens`."""
    calls = []

    def record(indexer, args, kwargs, output):
        hidden, q_latent, (cos, sin), mask = args[:4]
        rotate = getattr(sys.modules[type(indexer).__module__], sparse.INDEXED_ATTENTION[indexer.config.model_type])
        q, k, weights = sparse._indexer_inputs(indexer, hidden, q_latent, cos, sin, rotate)
        picked = output.long().masked_fill(~mask.gather(-1, output.long()).bool() if mask.dtype == torch.bool
                                           else mask.gather(-1, output.long()) < 0, -1)  # masked picks: none
        calls.append((q, k, weights, indexer.softmax_scale, indexer.index_topk, picked))

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in model.modules() if type(m).__name__.endswith(
        "Indexer")]
    with torch.no_grad():
        model(input_ids=tokens, position_ids=position_ids)
    for handle in handles:
        handle.remove()
    return calls


def ties(q, k, weights, scale, topk) -> int:
    """Queries of one row whose k-th and (k+1)-th largest scores (over their earlier keys) are equal."""
    L = q.shape[0]
    scores = sparse.index_scores(q, k, weights, scale).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1),
                                                                   float("-inf"))
    top = scores.topk(topk + 1, dim=1).values
    return int(((top[:, topk - 1] == top[:, topk]) & (top[:, topk] > float("-inf"))).sum())


def same_sets(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(got.long().sort(-1).values, expected.long().sort(-1).values)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_blockwise_selection_is_transformers_selection(model_type: str) -> None:
    model = eager_copy(model_type)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, ROW), generator=generator)
    tied = 0
    for q, k, weights, scale, topk, expected in indexer_calls(model, tokens):
        rows = (((0, ROW),),) * 2
        got = sparse.select_keys(q, k, weights, scale, topk, rows, query_block=5, key_block=7)
        assert same_sets(got, expected)
        tied += sum(ties(q[b], k[b], weights[b], scale, topk) for b in range(2))
    assert tied > 0  # the rows exercise the tie rule

    documents = [(0, 10), (10, 47), (47, ROW)]  # packed: each document against transformers' on it alone
    alone = [indexer_calls(model, tokens[:1, start:end]) for start, end in documents]
    # Layer 0's indexer inputs on the packed row (positions restarting) are each document's alone, token by token
    positions = torch.cat([torch.arange(end - start) for start, end in documents])[None]
    packed = indexer_calls(model, tokens[:1], positions)
    for layer, (q, k, weights, scale, topk, _) in enumerate(packed[:1]):
        got = sparse.select_keys(q, k, weights, scale, topk, (tuple(documents),), query_block=5, key_block=7)
        for (start, end), calls in zip(documents, alone):
            expected = calls[layer][-1][0]  # (end - start, min(topk, end - start))
            mine = got[0, start:end, : expected.shape[1]]
            assert same_sets(mine - start * (mine >= 0), expected) and (got[0, start:end, expected.shape[1]:] < 0).all()


def test_latent_attention_is_the_masked_softmax_forward_and_backward(monkeypatch) -> None:
    """Queries of several blocks; slots of no key (-1); the gradient of every input in float64."""
    monkeypatch.setattr(sparse, "ATTENTION_ELEMENTS", 200)  # blocks of 16 queries
    generator = torch.Generator().manual_seed(0)
    B, L, H, R, dv, topk = 2, 40, 3, 10, 6, 5
    q = torch.randn(B, L, H, R, dtype=torch.float64, generator=generator, requires_grad=True)
    kv = torch.randn(B, L, R, dtype=torch.float64, generator=generator, requires_grad=True)
    rows = []
    for _ in range(B):
        row = torch.full((L, topk), -1, dtype=torch.long)
        for i in range(L):
            keys = torch.randperm(i + 1, generator=generator)[:topk]
            row[i, : len(keys)] = keys
        rows.append(row)
    selected = torch.stack(rows)
    out = sparse.LatentSparseAttention.apply(q, kv, selected, 0.3, dv)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad)

    mask = torch.zeros(B, L, L + 1, dtype=torch.bool)  # a last column for the empty slots
    mask = mask.scatter_(2, selected.masked_fill(selected < 0, L), True)[..., :L]
    scores = torch.einsum("blhr,bmr->bhlm", q, kv) * 0.3
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    expected = torch.einsum("bhlm,bmv->blhv", probs, kv[..., :dv])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip((dq, dkv), torch.autograd.grad(expected, (q, kv), grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("model_type", "values"), [pytest.param("deepseek_v32", {}, marks=pytest.mark.slow),
                                                     ("glm_moe_dsa", {"index_topk_freq": 2})])
def test_check_says_exact_in_fp32_and_bf16(tmp_path, monkeypatch, model_type: str, values: dict) -> None:
    """GLM-5 in the default suite, every other layer "shared" (index_topk_freq=2: it reuses the selection of the full
    layer before it; the copy keeps both kinds); DeepSeek-V3.2 differs in its indexer's rotary layout alone, which
    the selection case covers by default."""
    from transformers import AutoConfig

    monkeypatch.setattr(sparse, "SCORE_ELEMENTS", 64)  # 16 queries (the least) x 16 keys a block
    monkeypatch.setattr(sparse, "MIN_KEY_BLOCK", 16)
    monkeypatch.setattr(sparse, "ATTENTION_ELEMENTS", 12 * 48 * 16)  # 16 queries a block
    AutoConfig.for_model(model_type, **values).save_pretrained(tmp_path / model_type)
    report = check_run(load_config(None, [f"model={tmp_path / model_type}"]), "cuda")
    assert not values or "shared" in report.shrunk.config.indexer_types
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons] == [
        "one process, fp32, one document per row", "one process, fp32, packed", "one process, fp32, techniques, packed",
        "one process, bf16 autocast, techniques, packed"]
    assert report.techniques[0] == "train.dtype=bf16" and "activation checkpointing" in report.techniques
    assert all(c.grad_error < 1e-7 for c in report.comparisons[:3])


def test_indexer_weights_get_no_gradient_and_the_selection_none_from_the_loss() -> None:
    """transformers' indexer runs under no_grad: its weights get no gradient, on longfit's side as on eager's."""
    model = eager_copy("deepseek_v32")
    mine = causal_lm(copy.deepcopy(model.config), attn_implementation=register_attention(), dtype=torch.float32)
    mine.load_state_dict(model.state_dict())
    assert sparse.prepare_sparse_attention(mine) == 2
    tokens = torch.randint(0, model.config.vocab_size, (1, ROW), generator=torch.Generator().manual_seed(2))
    for net in (model, mine):
        net(input_ids=tokens, labels=tokens).loss.backward()
        grads = {name for name, p in net.named_parameters() if p.grad is not None}
        assert not any(".indexer." in name for name in grads)
        assert "model.layers.0.self_attn.kv_b_proj.weight" in grads


def test_tiled_layers_are_refused_in_one_line() -> None:
    model = eager_copy("deepseek_v32")
    sparse.prepare_sparse_attention(model)
    model.model.layers[0].self_attn.longfit_context_parallel = object()  # a tile run's attention: no gather_tokens
    with pytest.raises(ConfigError, match="sparse indexed attention cannot run on tiled layers"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "method", "device"), [("deepseek_v32", "ring", "cpu"),
                                                               ("glm_moe_dsa", "ulysses", "cuda")])
def test_check_says_exact_under_context_parallelism(tmp_path, model_type: str, method: str, device: str) -> None:
    """cp=2 on spawned gloo ranks: the latent and index keys all-gathered (parallel/gathered_keys.py), the queries
    of the ring's zigzag and Ulysses' contiguous shards; fp32 (the CPU regime) and bf16 under FSDP2 (the GPU's)."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
    report = check_run(load_config(None, [f"model={tmp_path / model_type}", "parallel.cp=2",
                                          f"parallel.cp_method={method}"]), device)
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons][-2:] == [f"rank {r} of 2, {method}, techniques, packed" for r in (0, 1)]


@pytest.mark.slow
def test_the_plan_traces_the_sparse_layers_within_3_percent_of_the_traced_step(tmp_path) -> None:
    """`longfit plan` traces the layers longfit runs (the indexer's blocks, the selection, the gathered latents: the
    prepared forward), not transformers' (which a trace cannot run without its mask: planned as a Llama's before).
    A small DeepSeek-V3.2 (4 heads, index_topk 512) on 2 GPUs at 4,096 tokens in bf16: measured +0.8%."""
    from transformers import AutoConfig

    from longfit.plan.analytic import plan_config
    from longfit.plan.trace import trace_step

    AutoConfig.for_model(
        "deepseek_v32", hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, index_topk=512, index_n_heads=8, index_head_dim=32, vocab_size=512,
    ).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model={tmp_path}", "seq_len=4096", "train.dtype=bf16"])
    analytic, traced = plan_config(cfg, 2).tensor_bytes, trace_step(cfg, 2).peak_bytes
    assert abs(analytic / traced - 1) <= 0.03, f"analytic {analytic} vs traced {traced}"


@pytest.mark.slow
def test_lora_on_the_latent_projections_is_exact(tmp_path) -> None:
    """LoRA on kv_b_proj (read as kv_b_proj(I) for the absorbed weights), q_b_proj and kv_a_proj_with_mqa: every
    adapter's gradient is transformers' (14 s)."""
    from transformers import AutoConfig

    AutoConfig.for_model("glm_moe_dsa").save_pretrained(tmp_path / "glm")
    report = check_run(load_config(None, [f"model={tmp_path / 'glm'}", "lora.enabled=true",
                                          "lora.target_modules=[kv_b_proj,q_b_proj,kv_a_proj_with_mqa]"]), "cpu")
    assert report.exact, report.refusal


def write_checkpoint(directory: Path, config) -> str:
    """transformers' own checkpoint of `config` with the check's weights (seeded, std 0.1, bf16 values, so that
    every regime holds the same ones) and a byte tokenizer."""
    from longfit.data.tokenizer import byte_tokenizer

    model = causal_lm(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_((torch.randn(param.shape, generator=generator) * 0.1).to(torch.bfloat16).float())
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return str(directory)


def packed_rows(vocab: int, rows: slice = slice(None)):
    """The check's packed rows (DOCS), or some of them (a dp rank's share)."""
    from longfit.data.packing import PackedBatch

    input_ids = torch.randint(0, vocab, (len(DOCS), ROW), generator=torch.Generator().manual_seed(1))
    return PackedBatch.of_documents(input_ids[rows], DOCS[rows])


def parallel_worker(rank: int, world: int, cases: list[tuple[str, list[str]]]) -> list[Step]:
    """Each case (checkpoint, overrides) trained one step as the trainer does: the meta model, `parallelize` (under
    ep the experts split, then FSDP2 over the ranks holding the same ones; weights read from the checkpoint), this
    dp rank's rows sharded over its cp ranks, the global mean loss."""
    from longfit.check.parity import _grads
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.build import build_model
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.expert import expert_count
    from longfit.parallel.parallelize import parallelize

    steps = []
    for directory, overrides in cases:
        cfg = load_config(None, [f"model={directory}", f"seq_len={ROW}", "train.device=cpu", *overrides])
        model = build_model(cfg, torch.float32, "cpu", fsdp=True)
        dims = ParallelDims.from_config(cfg, world, model.config.num_attention_heads,
                                        num_experts=expert_count(model) if cfg.parallel.ep > 1 else None)
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, device="cpu",
                                  param_dtype=torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32)
        if dims.ep > 1:
            assert (dims.dp_shard, dims.expert_fsdp_size) == (2, 2)
            assert model.get_submodule("model.layers.1.mlp.experts").num_experts == 2  # 2 of the 4 on each ep rank
        rows = packed_rows(model.config.vocab_size, slice(mesh.dp_rank, mesh.dp_rank + 1) if dims.dp_shard > 1
                           else slice(None))
        shard = shard_batch(rows, mesh.cp_rank, dims.cp, cp_layout(dims.cp_method))
        tokens = global_valid_tokens(shard.labels, mesh.world_group)
        local = batch_loss_sum(loss_module, shard)
        (local / tokens).backward()
        loss = all_reduce_sum(local.detach().float().clone(), mesh.world_group) / tokens
        steps.append(Step(loss, _grads(loss_module.model)))
    return steps


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallelism_under_context_parallelism_is_exact(tmp_path) -> None:
    """ep=2 x cp=2 on 4 gloo ranks (dp_shard=2: the experts split over 2 ranks, FSDP2 shards them over the 2 others
    holding the same ones): loss and every gradient of transformers' eager model on each document alone, within
    longfit check's bounds: fp32, and under bf16 (FSDP2's bf16 parameters; every expert chosen, as the check
    compares bf16 routing) within 3x transformers' own bf16 error. DeepSeek-V3.2 on the ring, GLM-5 on Ulysses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.check.parity import FSDP_CEILING, _in_bf16, compare_bf16, compare_fp32, eager_step
    from parallel_harness import run_distributed

    def eager(directory: str, attn: str = "eager") -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, dtype=torch.float32)

    cases = []
    for model_type, method in (("deepseek_v32", "ring"), ("glm_moe_dsa", "ulysses")):
        values = every_expert(copy.deepcopy(shrunk_config(model_type)))
        routed = write_checkpoint(tmp_path / model_type, shrunk_config(model_type))
        every = write_checkpoint(tmp_path / f"{model_type}-every-expert",
                                 AutoConfig.for_model(values.pop("model_type"), **values))
        parallel = ["parallel.cp=2", f"parallel.cp_method={method}", "parallel.ep=2"]
        cases += [(routed, [*parallel, "train.dtype=fp32"]), (every, [*parallel, "train.dtype=bf16"])]
    results = run_distributed(parallel_worker, 4, cases)
    for case, (directory, overrides) in enumerate(cases):
        batch = packed_rows(shrunk_config(Path(directory).name.split("-")[0]).vocab_size)
        truth = eager_step(eager(directory), batch)
        references = ([eager_step(_in_bf16(eager(directory, attn)), batch) for attn in ("eager", "sdpa")]
                      if "train.dtype=bf16" in overrides else None)
        for rank, steps in enumerate(results):
            name = f"rank {rank} of 4, {Path(directory).name}, {' '.join(overrides)}"
            assert {n for n, g in steps[case].grads.items() if g is not None} == {
                n for n, g in truth.grads.items() if g is not None}, name  # the indexers' none on both sides
            comparison = (compare_bf16(name, steps[case], references, truth, FSDP_CEILING) if references
                          else compare_fp32(name, steps[case], truth))
            assert comparison.ok, comparison.line()

