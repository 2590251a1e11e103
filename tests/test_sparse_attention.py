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
- The indexer's loss (train.indexer_loss): against a dense implementation of DeepSeek-V3.2's formula on transformers'
  eager model (longfit.check.parity.indexer_loss_step), fp32 (one document per row, packed, under checkpointing with
  offload) and bf16 autocast; cp=2 ring fp32 and FSDP2 bf16 (slow); `longfit check` proves the step with it and
  finds a term 1% off (slow); refused in one line where it cannot apply.
- The plan (slow): the published configs (tests/data/checkpoint_configs) at 128K on 64 H100s, their layers traced;
  a shrunken copy of each within 3% of its traced step with and without the indexer's loss; tiled layers off in the
  plan as in the run. Pipeline stages are refused in one line naming the part. The trace's shortcuts (default): the
  attention in three query blocks, the capture running the first layer of each kind, meta tensors, each to the byte
  of the trace without them; the selection a checkpointed GLM-5 layer hands on, 4 index_topk bytes a token.
- `longfit train` from DeepSeek-V3.2's checkpoint as transformers wrote it, with and without the indexer's loss: a
  few steps and an export transformers loads (slow).
- Tiled layers are refused in one line; the sparse types longfit does not compute too (tests/test_check.py).
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import pytest
import torch

import longfit.models.sparse_attention as sparse
from longfit.check.parity import DOCS, ROW, Step, check_run, indexer_loss_step
from longfit.check.shrink import causal_lm, every_expert, shrink_config
from longfit.config import ConfigError, load_config
from longfit.models.attention import register_attention

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ("deepseek_v32", "glm_moe_dsa")


@functools.cache
def shrunk_config(model_type: str):
    from transformers import AutoConfig

    return shrink_config(AutoConfig.for_model(model_type), ROW).config


