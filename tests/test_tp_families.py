"""Tensor parallelism (parallel.tp) of every family whose structure it can split, read from the model (#54).

`longfit.parallel.tp.tensor_parallel_refusal` admits a model by its structure: attention with q/k/v/o projections
(norms over one head's width allowed), a gate/up/down MLP, norms of the residual stream. Proven here on the families
that admitted beyond the Llama-style ones, each a tiny model transformers builds from its default config shrunk
(tests/test_bf16.py's seeded weights, rounded to bf16 values): Qwen3 (q_norm / k_norm over each head, split with its
heads), Gemma 3 (the same norms on one key/value head that both tp ranks compute, four norms per layer, a sliding
window, scaled and tied embeddings, a final logit softcap), Gemma 4's dense language model (its global layers' own
head size and key/value heads), Qwen3.5's Gated DeltaNet, Qwen3-Next's (its projections fused key head by key head),
and mixtures of experts (`TensorParallelExperts`: Qwen3.5-MoE's, with a gated shared expert, Qwen3-MoE's, Mixtral's,
Qwen2-MoE's, GLM-4-MoE's, GraniteMoE's and HunYuan-MoE's; more in tests/test_tp_moe.py). One step on two gloo ranks
with `parallelize` as the trainer runs it: the loss and every gradient (gathered whole) equal one process (fp32), and
within the bf16 bound of transformers' own bf16 runs (eager and SDPA, parity.compare_bf16 under FSDP_CEILING) under
train.dtype=bf16. Parts tensor parallelism cannot split are refused in one line naming the part and the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_bf16 import bf16_valued_model  # noqa: E402
from test_families import SMALL  # noqa: E402
from test_parallel_model import L, make_batch  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import ConfigError, load_config  # noqa: E402
from longfit.data.packing import PackedBatch  # noqa: E402
from longfit.models.attention import register_attention  # noqa: E402
from longfit.models.linear_attention import prepare_linear_attention  # noqa: E402

FAMILIES = {
    "qwen3": dict(SMALL, model_type="qwen3"),
    # One key/value head (Gemma 3 1B's shape): both tp ranks compute it, its k_norm's gradient summed over them.
    "gemma3": dict(SMALL, model_type="gemma3_text", num_key_value_heads=1, sliding_window=13,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                   final_logit_softcapping=3.0),
    # Gemma 4's dense language model without per-layer inputs or shared keys (refused: REFUSED): its global layers'
    # own head size and one key/value head (replicated over tp), v_norm without a weight
    "gemma4": dict(SMALL, model_type="gemma4_text", sliding_window=13, global_head_dim=32, num_global_key_value_heads=1,
                   layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                   num_kv_shared_layers=0),
    # Gemma 4's per-layer inputs (E2B's and E4B's: an embedding of the ids per layer and a projection of the
    # embeddings, each layer's gate and projection) and its last two layers reusing the keys and values of the layers
    # before them (one key/value head: each tp rank stores and reads its own copy)
    "gemma4_ple": dict(SMALL, model_type="gemma4_text", num_hidden_layers=4, sliding_window=13, global_head_dim=32,
                       num_global_key_value_heads=1, num_key_value_heads=1,
                       layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
                       vocab_size_per_layer_input=SMALL["vocab_size"], num_kv_shared_layers=2),
    # Gemma 4's mixture-of-experts layers (26B-A4B's): routed experts and their router as the layer's own parts beside
    # its dense MLP, the router's scale vectors, the experts' path normed on the tokens flattened
    "gemma4_moe": dict(SMALL, model_type="gemma4_text", sliding_window=13, global_head_dim=32,
                       num_global_key_value_heads=1, layer_types=["sliding_attention", "full_attention"],
                       hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=True, num_experts=4,
                       top_k_experts=2, moe_intermediate_size=32),
    # Qwen3.5's hybrid: a Gated DeltaNet (two key heads, each serving two value heads: one group per tp rank) and a
    # full-attention layer with its output gate
    "qwen3_5": dict(SMALL, model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    # Qwen3-Next's: its Gated DeltaNet's q/k/v/z and b/a projections fused key head by key head (split as they are),
    # beside routed experts and a gated shared expert
    "qwen3_next": dict(SMALL, model_type="qwen3_next", layer_types=["linear_attention", "full_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    # Mixtures of experts (parallel.tp's `TensorParallelExperts`): Qwen3.5-MoE's hybrid with routed experts and a
    # shared expert behind its sigmoid gate on every layer, Qwen3-MoE's and Mixtral's routed experts alone
    "qwen3_5_moe": dict(SMALL, model_type="qwen3_5_moe_text", layer_types=["linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
    "qwen3_moe": dict(SMALL, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # the same rule admits: Qwen2-MoE's gated shared expert, GLM-4-MoE's sigmoid router with its score correction and
    # scaling factor beside a shared expert, GraniteMoE's router and multipliers
    "qwen2_moe": dict(SMALL, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "glm4_moe": dict(SMALL, model_type="glm4_moe", n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                     first_k_dense_replace=0, moe_intermediate_size=32, routed_scaling_factor=2.5),
    "granitemoe": dict(SMALL, model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2,
                       embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                       logits_scaling=8.0),
    # Llama 4's text model: experts transposed, (E, H, 2I) and (E, I, H), the router's sigmoid scores scaling the
    # tokens entering them, a shared expert, its block returning its tokens flattened beside the router logits; layer 0
    # chunked at 12 tokens and MoE, layer 1 NoPE and dense
    "llama4_moe": dict(SMALL, model_type="llama4_text", num_local_experts=4, num_experts_per_tok=1,
                       intermediate_size=64, intermediate_size_mlp=128, moe_layers=[0], attention_chunk_size=12,
                       no_rope_layer_interval=2),
    # HunYuan-MoE's: a float32 softmax router (`gate.wg`), an ungated shared MLP (`shared_mlp`) of the dense width
    # beside the routed experts, and q/k norms over each head applied after the rotary embedding
    "hunyuan_v1_moe": dict(SMALL, model_type="hunyuan_v1_moe", num_experts=4, moe_topk=2),
}
ADAPTED = {"gemma4_ple": ["q_proj", "per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"]}
"""Families also proven with LoRA adapters on these modules: Gemma 4's per-layer input gates and projections are
linear maps each rank runs on its tokens, their adapters replicated with them."""
DOCS = [[17, 47], [40, 24]]  # every document longer than Gemma 3's window
# the batches of a family's cases: packed rows of two documents, and one document per row (the Gated DeltaNet's
# state and convolution run across the whole row)
ONE_DOCUMENT_TOO = ("qwen3_5", "qwen3_next", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "granitemoe",
                    "hunyuan_v1_moe", "llama4_moe", "gemma4_moe", "gemma4_ple")
BATCHES = {family: (True, False) for family in ONE_DOCUMENT_TOO}


def batch_of(packed: bool):
    batch = make_batch(2, DOCS if packed else None, seed=10)
    return batch if packed else PackedBatch(batch.input_ids, batch.labels, batch.position_ids, None,
                                            batch.num_label_tokens)


def family_model(family: str, attn_implementation: str, lora: bool = False):
    """The family's tiny model, with `lora` its random adapters on ADAPTED's modules; with longfit's attention, its
    linear-attention layers routed to longfit's kernels (as loading does)."""
    model = bf16_valued_model(FAMILIES[family], attn_implementation, ADAPTED[family] if lora else None)
    if attn_implementation == register_attention():
        prepare_linear_attention(model)
    return model