def small_config(model_type: str):
    """A small config of the family at widths a plan traces in seconds (4 heads, index_topk 512)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, index_topk=512, index_n_heads=8, index_head_dim=32, vocab_size=512,
    )


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
    out, _ = sparse.LatentSparseAttention.apply(q, kv, selected, 0.3, dv)
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


@pytest.mark.parametrize("model_type", FAMILIES)
def test_pipeline_stages_are_refused_in_one_line_naming_the_part(tmp_path, model_type: str) -> None:
    """parallel.pp > 1 is refused as the run and the plan resolve it, before anything is built."""
    from longfit.plan.setup import resolve

    small_config(model_type).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=rf"parallel.pp=2: {model_type}'s sparse indexed attention is not cut into "
                                          "pipeline stages: a stage passes on the hidden states alone") as refused:
        resolve(load_config(None, [f"model={tmp_path}", "parallel.pp=2"]), 2)
    assert "\n" not in str(refused.value)


def test_the_plan_leaves_tiled_layers_off_as_the_trainer_does(tmp_path) -> None:
    """memory.tiled_layers=auto at 65,536 tokens a GPU (where it turns on) stays off for indexed attention in the plan
    too (the run's rule, models/linear_attention.untileable_layers); true is refused saying why."""
    from longfit.plan.setup import resolve

    small_config("deepseek_v32").save_pretrained(tmp_path)
    assert not resolve(load_config(None, [f"model={tmp_path}", "seq_len=65536"]), 1).tiled_layers
    with pytest.raises(ConfigError, match="deepseek_v32's sparse indexed attention selects each query's keys"):
        resolve(load_config(None, [f"model={tmp_path}", "seq_len=65536", "memory.tiled_layers=true"]), 1)


@pytest.mark.parametrize("layout", [(), ("parallel.cp=2", "parallel.cp_method=ring")])
def test_a_sparse_layer_traced_in_three_query_blocks_holds_what_all_its_blocks_hold(tmp_path, monkeypatch,
                                                                                    layout: tuple) -> None:
    """On a memory trace the attention over the selection runs its first two query blocks and its last
    (sparse._query_blocks): GLM-5's traced layer costs, on meta tensors (without falling back to fake ones: no tie
    redo, no autocast there) and on fake ones under cp=2, are those of all 32 blocks of 32 queries run, to the byte."""
    from longfit.models import kernels
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    small_config("glm_moe_dsa").save_pretrained(tmp_path)
    monkeypatch.setattr(sparse, "ATTENTION_ELEMENTS", 32 * 512 * 80)  # 32 queries x 512 keys x 80 latent widths
    cp = 2 if layout else 1
    s = resolve(load_config(None, [f"model={tmp_path}", f"seq_len={1024 * cp}", "train.dtype=bf16", *layout]), 2)
    key = layer_trace._key(s, True)
    assert key.samples == ((1024, 0),) and layer_trace._on_meta(key) == (not layout)
    blocks = {"three": [], "all": []}
    attend, trace, tensors = sparse._attend, layer_trace._trace, []
    monkeypatch.setattr(layer_trace, "_trace", lambda key, cfg=None, on_meta=None: tensors.append(on_meta) or
                        trace(key, cfg, on_meta))
    ran = blocks["three"]
    monkeypatch.setattr(sparse, "_attend", lambda *args: ran.append(1) or attend(*args))
    three = layer_trace._trace(key, s.config)
    assert tensors == [None]  # no second trace on fake tensors after one on meta tensors failed
    monkeypatch.setattr(kernels, "_traced_slices", lambda slices, q: slices)
    ran = blocks["all"]
    assert layer_trace._trace(key, s.config).costs == three.costs
    assert len(blocks["all"]) >= 8 * len(blocks["three"]) > 0


def test_the_capture_runs_the_first_layer_of_each_kind_alone(tmp_path, monkeypatch) -> None:
    """GLM-5's layers pass their selection on, so the layer trace's capture runs layers rather than skip them: with
    three dense layers before the first MoE one (as published) it runs the first dense layer only, the later ones
    handing on what it handed on, and the traced costs are those of a capture that runs all three, to the byte."""
    from transformers import AutoConfig

    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    values = {**small_config("glm_moe_dsa").to_dict(), "num_hidden_layers": 4, "first_k_dense_replace": 3,
              "mlp_layer_types": ["dense"] * 3 + ["sparse"], "indexer_types": ["full"] * 4,
              "layer_types": ["indexed_attention"] * 4}
    AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path)
    s = resolve(load_config(None, [f"model={tmp_path}", "seq_len=1024", "train.dtype=bf16"]), 2)
    key = layer_trace._key(s, True)
    selections, select = [], sparse.select_keys
    monkeypatch.setattr(sparse, "select_keys", lambda *args, **kwargs: selections.append(1) or select(*args, **kwargs))
    shortcut = layer_trace._trace(key, s.config)
    # the capture's selection, then each traced layer's forward and recompute
    assert shortcut.kind_of == [0, 0, 0, 3] and len(selections) == 1 + 2 * 2
    captured = layer_trace._captured_calls
    monkeypatch.setattr(layer_trace, "_captured_calls", lambda *args, **kwargs: captured(
        *args[:5], list(range(len(args[5]))), **kwargs))  # every layer a kind of its own
    assert layer_trace._trace(key, s.config).costs == shortcut.costs
    assert len(selections) == 5 + 3 + 2 * 2


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_plan_holds_the_key_selection_a_checkpointed_layer_passes_on(tmp_path, model_type: str) -> None:
    """A checkpointed GLM-5 layer hands its (B, L, index_topk) int32 selection to the next layer, whose checkpoint
    holds it to its backward: the traced `passed` bytes, which the plan holds from the layer's forward to the next
    one's backward, are 4 index_topk a token (the config's width). DeepSeek-V3.2's layers pass nothing on."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.layer_trace import layer_costs

    config = small_config(model_type)
    config.save_pretrained(tmp_path)
    plan = plan_config(load_config(None, [f"model={tmp_path}", "seq_len=2048"]), 1)
    traced = layer_costs(plan.setup)
    assert plan.setup.checkpointed == config.num_hidden_layers
    expected = 4 * config.index_topk if model_type == "glm_moe_dsa" else 0
    assert {kind: costs.at(2048)["passed"] for kind, costs in traced.costs.items()} == dict.fromkeys(traced.costs,
                                                                                                    expected)


PUBLISHED = {"deepseek_v32": "deepseek-ai--DeepSeek-V3.2", "glm_moe_dsa": "zai-org--GLM-5"}
"""The published config.json of each family (tests/data/checkpoint_configs, README.md there: the sources)."""
CHECKPOINT_CONFIGS = Path(__file__).parent / "data" / "checkpoint_configs"
SHRUNK_WIDTHS = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                     first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                     num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=96,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_topk=512, index_n_heads=8,
                     index_head_dim=32, vocab_size=512)
"""The published config's widths shrunk (its rotary scaling, norms, routing and indexer rotation kept)."""


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_the_published_config_plans_128k_on_64_h100s(model_type: str) -> None:
    """`longfit plan` of the published config at 131,072 tokens on 64 H100s answers, its sparse layers traced (not
    planned as a Llama's) and its layers untiled (the run's rule): full fine-tuning does not fit, the model states
    alone (16 bytes a parameter, 671B and 744B over 64 ranks) above the GPU."""
    from longfit.plan.accuracy import H100_HOST
    from longfit.plan.analytic import plan_config
    from longfit.plan.layer_trace import layer_costs

    cfg = load_config(None, [f"model={CHECKPOINT_CONFIGS / PUBLISHED[model_type]}", "seq_len=131072"])
    result = plan_config(cfg, 64, H100_HOST[0], host_memory_bytes=H100_HOST[1])
    states = sum(result.breakdown[k] for k in ("weights", "gradients", "optimizer state"))
    assert not result.fits and states > H100_HOST[0], result.breakdown
    assert not result.setup.tiled_layers
    assert layer_costs(result.setup).untraced is None


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("model_type", "layout"), [
    ("deepseek_v32", ()), ("glm_moe_dsa", ("parallel.cp=2", "parallel.cp_method=ring"))])
def test_a_shrunken_published_config_plans_within_3_percent_of_its_traced_step(tmp_path, model_type: str,
                                                                               layout: tuple) -> None:
    """The analytic plan of a shrunken copy of the published config (SHRUNK_WIDTHS) on 2 GPUs at 4,096 tokens in bf16,
    with and without train.indexer_loss, within plan/accuracy.py's band (-1%..+3%) of the traced step: DeepSeek-V3.2
    over dp_shard=2, GLM-5 under cp=2 (the index keys gathered over the whole rows)."""
    from transformers import AutoConfig

    from longfit.plan.accuracy import SAFE_BAND, compare

    values = {**json.loads((CHECKPOINT_CONFIGS / PUBLISHED[model_type] / "config.json").read_text()), **SHRUNK_WIDTHS,
              "pad_token_id": None}  # GLM-5's is beyond the shrunk vocabulary
    AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path)
    for weight in (0.0, INDEXER_WEIGHT):
        row = compare(str(tmp_path), 2, ("seq_len=4096", "train.dtype=bf16", f"train.indexer_loss={weight}", *layout))
        assert SAFE_BAND[0] <= row["error"] <= SAFE_BAND[1], (weight, row)


@pytest.mark.slow
def test_lora_on_the_latent_projections_is_exact(tmp_path) -> None:
    """LoRA on kv_b_proj (read as kv_b_proj(I) for the absorbed weights), q_b_proj and kv_a_proj_with_mqa: every
    adapter's gradient is transformers' (14 s)."""
    from transformers import AutoConfig

    AutoConfig.for_model("glm_moe_dsa").save_pretrained(tmp_path / "glm")
    report = check_run(load_config(None, [f"model={tmp_path / 'glm'}", "lora.enabled=true",
                                          "lora.target_modules=[kv_b_proj,q_b_proj,kv_a_proj_with_mqa]"]), "cpu")
    assert report.exact, report.refusal