def tp_rank_steps(rank: int, world_size: int, cases: list[tuple[str, str, bool]], method: str = "ring",
                  lora: bool = False) -> dict:
    """This rank's step of every (family, train.dtype, packed) case under parallel.tp=2 (x cp=2 `method` on four
    ranks), with `lora` the family's adapters (ADAPTED) trained alone: the mean loss, every gradient whole."""
    from torch.distributed.tensor import DTensor

    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.attention import layer_configs, layer_head_shape
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    results = {}
    for family, dtype, packed in cases:
        adapters = [f"lora.target_modules=[{','.join(ADAPTED[family])}]", "lora.enabled=true", "lora.r=4",
                    "lora.alpha=8"] if lora else []
        cfg = load_config(None, [f"seq_len={L}", "parallel.tp=2", f"parallel.cp={world_size // 2}",
                                 f"parallel.cp_method={method}", f"train.dtype={dtype}", "memory.loss_chunk=24",
                                 "memory.activation_checkpointing=false", "memory.tiled_mlp=false", *adapters])
        model = family_model(family, register_attention(), lora)
        text = model.config
        kv_heads = tuple(layer_head_shape(layer)[1] for layer in layer_configs(text))  # per layer: Gemma 4's differ
        dims = ParallelDims.from_config(cfg, world_size, text.num_attention_heads, num_key_value_heads=kv_heads,
                                        intermediate_size=getattr(text, "intermediate_size", None), text_config=text,
                                        linear_value_heads=getattr(text, "linear_num_value_heads", None))
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
        shard = shard_batch(batch_of(packed), mesh.cp_rank, dims.cp, cp_layout(method))
        count = global_valid_tokens(shard.labels, mesh.world_group)
        local_sum = batch_loss_sum(loss_module, shard)
        (local_sum / count).backward()
        loss = all_reduce_sum(local_sum.detach().float().clone(), mesh.world_group) / count
        params = dict(loss_module.model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        results[family, dtype, packed] = parity.Step(loss, parity._grads(loss_module.model))
    return results


def one_process_step(family: str, packed: bool, lora: bool = False) -> parity.Step:
    """longfit's step on one process (no parallelism): the reference of the fp32 tp step."""
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum

    model = family_model(family, register_attention(), lora)
    batch = batch_of(packed)
    loss = batch_loss_sum(CausalLMLoss(model), batch) / batch.num_label_tokens
    loss.backward()
    return parity.Step(loss.detach(), parity._grads(model))


def transformers_steps(family: str, packed: bool, lora: bool = False) -> tuple[parity.Step, list[parity.Step]]:
    """transformers' own eager step in fp32 (the truth) and its eager and SDPA steps with bf16 weights (the
    references of a bf16 step under FSDP2, as `longfit check` takes them)."""
    batch = batch_of(packed)
    targets = ADAPTED[family] if lora else None
    truth = parity.eager_step(bf16_valued_model(FAMILIES[family], "eager", targets), batch)
    references = [parity.eager_step(parity._in_bf16(bf16_valued_model(FAMILIES[family], attention, targets)), batch)
                  for attention in ("eager", "sdpa")]
    return truth, references


def assert_ranks_equal_one_process(results: list[dict], parallel: str = "tp=2", lora: bool = False
                                   ) -> dict[str, float]:
    """Every rank's every case against its reference (`lora`: the steps trained the adapters alone); returns the
    largest absolute errors by case."""
    worst = {}
    for family, dtype, packed in results[0]:
        if dtype == "fp32":
            want = one_process_step(family, packed, lora)
        else:
            truth, references = transformers_steps(family, packed, lora)
        rows = "packed" if packed else "one document per row"
        for rank, result in enumerate(results):
            got, name = result[family, dtype, packed], f"{family} ({rows}), {parallel}, rank {rank}, {dtype}"
            if dtype == "fp32":
                torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
                assert got.grads.keys() == want.grads.keys(), name
                for param, ref in want.grads.items():
                    torch.testing.assert_close(got.grads[param], ref, rtol=1e-4, atol=1e-6, msg=f"{name}: {param}")
                worst[f"{family} {rows} {dtype}"] = max(float((got.loss - want.loss).abs()), *(
                    float((got.grads[n] - g).abs().max()) for n, g in want.grads.items()))
            else:
                comparison = parity.compare_bf16(name, got, references, truth, parity.FSDP_CEILING)
                assert comparison.ok, comparison.line()
                worst[f"{family} {rows} {dtype}"] = comparison.grad_error
    return worst


# slow: one spawn of two gloo ranks, two steps, and three reference steps a family: 23-25 s CPU a family (78-90 s
# wall at load 8-12)
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_under_tp2_equals_one_process(family: str) -> None:
    from parallel_harness import run_distributed

    cases = [(family, dtype, packed) for packed in BATCHES.get(family, (True,)) for dtype in ("fp32", "bf16")]
    results = run_distributed(tp_rank_steps, 2, cases)
    print(assert_ranks_equal_one_process(results))


@pytest.mark.slow  # one spawn of two gloo ranks, four steps, and six reference steps: ~30 s CPU
@pytest.mark.timeout(600)
def test_lora_adapters_on_gemma4s_per_layer_maps_under_tp2_equal_one_process() -> None:
    """LoRA on Gemma 4's per-layer input gates and projections (a user's lora.target_modules) under tp=2: the maps
    and their adapters replicated, each rank running its tokens (parallel.tp `_token_map`); they were left unplanned
    and the step refused."""
    from parallel_harness import run_distributed

    cases = [("gemma4_ple", dtype, packed) for packed in (True, False) for dtype in ("fp32", "bf16")]
    results = run_distributed(tp_rank_steps, 2, cases, "ring", True)
    assert all(any("per_layer_input_gate.lora_A" in name for name in result[case].grads)
               for result in results for case in cases)
    print(assert_ranks_equal_one_process(results, lora=True))


TP_CP_GROUPS = {
    # the Gated DeltaNet's heads of a tp rank split again over cp (parallel/linear.py: one key head, two value heads
    # per tp rank, so the key heads are repeated to the value heads'), its convolution's halo between the cp ranks of
    # the tp rank's channels
    "qwen3_5": ("qwen3_5",),
    # Qwen3-Next's projections split by key head over tp, then its local heads over cp, with its experts
    "qwen3_next": ("qwen3_next",),
    # Gemma 4's per-layer inputs looked up for each tp rank's tokens of its cp shard, and its layers reusing the keys
    # and values of earlier ones
    "gemma4_ple": ("gemma4_ple",),
    # the experts split over tp (Qwen3-MoE's plain ones, Llama 4's transposed ones beside its chunked attention,
    # Gemma 4's called by its layers) while cp splits the tokens: each tp pair routes its cp rank's tokens
    "experts": ("qwen3_moe", "llama4_moe", "gemma4_moe"),
}
"""Families proven together at tp=2 x cp=2, each on packed rows in fp32 and bf16."""


# slow: one spawn of four gloo ranks, two steps a family, and three reference steps: ~50 s CPU a family and method
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("group", list(TP_CP_GROUPS))
def test_families_under_tp2_and_cp2_equal_one_process(group: str, method: str) -> None:
    from parallel_harness import run_distributed

    cases = [(family, dtype, True) for family in TP_CP_GROUPS[group] for dtype in ("fp32", "bf16")]
    print(assert_ranks_equal_one_process(run_distributed(tp_rank_steps, 4, cases, method), f"tp=2 x cp=2 {method}"))


REFUSED = {
    "olmo2": (dict(SMALL, model_type="olmo2"), "layer 0's self_attn.q_norm normalizes across the heads"),
    "olmo": (dict(SMALL, model_type="olmo", clip_qkv=8.0), "layer 0's self_attn clips q, k and v in place"),
    "qwen3_moe": (dict(SMALL, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=33),
                  "layer 0's mlp.experts' intermediate size 33 is split over tensor parallelism's 2 ranks: use "
                  "parallel.tp in [3, 11, 33], or"),
    "qwen3_moe_router_loss": (dict(SMALL, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32,
                                   output_router_logits=True),
                              "layer 0's mlp: the routers' load-balancing loss (output_router_logits)"),
    "mixtral_jitter": (dict(SMALL, model_type="mixtral", num_local_experts=4, router_jitter_noise=0.1),
                       "layer 0's mlp: the router draws noise (router_jitter_noise=0.1)"),
    "qwen3_5_text": (dict(SMALL, model_type="qwen3_5_text", linear_num_key_heads=3, linear_num_value_heads=6,
                          linear_key_head_dim=8, linear_value_head_dim=8),
                     "layer 0's linear_attn has 3 key heads, which tensor parallelism splits with their value heads "
                     "over its 2 ranks: use parallel.tp in [3], or"),
    "qwen3_5_moe_text": (dict(SMALL, model_type="qwen3_5_moe_text", linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=15),
                         "layer 0's mlp.shared_expert's intermediate size 15 is split over tensor parallelism's 2 "
                         "ranks: use parallel.tp in [3, 5, 15], or"),
    "gpt_oss": (dict(SMALL, model_type="gpt_oss", num_local_experts=2), "layer 0's self_attn.sinks"),
}


@pytest.mark.parametrize("family", list(REFUSED))
def test_parts_tp_cannot_split_are_refused_in_one_line(family: str) -> None:
    """ParallelDims refuses, before anything is built, the first part of the model's structure tp cannot split."""
    from transformers import AutoConfig

    from longfit.parallel.dims import ParallelDims

    values, part = REFUSED[family]
    values = dict(values)
    text = AutoConfig.for_model(values.pop("model_type"), **values)
    cfg = load_config(None, [f"seq_len={L}", "parallel.tp=2"])
    with pytest.raises(ConfigError) as refused:
        ParallelDims.from_config(cfg, 2, 4, num_key_value_heads=2, intermediate_size=128, text_config=text)
    line = str(refused.value)
    assert line.startswith(f"parallel.tp=2: {part}") and "\n" not in line, line
    assert line.endswith("set parallel.tp=1 (parallel.cp and parallel.dp_shard split it instead)"), line


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_proven_families_are_admitted(family: str) -> None:
    from transformers import AutoConfig

    from longfit.parallel.tp import tensor_parallel_refusal

    values = dict(FAMILIES[family])
    assert tensor_parallel_refusal(AutoConfig.for_model(values.pop("model_type"), **values), 2) is None


def test_lora_targets_under_tp_are_split_projections_or_replicated_maps() -> None:
    """LoRA under tp goes on the projections tp splits, or on the linear maps it replicates (read from the model:
    Gemma 4's per-layer inputs' gates and projections); any other target is refused in one line naming both."""
    from transformers import AutoConfig

    from longfit.parallel.dims import ParallelDims

    values = dict(FAMILIES["gemma4_ple"])
    text = AutoConfig.for_model(values.pop("model_type"), **values)

    def checked(targets: str) -> None:
        cfg = load_config(None, ["parallel.tp=2", "lora.enabled=true", f"lora.target_modules={targets}"])
        ParallelDims.from_config(cfg, 2, text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                                 intermediate_size=text.intermediate_size, text_config=text)

    checked("[q_proj,v_proj,per_layer_input_gate,per_layer_projection,per_layer_model_projection]")
    with pytest.raises(ConfigError, match=r"lora.target_modules \['embed_tokens'\]: under parallel.tp=2 .* or the "
                       r"linear maps it replicates, \['per_layer_input_gate', 'per_layer_model_projection', "
                       r"'per_layer_projection'\]$"):
        checked("[q_proj,embed_tokens]")


def assert_trains_under_tp2_like_one_process(family: str, corpus, tmp_path) -> None:
    """`longfit train --nproc 2 parallel.tp=2` on the family's tiny model, written by transformers: the losses of one
    process, and an export whose every weight is the one-process run's."""
    from test_train_tp import common_args, exported, longfit_train, rows, single_process_losses

    from longfit.data.tokenizer import byte_tokenizer

    model_dir = tmp_path / f"{family}-tiny"
    family_model(family, "eager").save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    reference = single_process_losses(common_args(model_dir, corpus, tmp_path / "single"))
    out = tmp_path / "tp2"
    longfit_train(2, common_args(model_dir, corpus, out, "parallel.tp=2"))
    losses = [row["loss"] for row in rows(out)]
    assert losses == pytest.approx(reference, rel=1e-5)
    single, split = exported(tmp_path / "single"), exported(out)
    assert single.keys() == split.keys()
    # Adam's first steps at lr 1e-2 move a weight whose gradient is near 0 by its rounding (measured: 7.6e-5 at
    # most); a weight out of its layout would be off by the weights' scale (std 0.1)
    for name, weight in single.items():
        torch.testing.assert_close(split[name], weight, rtol=0, atol=1e-3, msg=name)


# slow: one process and two gloo ranks, three steps each (~40 s CPU)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_longfit_train_on_qwen3_5_under_tp2_logs_the_one_process_losses(corpus, tmp_path) -> None:
    """A Gated DeltaNet's fused q/k/v projection and convolution, replicated over tp, and A_log / dt_bias, sharded by
    value head, return to the export in their own layout."""
    assert_trains_under_tp2_like_one_process("qwen3_5", corpus, tmp_path)