def checks_weights(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with the check's weights: seeded, std 0.1, bf16 values (so that every regime holds the same ones)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_((torch.randn(param.shape, generator=generator) * 0.1).to(torch.bfloat16).float())
    return model


def write_checkpoint(directory: Path, config) -> str:
    """transformers' own checkpoint of `config` with the check's weights and a byte tokenizer."""
    from longfit.data.tokenizer import byte_tokenizer

    model = checks_weights(causal_lm(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32))
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


# -- the indexer's loss (train.indexer_loss) ----------------------------------------------------------------------

INDEXER_WEIGHT = 0.3


def longfit_indexer_step(model: torch.nn.Module, batch, weight: float, autocast: bool = False,
                         techniques: bool = False) -> Step:
    """The trainer's objective with train.indexer_loss=`weight` (the chunked loss); `techniques`: activation
    checkpointing (each layer's forward, the indexer's loss with it, run again in the backward), its inputs offloaded,
    the tiled MLP, applied to `model` in place."""
    from longfit.check.parity import _grads
    from longfit.memory.apply import apply_memory_techniques, offloaders, release_offload_stores
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum

    loss_module = CausalLMLoss(model, chunked_loss=True, loss_chunk=24, indexer_loss=weight)
    if techniques:
        cfg = load_config(None, [f"seq_len={ROW}", "memory.activation_checkpointing=true", "memory.tiled_layers=false",
                                 "memory.offload_activations=true", "memory.tiled_mlp=true", "memory.mlp_tiles=3"])
        apply_memory_techniques(model, cfg, "cpu")
        for offloader in offloaders(model):
            offloader.min_offload_bytes = 1024  # the copy's layer inputs are below the 1 MiB default
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    loss.backward()
    assert not techniques or sum(o.stats.offloaded_bytes for o in offloaders(model)) > 0
    release_offload_stores(model)
    return Step(loss.detach().float(), _grads(model))


def indexer_models(model_type: str, config=None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' eager model of the shrunk copy (the check's weights) and longfit's, the same weights."""
    config = copy.deepcopy(config or shrunk_config(model_type))
    eager = checks_weights(causal_lm(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32))
    mine = causal_lm(config, attn_implementation=register_attention(), dtype=torch.float32)
    mine.load_state_dict(eager.state_dict())
    sparse.prepare_sparse_attention(mine)
    return eager, mine


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in float64 (its experts through transformers' eager loop: torch's grouped matmul takes no float64)."""
    model = copy.deepcopy(model).double()
    model.set_experts_implementation("eager")
    return model


def assert_exact(got: Step, truth: Step, name: str, exact: Step | None = None) -> None:
    """longfit check's fp32 bound; with `exact` (the reference in float64), every indexer gradient within 3x the fp32
    reference's own error against it: those gradients are sums of the terms of softmax(I) - p, which sum to 0 over
    each query's keys (measured: the fp32 reference 2e-5 to 2e-4 of the tensor's largest entry from float64, longfit
    0.2-0.6x of 3x that), and of 1e-8 in these copies, below the fp32 bound's 1e-8 floor."""
    from longfit.check.parity import compare_fp32, rounding_excess

    assert {n for n, g in got.grads.items() if g is not None} == {n for n, g in truth.grads.items() if g is not None}
    comparison = compare_fp32(name, got, truth)
    assert comparison.ok, comparison.line()
    for n, g in (exact.grads.items() if exact is not None else ()):
        if ".indexer." in n:
            assert rounding_excess(got.grads[n], [truth.grads[n]], g) <= 1.0, f"{name}: {n}"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_indexer_loss_is_the_reports_formula(model_type: str) -> None:
    """train.indexer_loss: the loss and every gradient (the indexers' weights', and the rest's, which the loss leaves
    alone) equal the dense reference's, fp32, one document per row and packed, and packed under activation
    checkpointing with offload and the tiled MLP. GLM-5 with every other layer "shared" (index_topk_freq=2: 4
    layers, each kind beside a dense and an MoE MLP): a shared layer reuses the selection of the one before and adds
    no term, on both sides."""
    from transformers import AutoConfig

    from longfit.check.parity import batches

    config = None
    if model_type == "glm_moe_dsa":
        config = shrink_config(AutoConfig.for_model(model_type, index_topk_freq=2), ROW).config
        assert config.indexer_types == ["full", "shared", "full", "shared"]
    eager, mine = indexer_models(model_type, config)
    wide = float64_copy(eager)
    for name, batch in batches(eager.config.vocab_size, 0).items():
        truth, exact = (indexer_loss_step(model, batch, INDEXER_WEIGHT) for model in (eager, wide))
        got = longfit_indexer_step(mine, batch, INDEXER_WEIGHT)
        assert any(".indexer." in n and g is not None and g.abs().max() > 0 for n, g in got.grads.items())
        assert_exact(got, truth, f"{model_type} {name}", exact)
        if name == "packed":
            _, plain = indexer_models(model_type, config)
            assert_exact(longfit_indexer_step(plain, batch, INDEXER_WEIGHT, techniques=True), truth,
                         f"{model_type} {name}, techniques", exact)
        for model in (eager, wide, mine):
            model.zero_grad(set_to_none=True)


def every_expert_config(model_type: str):
    """The shrunk copy with every expert chosen for every token, as the check compares bf16 (routing cannot flip)."""
    from transformers import AutoConfig

    values = every_expert(copy.deepcopy(shrunk_config(model_type)))
    return AutoConfig.for_model(values.pop("model_type"), **values)


def test_indexer_loss_under_bf16_autocast_within_the_bound() -> None:
    """train.dtype=bf16 on one process (autocast), GLM-5 packed: loss and every gradient within 3x the dense
    reference's own bf16 error against its fp32 run, with transformers' eager and SDPA attention (longfit check's
    bound; every expert chosen). The indexers' gradients are bf16 noise in the references (relative errors 1.1 to 5.8
    measured: their index scores are bf16 matmuls under autocast, and the gradients sums of softmax(I) - p that
    cancel), so the bound holds them as noise (3x the references' absolute error); longfit's are 0.02 to 0.16 (its
    loss in fp32). Their exactness is the fp32 cases'."""
    from longfit.check.parity import AUTOCAST_CEILING, batches, compare_bf16

    eager, mine = indexer_models("glm_moe_dsa", every_expert_config("glm_moe_dsa"))
    batch = batches(eager.config.vocab_size, 0)["packed"]
    truth = indexer_loss_step(eager, batch, INDEXER_WEIGHT)
    references = []
    for attn in ("eager", "sdpa"):  # as the check: the error of both of transformers' implementations
        eager.zero_grad(set_to_none=True)
        eager.set_attn_implementation(attn)
        references.append(indexer_loss_step(eager, batch, INDEXER_WEIGHT, autocast=True))
    got = longfit_indexer_step(mine, batch, INDEXER_WEIGHT, autocast=True)
    comparison = compare_bf16("glm_moe_dsa bf16 autocast", got, references, truth, AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()
    assert all(got.grads[n] is not None for n in truth.grads if ".indexer." in n)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_indexer_loss_under_context_parallelism(tmp_path) -> None:
    """train.indexer_loss=0.3 with cp=2 on 2 gloo ranks (DeepSeek-V3.2, the ring: each rank's queries over the
    gathered index keys, whose gradient sums back over the ranks): the dense reference's loss and every gradient,
    fp32 (the indexers' against its float64 run too, as on one process) and under FSDP2's bf16 (every expert
    chosen) within 3x the reference's own bf16 error."""
    from transformers import AutoModelForCausalLM

    from longfit.check.parity import FSDP_CEILING, _in_bf16, compare_bf16
    from parallel_harness import run_distributed

    routed = write_checkpoint(tmp_path / "routed", shrunk_config("deepseek_v32"))
    every = write_checkpoint(tmp_path / "every-expert", every_expert_config("deepseek_v32"))
    parallel = ["parallel.cp=2", "parallel.cp_method=ring", f"train.indexer_loss={INDEXER_WEIGHT}",
                "memory.chunked_loss=true", "memory.loss_chunk=24"]
    results = run_distributed(parallel_worker, 2, [(routed, [*parallel, "train.dtype=fp32"]),
                                                   (every, [*parallel, "train.dtype=bf16"])])

    def eager(directory: str) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)

    batch = packed_rows(shrunk_config("deepseek_v32").vocab_size)
    truth = indexer_loss_step(eager(routed), batch, INDEXER_WEIGHT)
    exact = indexer_loss_step(float64_copy(eager(routed)), batch, INDEXER_WEIGHT)
    every_truth = indexer_loss_step(eager(every), batch, INDEXER_WEIGHT)
    reference = indexer_loss_step(_in_bf16(eager(every)), batch, INDEXER_WEIGHT)
    for rank, (fp32, bf16) in enumerate(results):
        assert_exact(fp32, truth, f"rank {rank} of 2, fp32", exact)
        comparison = compare_bf16(f"rank {rank} of 2, bf16", bf16, [reference], every_truth, FSDP_CEILING)
        assert comparison.ok, comparison.line()


@pytest.mark.slow  # 35-40 s each on the shared 2-core machine (load 13-15)
@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "a term 1% off"])
def test_check_proves_the_step_with_the_indexer_loss(tmp_path, monkeypatch, wrong: bool) -> None:
    """`longfit check` under train.indexer_loss: each of its steps' objective adds the indexers' KL loss and is compared
    with the dense formula on transformers' model (`indexer_loss_step`), fp32 and bf16; GLM-5 with every other layer
    "shared" (no term of its own). Each layer's term 1% off is found in the first step."""
    from transformers import AutoConfig

    monkeypatch.setattr(sparse, "SCORE_ELEMENTS", 64)  # 16 queries x 16 keys a block, as the check above
    monkeypatch.setattr(sparse, "MIN_KEY_BLOCK", 16)
    monkeypatch.setattr(sparse, "ATTENTION_ELEMENTS", 12 * 48 * 16)
    if wrong:
        term = sparse.IndexerKL.apply
        monkeypatch.setattr(sparse.IndexerKL, "apply", lambda *args: term(*args) * 1.01)
    AutoConfig.for_model("glm_moe_dsa", index_topk_freq=2).save_pretrained(tmp_path)
    report = check_run(load_config(None, [f"model={tmp_path}", f"train.indexer_loss={INDEXER_WEIGHT}"]), "cuda")
    if wrong:
        assert not report.exact and [c.ok for c in report.comparisons] == [False], report.lines()
        return
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons] == [
        "one process, fp32, one document per row", "one process, fp32, packed", "one process, fp32, techniques, packed",
        "one process, bf16 autocast, techniques, packed"]


def test_the_check_verdict_of_a_run_with_the_indexer_loss_is_its_own(tmp_path) -> None:
    """The trainer's cached verdict (check/gate.py) is keyed by train.indexer_loss: a run with the loss does not read
    the verdict of one without it, whose check added none."""
    from longfit.check.gate import verdict_key

    small_config("glm_moe_dsa").save_pretrained(tmp_path)
    keys = {verdict_key(load_config(None, [f"model={tmp_path}", f"train.indexer_loss={weight}"]), "cuda")
            for weight in (0.0, INDEXER_WEIGHT)}
    assert len(keys) == 2


def test_indexer_loss_is_refused_where_it_cannot_apply() -> None:
    """One line naming the fix: a negative weight, the stages and splits it is not added across, a model without an
    indexer."""
    from transformers import AutoConfig

    from longfit.memory.loss import CausalLMLoss

    for overrides, message in ((["train.indexer_loss=-1"], "must be >= 0"),
                               (["train.indexer_loss=0.1", "parallel.pp=2"], "set parallel.pp=1"),
                               (["train.indexer_loss=0.1", "train.objective=simpo"], "train.objective=causal_lm")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["seq_len=64", *overrides])
    with torch.device("meta"):
        llama = causal_lm(AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, vocab_size=64), attn_implementation="eager")
    with pytest.raises(ConfigError, match="this model has none: set train.indexer_loss=0"):
        CausalLMLoss(llama, indexer_loss=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("indexer_loss", [0.0, INDEXER_WEIGHT])
def test_longfit_train_from_a_transformers_checkpoint_exports(corpus, tmp_path, indexer_loss: float) -> None:
    """`longfit train model=DIR` on DeepSeek-V3.2's checkpoint as transformers wrote it (packed rows of the corpus,
    the default memory techniques of the CPU): a few steps of finite loss, then an export that
    transformers loads, with the logits of longfit's model of it. By default the indexers' weights come out exactly
    as they went in (no gradient, as transformers trains them); under train.indexer_loss every one of them trained."""
    import json
    import math

    from transformers import AutoModelForCausalLM

    from longfit.cli import main
    from longfit.models.loading import load_model

    checkpoint = write_checkpoint(tmp_path / "deepseek_v32", shrunk_config("deepseek_v32"))
    out = tmp_path / "run"
    assert main(["train", f"model={checkpoint}", f"data.path={corpus}", f"output_dir={out}", f"seq_len={ROW}",
                 "train.device=cpu", "train.steps=3", "train.micro_batch=2", "train.lr=1e-2", "train.warmup_steps=0",
                 f"train.indexer_loss={indexer_loss}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(math.isfinite(row["loss"]) for row in rows)
    exported = AutoModelForCausalLM.from_pretrained(out / "final", attn_implementation="eager", dtype=torch.float32)
    before = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    after = exported.state_dict()
    indexers = [name for name in before if ".indexer." in name]
    changed = [name for name in before if not torch.equal(after[name], before[name])]
    assert "model.layers.0.self_attn.kv_b_proj.weight" in changed  # it trained
    assert [name for name in indexers if name in changed] == (indexers if indexer_loss else [])
    ids = packed_rows(exported.config.vocab_size).input_ids
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(out / "final"))(input_ids=ids).logits,
                                   exported(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
