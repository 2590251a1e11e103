"""What makes `longfit plan` fast (#52) plans what the slow way planned: a warm plan reads the model's shape, its LoRA
counts and its layers' costs from the disk cache and imports neither torch nor transformers; a layer traced on the
model's first layers costs what it costs in the whole model; a softcapped block traced in three query slices holds
what it holds in all of them; the search for the longest seq_len, the longest range first, finds what searching
every range finds."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoConfig

from longfit.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Gemma 2 with its caps and a window shorter than the traced lengths (blockwise window tiles, capped slices)
GEMMA2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, sliding_window=67, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              query_pre_attn_scalar=16, vocab_size=384)
# Gemma 4 whose last two layers read the keys and values layers 2 and 3 wrote, with per-layer inputs: the layers
# before a traced one feed it
GEMMA4_SHARED_KV = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, num_kv_shared_layers=2, sliding_window=13,
                        layer_types=["sliding_attention", "full_attention"] * 3, vocab_size=384,
                        vocab_size_per_layer_input=384, hidden_size_per_layer_input=8)
QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=384)
# Qwen3-30B-A3B's layer widths in two layers, two experts a token: LoRA adapts its fused experts (peft's adapters of
# a parameter), whose gradients come out of the backward in another shape than the adapters' (at smaller widths
# they come out copied into the adapters' shape)
QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=2,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=2,
                 vocab_size=384)


def _save(path: Path, model_type: str, **values) -> Path:
    AutoConfig.for_model(model_type, **values).save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type, values, overrides", [
    ("gemma2", GEMMA2, ["train.dtype=bf16"]),
    pytest.param("gemma4_text", GEMMA4_SHARED_KV, ["lora.enabled=true"], marks=pytest.mark.slow),
])
def test_layers_traced_on_the_first_layers_cost_what_they_cost_in_the_whole_model(tmp_path, monkeypatch, model_type,
                                                                                    values, overrides) -> None:
    """`_first_layers` copies the layers up to the last traced one; the whole model's copy (the slow way) gives the
    same bytes to the byte, for Gemma 2's capped sliding layers and Gemma 4's key/value-sharing layers."""
    import copy

    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    # 512 tokens: one traced length (`samples_for`), several windows and capped slices
    cfg = load_config(None, [f"model={_save(tmp_path, model_type, **values)}", "seq_len=512", *overrides])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=False)
    fast = layer_trace._trace(key, cfg)
    monkeypatch.setattr(layer_trace, "_first_layers", lambda model, count: copy.deepcopy(model))
    monkeypatch.setattr(layer_trace, "_ADAPTED", {})  # not the first layers the fast trace copied
    assert layer_trace._trace(key, cfg) == fast
    assert max(fast.kind_of) > 0  # a later layer traced: the copy held more than the first


def test_the_first_layers_are_copied_and_adapted_once_for_every_trace_of_a_model(tmp_path, monkeypatch) -> None:
    """#52: a plan's search traces a model's layers at many lengths; its first layers are copied and given their
    adapters once (`_first_layers_adapted`), and each trace costs what it costs on a copy of its own."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    path = _save(tmp_path, "qwen3", **QWEN3)
    keys, cfgs = [], []
    for seq_len in (384, 512):  # each one traced length of its own (`samples_for`)
        cfgs.append(load_config(None, [f"model={path}", f"seq_len={seq_len}", "lora.enabled=true"]))
        keys.append(layer_trace._key(resolve(cfgs[-1], 1), checkpointed=False))
    assert keys[0] != keys[1]
    own = []
    for key, cfg in zip(keys, cfgs):
        monkeypatch.setattr(layer_trace, "_ADAPTED", {}, raising=False)
        own.append(layer_trace._trace(key, cfg))
    adapted, with_lora = [], layer_trace._with_lora
    monkeypatch.setattr(layer_trace, "_ADAPTED", {}, raising=False)
    monkeypatch.setattr(layer_trace, "_with_lora", lambda model, cfg: adapted.append(model) or with_lora(model, cfg))
    assert [layer_trace._trace(key, cfg) for key, cfg in zip(keys, cfgs)] == own
    assert len(adapted) == 1


# gpt-oss: experts (grouped matmul), attention sinks and a window
GPT_OSS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, sliding_window=13, num_local_experts=4, num_experts_per_tok=2, vocab_size=384)


@pytest.mark.parametrize("model_type, values, overrides, checkpointed, seq_len", [
    ("qwen3", QWEN3, ["train.dtype=fp32"], True, 512),
    ("qwen3", QWEN3, ["train.dtype=fp32", "memory.keep_attention=false"], True, 512),
    ("qwen3", QWEN3, ["train.dtype=bf16", "memory.keep_attention=false", "lora.enabled=true"], False, 512),
    pytest.param("qwen3_moe", QWEN3_MOE, ["train.dtype=bf16", "lora.enabled=true", "memory.tiled_layers=true"], True,
                 512, marks=pytest.mark.slow),  # 15 CPU s: 128 experts of Qwen3-30B-A3B's widths, traced twice
    pytest.param("qwen3", QWEN3, ["lora.enabled=true", "memory.tiled_layers=true"], True, 512, marks=pytest.mark.slow),
    pytest.param("gemma2", GEMMA2, ["lora.enabled=true"], False, 512, marks=pytest.mark.slow),
    pytest.param("gpt_oss", GPT_OSS, ["lora.enabled=true", "memory.tiled_mlp=true"], True, 512, marks=pytest.mark.slow),
    pytest.param("qwen3", QWEN3, ["lora.enabled=true", "memory.tiled_layers=true"], True, 2144, marks=pytest.mark.slow),
    pytest.param("gemma2", GEMMA2, ["lora.enabled=true", "memory.tiled_layers=true"], True, 512,
                 marks=pytest.mark.slow),
])
def test_a_layer_traced_on_meta_tensors_holds_what_it_holds_on_fake_ones(tmp_path, monkeypatch, model_type, values,
                                                                         overrides, checkpointed, seq_len) -> None:
    """The layer traces run on meta tensors (`layer_trace._on_meta`), without going back to fake tensors: the same
    bytes, to the byte, as on fake tensors, for a checkpointed layer in fp32 keeping its attention (the block
    kernels), and not keeping it, checkpointed in fp32 and plain under LoRA in bf16 (SDPA, whose composite would take
    its math kernel on the meta device: it runs the CPU's flash kernel, `attention.causal_attention`; before, such
    traces went back to fake tensors, 3 times slower: #52), Qwen3-MoE's tiled layers whose fused experts peft adapts
    (its `ParamWrapper` turns autocast off on the meta device, which torch refuses: they went back to fake tensors,
    #52), and (slow) Qwen3's tiled decoder layers, Gemma 2's capped sliding layers, plain and tiled (the capped
    kernel's backward inside a tile's backward turns autocast off: its float32 products were refused as autocast's
    and the trace went back to fake tensors, Gemma 2 9B's cold plan 65 CPU s, #52), and gpt-oss's experts, sinks
    and tiled MLP under LoRA in bf16; at 512 tokens one traced length in 4 tiles, at 2,144 the tiled samples that fit
    a plane (`TILE_SAMPLES`)."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    cfg = load_config(None, [f"model={_save(tmp_path, model_type, **values)}", f"seq_len={seq_len}",
                             "train.device=cuda", "memory.activation_checkpointing=true", "memory.layer_tiles=4",
                             "memory.mlp_tiles=4", *overrides])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=checkpointed)
    assert layer_trace._on_meta(key)
    trace = layer_trace._trace
    on_fake = trace(key, cfg, on_meta=False)
    monkeypatch.setattr(layer_trace, "_trace", lambda *args, **kwargs: pytest.fail("fell back to fake tensors"))
    assert trace(key, cfg, on_meta=True) == on_fake


# Qwen3.5's and Qwen3-Next's text layers, Gated DeltaNet first (their scans multiply in float32)
HYBRID = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, vocab_size=384)
HYBRID_MOE = dict(HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, decoder_sparse_step=1)


@pytest.mark.parametrize("model_type, values, checkpointed", [
    ("qwen3_5_text", HYBRID, False),
    pytest.param("qwen3_5_text", HYBRID, True, marks=pytest.mark.slow),
    pytest.param("qwen3_5_text", HYBRID, "tiled", marks=pytest.mark.slow),
    pytest.param("qwen3_next", HYBRID_MOE, False, marks=pytest.mark.slow),
])
def test_a_layer_multiplying_in_float32_is_traced_on_meta_tensors_as_under_autocast(tmp_path, monkeypatch, model_type,
                                                                                    values, checkpointed) -> None:
    """#52: a one-rank LoRA run in bf16 runs under autocast, which casts the float32 products of Gated DeltaNet's
    scan to bf16. Meta tensors have no autocast: the trace casts them itself (`_autocast_products_on_meta`) and stays
    on meta tensors (before, each such trace went back to fake tensors: Qwen3.5-27B's cold plan 91 CPU s, 6-9 times
    a meta trace's). Its costs are the fake trace's under torch's autocast within 1% a quantity or 32 bytes a token
    (measured: at most 8 bytes a token a layer more, 0.5%, on the safe side but one checkpointed backward peak 0.07%
    under; the fake trace also casts its backward's products, which the run's backward, outside autocast, does not)."""
    import torch

    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    cfg = load_config(None, [f"model={_save(tmp_path, model_type, **values)}", "seq_len=512", "train.device=cuda",
                             "lora.enabled=true", "memory.activation_checkpointing=true",
                             f"memory.tiled_layers={checkpointed == 'tiled'}", "memory.layer_tiles=4"])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=bool(checkpointed))
    assert key.lora_autocast and layer_trace._on_meta(key)
    trace = layer_trace._trace
    on_fake = trace(key, cfg, on_meta=False)
    monkeypatch.setattr(layer_trace, "_trace", lambda *args, **kwargs: pytest.fail("fell back to fake tensors"))
    on_meta = trace(key, cfg, on_meta=True)
    assert on_meta.kind_of == on_fake.kind_of and on_meta.tables == on_fake.tables
    for i, costs in on_fake.costs.items():
        for tokens in (512, 4096):
            want, got = costs.at(tokens), on_meta.costs[i].at(tokens)
            torch.testing.assert_close(got, want, rtol=0.01, atol=32.0, msg=lambda m: f"layer {i} at {tokens}: {m}")


@pytest.mark.parametrize("model_type, values, seq_len, most_tiles", [
    ("gemma2", GEMMA2, 512, 16),
    ("qwen3", QWEN3, 2144, 16),
    ("gemma2", GEMMA2, 2144, 16),
])
@pytest.mark.slow  # each runs its tiles twice: 30 s to two minutes on a shared 2-core machine
def test_a_tiled_layer_traced_in_four_tiles_holds_what_all_its_tiles_hold(tmp_path, monkeypatch, model_type, values,
                                                                           seq_len, most_tiles) -> None:
    """On tensors without values a tiled layer runs its first two tiles and its last two (memory/tiled_layers.py
    `_run_tiles`): the traced costs are those of the layer running all its tiles, to the byte, under LoRA in bf16:
    Gemma 2's capped global layer at 512 tokens in 16 tiles (a later tile's capped blocks of 64 keys score more than
    the second tile's of 32: running the first two tiles alone holds less); (slow) at 2,144 every tiled sample
    (`TILE_SAMPLES`: up to 16 tiles a row, the floor's in tiles of 134 tokens), of Qwen3 and Gemma 2."""
    from longfit.memory import tiled_layers
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    cfg = load_config(None, [f"model={_save(tmp_path, model_type, **values)}", f"seq_len={seq_len}",
                             "train.device=cuda", "lora.enabled=true", "memory.activation_checkpointing=true",
                             "memory.tiled_layers=true", f"memory.layer_tiles={most_tiles if seq_len < 1072 else 0}"])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=True)
    assert max(tiles for _, tiles in key.samples) == most_tiles
    four = layer_trace._trace(key, cfg)
    monkeypatch.setattr(tiled_layers, "_run_tiles", lambda count, hidden, one_pass: list(range(count)))
    assert layer_trace._trace(key, cfg) == four


@pytest.mark.parametrize("length, slices, traced, dtype, heads", [
    (1100, 19, 3, "float32", (4, 2, 16)), (1024, 16, 2, "float32", (4, 2, 16)), (1024, 16, 2, "bfloat16", (4, 2, 16)),
    (1100, 19, 3, "bfloat16", (16, 8, 256)),  # Gemma 2 9B's heads, key/value heads and head_dim
])
def test_a_capped_block_traced_in_three_slices_holds_what_all_its_slices_hold(length, slices, traced, dtype,
                                                                              heads) -> None:
    """Fake tensors run a capped block's first two query slices and its last, or its first two alone where the last
    is as long as the second (models/kernels.py `_query_slices`); real tensors run every slice. The live bytes of
    both, counted alike, peak and end the same, forward and backward, in a block of 19 slices (the last one short)
    and of 16 (all alike, two traced, #52; in fp32 and bf16), and at Gemma 2 9B's widths (the slow planner's
    comparison of its plan keeps the three slices: benchmarks/plan_speed.py `THREE_SLICES`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longfit.models.kernels import LOWER, _query_slices, attention_backward, attention_forward
    from longfit.plan.tracker import LiveBytes

    query_heads, kv_heads, head_dim = heads

    def live_bytes(fake: bool) -> tuple[int, int, int, int]:
        mode = FakeTensorMode() if fake else None
        with mode or contextlib.nullcontext():
            q, dout = (torch.randn(1, query_heads, length, head_dim, dtype=getattr(torch, dtype)) for _ in range(2))
            k, v = (torch.randn(1, kv_heads, length, head_dim, dtype=getattr(torch, dtype)) for _ in range(2))
            tracker = LiveBytes(mode)
            with tracker:
                out, lse = attention_forward(q, k, v, LOWER, 0.25, softcap=50.0)
                forward = tracker.peak, tracker.live
                tracker.peak = tracker.live
                grads = attention_backward(dout, q, k, v, out, lse, LOWER, 0.25, softcap=50.0)
                backward = tracker.peak, tracker.live
            del grads
            return (*forward, *backward)

    q, k = torch.empty(1, query_heads, length, head_dim), torch.empty(1, kv_heads, length, head_dim)
    assert len(_query_slices(q, k)) == slices  # 65,536 scores a head: 59 rows of 1,100 keys, 64 of 1,024
    assert len(_query_slices(q.to("meta"), k.to("meta"))) == traced
    assert live_bytes(fake=True) == live_bytes(fake=False)


def test_the_longest_seq_len_is_found_searching_the_longest_range_first(monkeypatch) -> None:
    """`max_seq_len` searches the range where tiled decoder layers turn on first, and ends there when its start fits:
    the answer every range's own search gives, the largest length that fits, here found against a peak that drops
    where each auto switch turns on."""
    from longfit.plan import search
    from longfit.plan.setup import OFFLOAD_AUTO_MIN_SEQ_LEN, TILED_LAYERS_AUTO_MIN_TOKENS, TILED_MLP_AUTO_MIN_SEQ_LEN

    class Planned:
        def __init__(self, fits: bool):
            self.fits = fits

    cfg = load_config(None, ["model=llama-tiny"])
    for limit in (6_144, 20_480, 40_960, 100_352, 3_000_320):
        def peak(n: int) -> float:  # each switch turning on halves the peak's slope
            drops = sum(n >= t for t in (TILED_MLP_AUTO_MIN_SEQ_LEN, OFFLOAD_AUTO_MIN_SEQ_LEN,
                                         TILED_LAYERS_AUTO_MIN_TOKENS))
            return n / 2 ** drops

        def plan(cfg, gpus, capacity, n, *args, limit=limit):
            return Planned(peak(n) <= peak(limit))

        monkeypatch.setattr(search, "_plan", plan)
        monkeypatch.setattr(search, "_states_overflow", lambda *args: False)  # the peaks above hold no model states
        found = search.max_seq_len(cfg, 1, 1)
        every = [n for n in range(2048, 8 * limit + 2048, 2048) if peak(n) <= peak(limit)]
        assert found == max(every), limit


# Qwen3.5's hybrid layers (Gated DeltaNet and full attention) at small widths
QWEN3_5 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=32, linear_value_head_dim=32)
UNTILED = ["memory.tiled_mlp=false", "memory.tiled_layers=false", "memory.offload_activations=false"]


def test_plans_whose_rows_differ_past_the_packed_sample_share_one_trace_of_their_linear_attention(tmp_path) -> None:
    """#52: the search for the longest seq_len planned Qwen3.5-27B's assumed rows, whose documents grow with seq_len,
    and traced its layers once a point (17 traces). A trace reads the documents of its packed sample's row alone
    (`_traced_documents`): rows alike in it share a trace, rows that differ in it do not."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    path = _save(tmp_path, "qwen3_5_text", **QWEN3_5)

    def key(seq_len: int):
        return layer_trace._key(resolve(load_config(None, [f"model={path}", f"seq_len={seq_len}", *UNTILED]), 1),
                                checkpointed=False)

    base = key(65_536).samples[0][0]  # 1,152 tokens: the packed sample's row
    # documents of 4,097 and 8,193 tokens (seq_len / 16, one past a chunk): one whole-chunk document in that row
    assert key(65_536) == key(131_072) and key(65_536).documents == ()
    # documents of 1,025 tokens: two in that row, the second padded; of 513: three
    assert key(16_384).documents == (1_025, base - 1_025) and key(8_192).documents == (513, 513, base - 1_026)
    assert key(16_384) != key(8_192)
    cut = key(16_384)
    chunk = 64
    assert layer_trace._traced_documents(cut, (100, 200, 5_000), chunk) == \
        layer_trace._traced_documents(cut, (100, 200, 6_000), chunk) == (100, 200, base - 300)
    # a row of whole chunks: nothing to trace packed
    assert layer_trace._traced_documents(cut, (base + 1, 7), chunk) == ()
    assert layer_trace._traced_documents(cut, (base - 64, 1), chunk) == (base - 64, 1, 63)
    # tiled samples: their row's documents too, each tile padding its pieces of them (plan/padding.py tile_padding)
    tiled = replace(cut, samples=((2 * base, 2),))
    assert layer_trace._traced_documents(tiled, (100, 200), chunk) == (100, 200) * 7 + (100, 2 * base - 2_200)


@pytest.mark.slow  # 30 s wall at load 6 on the shared 2-core machine: two traces of the hybrid layers
def test_a_linear_attention_trace_of_the_cut_documents_is_the_trace_of_the_whole_row(tmp_path) -> None:
    """The documents a trace keeps (`_traced_documents`) trace what the whole row's documents traced, to the byte,
    with the scans' padding counted."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    path = _save(tmp_path, "qwen3_5_text", **QWEN3_5)
    cfg = load_config(None, [f"model={path}", "seq_len=1024", *UNTILED])
    short = layer_trace._key(resolve(cfg, 1), checkpointed=False)  # one sample, its own 1,024 tokens
    whole = (100, 200, 5_000)
    traced = layer_trace._trace(replace(short, documents=layer_trace._traced_documents(short, whole, 64)))
    assert traced == layer_trace._trace(replace(short, documents=whole))
    assert all(traced.costs[i].per_padded_slot for i in layer_trace._traced_layers(traced.kind_of, False)[1]
               if layer_trace._scans(layer_trace._model(short.config_json)[1], i))


# Phi-4-mini's layer widths shrunk, its sliding window (262,144 tokens) longer than the plans below
PHI3_LONG_WINDOW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=384, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        sliding_window=262_144)


def test_plans_shorter_than_the_window_share_one_trace_of_the_windowless_lengths(tmp_path, monkeypatch) -> None:
    """#52: a window longer than the run cuts no sequence, so the trace key clamps it to the longest traced sequence
    and takes the lengths a windowless model is traced at: plans of 4K to 128K tokens share one trace (each was
    traced at its own length, the lengths six windows from 1.5M tokens on: Phi-4-mini's search traced 22 times), and
    the clamped model holds at those lengths what the model with its own window holds, to the byte."""
    from longfit.plan import layer_trace
    from longfit.plan.analytic import plan_config
    from longfit.plan.setup import resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(layer_trace, "_CACHE", {})
    path = _save(tmp_path / "phi3", "phi3", **PHI3_LONG_WINDOW)
    traced = []
    trace = layer_trace._trace
    monkeypatch.setattr(layer_trace, "_trace", lambda key, *args, **kwargs: traced.append(key) or
                        trace(key, *args, **kwargs))

    def items(seq_len: int) -> list[str]:
        return [f"model={path}", f"seq_len={seq_len}", "lora.enabled=true", "train.device=cuda", *UNTILED]

    def cfg(seq_len: int):
        return load_config(None, items(seq_len))

    for seq_len in (4096, 32_768, 131_072):
        plan_config(cfg(seq_len), 1)
    assert len(traced) == 1, [key.samples for key in traced]
    clamped = traced[0]
    assert clamped.samples == layer_trace.three_lengths(layer_trace.BASE_LENGTH, 0)
    assert clamped.window == 3 * layer_trace.BASE_LENGTH
    assert clamped.config_json == resolve(cfg(4096), 1).shape.config_json
    assert layer_trace._model(clamped.config_json, window=clamped.window)[1].sliding_window == clamped.window
    own = replace(clamped, window=None)
    assert layer_trace._model(own.config_json)[1].sliding_window == 262_144
    assert trace(own, cfg(4096)) == layer_trace._CACHE[clamped]
    # a run the window cuts keeps it, traced at its own lengths
    longer = layer_trace._key(resolve(cfg(524_288), 1), checkpointed=False)
    assert longer.window is None and longer.samples == ((524_288, 0),)
    # a warm plan finds the clamped key's costs without importing torch or transformers
    script = ("import json, sys; from longfit.cli import main; main(['plan', *sys.argv[1:], '--json']); "
              "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    env = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", script, *items(32_768)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "[]", run.stderr


def test_tiled_layers_off_the_plane_are_traced_at_their_tile_count_with_the_window_clamped_anew(tmp_path,
                                                                                               monkeypatch) -> None:
    """A tiled trace whose costs are not a plane is traced again at the plan's own tile count (`_part`): at the
    windowless lengths, the window clamped to the longest of those (not to the plane's samples', shorter than them)."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    monkeypatch.setattr(layer_trace, "_CACHE", {})
    monkeypatch.setattr(layer_trace, "_load", lambda key: None)
    monkeypatch.setattr(layer_trace, "_store", lambda key, traced: traced)
    keys = []
    monkeypatch.setattr(layer_trace, "_trace", lambda key, *args: keys.append(key) or layer_trace.Traced([0], {},
                                                                                                      planar=False))
    path = _save(tmp_path / "phi3", "phi3", **PHI3_LONG_WINDOW)
    s = resolve(load_config(None, [f"model={path}", "seq_len=131072", "memory.tiled_layers=true"]), 1)
    layer_trace.layer_costs(s)
    plane, own = keys[:2]
    tiles = own.samples[0][1]
    base = layer_trace.base_length(layer_trace._windowless(s.shape), tiles)
    assert [tokens for tokens, _ in own.samples] == [k * base for k in (1, 2, 3)]
    assert own.window == own.samples[-1][0] > plane.samples[-1][0]


def test_tiled_layers_off_the_plane_past_the_window_share_one_line_at_tiles_of_the_largest_length(tmp_path,
                                                                                                 monkeypatch) -> None:
    """#52: past the point where a tiled layer's tiles stop growing (memory/switches.py's MAX_LAYER_TILE_TOKENS), a
    trace off the plane is one line at tiles of that length for every plan (`_capped_tile_lengths`), not one trace
    per tile count: Phi-4-mini's search past its 262,144-token window traced its layers ten times. Where the plane's
    samples have longer tiles than the plan's (a long window's lengths), the plane is not traced at all. A plan whose
    tiles still grow keeps its own tile count."""
    from longfit.memory.switches import MAX_LAYER_TILE_TOKENS
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve
    from longfit.plan.tiled import layer_tiles

    monkeypatch.setattr(layer_trace, "_CACHE", {})
    monkeypatch.setattr(layer_trace, "_load", lambda key: None)
    monkeypatch.setattr(layer_trace, "_store", lambda key, traced: traced)
    keys = []
    monkeypatch.setattr(layer_trace, "_trace", lambda key, *args: keys.append(key) or layer_trace.Traced(
        [0], {}, planar=len(key.samples) != len(layer_trace.TILE_SAMPLES)))
    path = _save(tmp_path / "phi3", "phi3", **PHI3_LONG_WINDOW)

    def setup(seq_len: int):
        return resolve(load_config(None, [f"model={path}", f"seq_len={seq_len}", "memory.tiled_layers=true"]), 1)

    for seq_len in (2_160_640, 2_332_672, 4_257_792):  # 264, 285 and 520 tiles of 8,184 to 8,188 tokens
        layer_trace.layer_costs(setup(seq_len))
    assert len(keys) == 1, [key.samples for key in keys]
    lines = keys
    base = layer_trace.base_length(setup(2_160_640).shape)
    assert lines[0].samples == tuple((k * base, k * base // MAX_LAYER_TILE_TOKENS) for k in (1, 2, 3))
    assert lines[0].window is None
    keys.clear()
    layer_trace.layer_costs(setup(131_072))  # the window clamped: its own tile count
    assert [key.samples[0][1] for key in keys if len(key.samples) == 3] == [layer_tiles(setup(131_072))]


def test_a_search_stops_before_tracing_where_the_model_states_alone_overflow(tmp_path, monkeypatch) -> None:
    """#52: where the weights, gradients and optimizer state (and the CUDA context) exceed the GPU, nothing fits at any
    length (`states_floor`, under the plan's peak): the search says so from the setup, tracing nothing (Qwen3-Coder-
    Next's search on one H100 traced at four lengths first), memory.keep_attention=auto does not plan the run again
    without kept attention (DeepSeek-V3.2's plan traced its layers twice for it), and the fixes a plan suggests are
    planned only where they bring the states under the GPU."""
    from longfit.plan import layer_trace, search
    from longfit.plan.analytic import plan_config, states_floor
    from longfit.plan.setup import resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(layer_trace, "_CACHE", {})
    cfg = load_config(None, ["model=llama-tiny", "seq_len=2048", "lora.enabled=true"])
    floor = states_floor(resolve(cfg, 1))
    traced = []
    trace = layer_trace._trace
    monkeypatch.setattr(layer_trace, "_trace", lambda key, *args, **kwargs: traced.append(key) or
                        trace(key, *args, **kwargs))
    plan = plan_config(cfg, 1, floor - 1024)
    assert plan.peak_bytes > floor and not plan.fits and plan.setup.keep_attention
    assert traced and all(key.keep_attention for key in traced if key.checkpointed), traced
    # the fixes that leave the states over the GPU (a tiled MLP, tiled layers, the offload store) are not planned; those
    # that take the states off it (FSDP2's CPU offload) or shrink them (bf16 optimizer state) are
    planned = []
    monkeypatch.setattr(search, "plan_config", lambda trial, *args, **kwargs: planned.append(trial) or
                        plan_config(trial, *args, **kwargs))
    search.suggest_fix(plan)
    assert [(trial.parallel.cpu_offload, trial.memory.optimizer) for trial in planned] == \
        [(True, "adamw"), (False, "adamw_bf16")]
    monkeypatch.setattr(layer_trace, "_CACHE", {})
    monkeypatch.setattr(layer_trace, "_trace", lambda *args, **kwargs: pytest.fail("traced"))
    assert search.max_seq_len(cfg, 1, floor - 1024) is None
    assert not search._states_overflow(cfg, 1, floor, 2048)


def test_a_json_plan_writes_no_text(monkeypatch, capsys) -> None:
    """`longfit plan --json` prints the plan's numbers; the text, whose fix for a plan that does not fit plans other
    configs (`suggest_fix`), is not written."""
    from longfit.cli import main
    from longfit.plan import report

    monkeypatch.setattr(report, "plan_text", lambda *args, **kwargs: pytest.fail("the text was written"))
    assert main(["plan", "model=llama-tiny", "seq_len=2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"][0]["seq_len"] == 2048


def test_a_warm_plan_reads_every_count_from_the_cache_and_imports_neither_torch_nor_transformers(tmp_path,
                                                                                                  monkeypatch) -> None:
    """A plan of a model outside the preset families with LoRA (its parameters and adapters counted on the meta
    device, its layers traced), once in this process on a fresh cache; `longfit plan` again in a new process then
    plans the same bytes off the cache (model shape, LoRA counts, layer costs) without importing torch or
    transformers. A changed config.json is read anew."""
    from longfit.plan import layer_trace, shapes
    from longfit.plan.analytic import plan_config

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for module, name in ((shapes, "_SHAPES"), (layer_trace, "_CACHE"), (layer_trace, "_LORA_CACHE")):
        monkeypatch.setattr(module, name, {})
    model = _save(tmp_path / "qwen3", "qwen3", **QWEN3)
    items = [f"model={model}", "seq_len=512", "lora.enabled=true", "train.device=cuda"]  # one traced length
    planned = plan_config(load_config(None, items), 1)
    assert {p.parent.name for p in cache.rglob("*.json")} == {"model_shapes", "lora_counts", "layer_costs"}

    script = ("import json, sys; from longfit.cli import main; main(['plan', *sys.argv[1:], '--json']); print(json.dumps(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)))")
    env = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(cache)}
    run = subprocess.run([sys.executable, "-c", script, *items], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    *plan_json, imported = run.stdout.strip().splitlines()
    assert json.loads(imported) == []
    assert json.loads("\n".join(plan_json))["plans"][0]["tensor_bytes"] == planned.tensor_bytes

    changed = shapes.model_shape(str(_save(tmp_path / "qwen3", "qwen3", **{**QWEN3, "num_hidden_layers": 5})))
    assert changed.layers == 5


def test_a_cold_plan_builds_its_model_on_the_meta_device_once(tmp_path, monkeypatch) -> None:
    """#52: a cold plan of a model outside the preset families counts its parameters on the model transformers builds
    on the meta device, and traces its layers and counts its adapters off the same build (`shapes.meta_model`), not
    off one of their own; it plans what planning from two builds planned."""
    from transformers import AutoModelForCausalLM

    from longfit.plan import layer_trace, shapes
    from longfit.plan.analytic import plan_config

    def cold() -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache{len(planned)}"))
        for module, name in ((shapes, "_SHAPES"), (layer_trace, "_CACHE"), (layer_trace, "_LORA_CACHE"),
                             (layer_trace, "_BUILT"), (layer_trace, "_ADAPTED"), (shapes, "_META_MODELS")):
            monkeypatch.setattr(module, name, {}, raising=False)
        shapes.counted_parameters.cache_clear()

    builds, from_config = [], AutoModelForCausalLM.from_config
    monkeypatch.setattr(AutoModelForCausalLM, "from_config",
                        staticmethod(lambda *args, **kwargs: builds.append(args) or from_config(*args, **kwargs)))
    model = _save(tmp_path / "qwen3", "qwen3", **QWEN3)
    items = [f"model={model}", "seq_len=512", "lora.enabled=true", "train.device=cuda"]  # one traced length
    planned = []
    cold()
    planned.append(plan_config(load_config(None, items), 1))
    assert len(builds) == 1
    cold()
    monkeypatch.setattr(shapes, "meta_model", shapes.built_meta_model)  # every reader builds its own
    planned.append(plan_config(load_config(None, items), 1))
    assert len(builds) == 3
    assert planned[0].tensor_bytes == planned[1].tensor_bytes and planned[0].peak_bytes == planned[1].peak_bytes


def test_a_cold_lora_plan_adapts_its_traced_layers_without_importing_bitsandbytes(tmp_path) -> None:
    """#52: peft imports bitsandbytes wherever it is installed (1.3 s of a cold plan, which quantizes nothing): a cold
    `longfit plan` with LoRA traces its adapted layers with peft alone, and bitsandbytes is still found afterwards
    (QLoRA in the same process)."""
    pytest.importorskip("bitsandbytes")
    model = _save(tmp_path / "qwen3", "qwen3", **QWEN3)
    script = ("import importlib.util, json, sys; from longfit.cli import main; main(['plan', *sys.argv[1:], '--json']);"
              " print(json.dumps([m in sys.modules for m in ('peft', 'bitsandbytes')]));"
              " print(importlib.util.find_spec('bitsandbytes') is not None)")
    env = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    items = [f"model={model}", "seq_len=512", "lora.enabled=true", "train.device=cuda"]
    run = subprocess.run([sys.executable, "-c", script, *items], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    *_, imported, found = run.stdout.strip().splitlines()
    assert json.loads(imported) == [True, False] and found == "True"


@pytest.mark.parametrize("model_type, values, overrides, checkpointed, seq_len", [
    # 27 s, 6 s, 6 s and 271 s on the shared 2-core machine (load 10-20): two traces each
    pytest.param("qwen3", QWEN3, ["lora.enabled=true"], True, 2144, marks=pytest.mark.slow),
    ("qwen3_moe", QWEN3_MOE, ["lora.enabled=true", "train.dtype=bf16"], False, 4096),
    ("qwen3_moe", QWEN3_MOE, ["lora.enabled=true", "train.dtype=fp32"], False, 4096),
    pytest.param("gemma2", GEMMA2, ["lora.enabled=true", "memory.tiled_layers=true"], True, 2144,
                 marks=pytest.mark.slow),
])
def test_a_trace_split_across_two_processes_holds_what_one_process_traces(tmp_path, monkeypatch, model_type, values,
                                                                          overrides, checkpointed, seq_len) -> None:
    """`_on_two_cores` deals the samples to a forked copy of the process too: the costs are those of the one
    process measuring every sample, to the byte, for Qwen3's checkpointed layers under LoRA at three lengths, a
    Qwen3-MoE layer whose experts' adapters get their gradients in the first sample a process measures (`_measure`:
    each sample starts without them), and Gemma 2's capped sliding layers as tiled decoder layers (`TILE_SAMPLES`:
    eight samples in five tile counts)."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    cfg = load_config(None, [f"model={_save(tmp_path, model_type, **values)}", f"seq_len={seq_len}",
                             "train.device=cuda", "memory.activation_checkpointing=true", *overrides])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=checkpointed)
    assert len(key.samples) >= 3
    forks = []
    fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a second core, on any machine
    split = layer_trace._trace(key, cfg)
    assert forks  # once, or again for fake tensors after the meta device refused an operator (`_trace`)
    monkeypatch.setattr(layer_trace, "_on_two_cores", lambda measure, samples: measure(samples))
    assert layer_trace._trace(key, cfg) == split


def test_a_trace_holds_the_same_bytes_whatever_order_its_samples_are_measured_in(tmp_path, monkeypatch) -> None:
    """`_on_two_cores` deals the samples as each process takes them, so a sample is measured after any other: each is
    measured on a copy of its own. A LongRoPE model's first call leaves its long frequencies on the rotary module,
    which later calls reuse: on a copy a tile count, the first sample measured on each held them in its tables and
    the others did not, and the traced tables' line changed with the order."""
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    half = PHI3_LONG_WINDOW["hidden_size"] // PHI3_LONG_WINDOW["num_attention_heads"] // 2
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
                short_factor=[1.0 + i / 8 for i in range(half)], long_factor=[2.0 + i / 4 for i in range(half)])
    model = _save(tmp_path / "phi3", "phi3", **PHI3_LONG_WINDOW, max_position_embeddings=4096, rope_parameters=rope)
    cfg = load_config(None, [f"model={model}", "seq_len=2144", "train.device=cuda", "lora.enabled=true",
                             "memory.activation_checkpointing=true", "memory.tiled_layers=true"])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=True)
    assert len(key.samples) == len(layer_trace.TILE_SAMPLES)
    traced = []
    for order in (list, lambda samples: list(reversed(samples))):
        monkeypatch.setattr(layer_trace, "_on_two_cores", lambda measure, samples, order=order: measure(order(samples)))
        traced.append(layer_trace._trace(key, cfg))
    assert traced[0] == traced[1]


def test_samples_dealt_to_two_processes_are_measured_once_each_and_a_failing_one_raises_here(monkeypatch) -> None:
    """`_on_two_cores` with a second core: each sample measured once, by this process or the forked copy (its own
    pid), the answers those of one process measuring every sample; the process that takes the costliest sample
    (`_traced_cost`: the tiles it runs, then its tokens) and is held on it leaves every other sample to the other one; a
    sample the copy fails on is measured again in this process, whose error is the one raised."""
    import time

    from longfit.plan import layer_trace

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("RANK", raising=False)
    samples = [(1072, 2), (2144, 2), (3216, 4), (2144, 16)]
    assert max(samples, key=layer_trace._traced_cost) == (3216, 4)

    def measure(part):
        measured = {}
        for sample in part:
            time.sleep(1.0 if sample == (3216, 4) else 0.0)
            measured[sample] = (os.getpid(), sample[0] * sample[1])
        return measured

    split = layer_trace._on_two_cores(measure, samples)
    assert {sample: product for sample, (_, product) in split.items()} == {(t, n): t * n for t, n in samples}
    held = split[3216, 4][0]
    assert len({pid for pid, _ in split.values()}) == 2 and \
        [sample for sample, (pid, _) in split.items() if pid == held] == [(3216, 4)]

    def failing(part):
        measured = {}
        for sample in part:
            if sample == (2144, 2):
                raise ValueError(f"no meta kernel in {os.getpid()}")
            measured |= measure([sample])
        return measured

    with pytest.raises(ValueError, match=f"no meta kernel in {os.getpid()}$"):
        layer_trace._on_two_cores(failing, samples)


@pytest.mark.parametrize("model_type, values, targets", [
    ("gpt_oss", GPT_OSS, "[q_proj,k_proj,v_proj,o_proj]"),
    ("qwen3", {**QWEN3, "num_hidden_layers": 4}, "[q_proj,v_proj,gate_proj,down_proj]"),
    ("qwen3", {**QWEN3, "num_hidden_layers": 4}, "[layers.2.self_attn.q_proj,v_proj]"),
])
def test_adapters_counted_on_the_first_layers_are_those_of_the_whole_peft_model(tmp_path, model_type, values,
                                                                                targets) -> None:
    """`_counted_lora` adapts a copy of the first layers of each kind (`_first_layers_adapted`) and counts every
    layer as the first of its kind: the whole peft model's counts, exactly, for gpt-oss's sliding and full layers
    with experts and Qwen3's dense layers; a target naming one layer adapts the whole model (`_lora_on_copies`)."""
    from longfit.models.structure import decoder_layers
    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    cfg = load_config(None, [f"model={_save(tmp_path, model_type, **values)}", "seq_len=512", "lora.enabled=true",
                             f"lora.target_modules={targets}"])
    s = resolve(cfg, 1)
    whole, _ = layer_trace._built_model(layer_trace._trained_config_json(s), s.lora_rank, cfg)

    from peft.tuners.lora.layer import ParamWrapper

    def trainable(module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def merged(layer) -> int:
        return sum(wrapper.get_param().numel() for wrapper in layer.modules() if isinstance(wrapper, ParamWrapper))

    layers = decoder_layers(whole)
    assert layer_trace._counted_lora(s) == layer_trace.LoraCounts(
        trainable(whole), max(map(trainable, layers)), max(trainable(layer.mlp) for layer in layers),
        max(map(merged, layers)))
    assert len(set(map(trainable, layers))) == (2 if "layers.2" in targets else 1)


def test_the_plans_dispatch_modes_run_their_torch_dispatch_as_written() -> None:
    """#52: torch wraps a dispatch mode's `__torch_dispatch__` in dynamo's disable unless the mode says no
    (`tracker.UncompiledDispatchMode`), a wrapper for each class that defines one: three around every operator of a
    layer trace. Each of the plan's modes runs its own function."""
    from longfit.plan import layer_trace, trace, tracker

    for mode in (tracker.LiveBytes, tracker.ActivationBytes, layer_trace._layer_bytes(), trace._GroupedMatmulInItsDtype):
        assert Path(mode.__dict__["__torch_dispatch__"].__code__.co_filename).parent.name == "plan", mode


def test_a_capture_runs_the_layers_before_the_traced_ones_with_their_adapters_off(tmp_path, monkeypatch) -> None:
    """#52: `_captured_calls` runs the layers that write the keys and values Gemma 4's last layers share (layers 2
    and 3 of GEMMA4_SHARED_KV, traced neither) with peft's adapters off: no adapter of theirs runs, the traced
    layers' adapters run when they are measured, and the trace holds what it holds with the adapters on."""
    from peft.tuners.lora import layer as lora_layer

    from longfit.plan import layer_trace
    from longfit.plan.setup import resolve

    cfg = load_config(None, [f"model={_save(tmp_path, 'gemma4_text', **GEMMA4_SHARED_KV)}", "seq_len=512",
                             "lora.enabled=true", "lora.target_modules=[q_proj]"])
    key = layer_trace._key(resolve(cfg, 1), checkpointed=False)
    monkeypatch.setattr(layer_trace, "_on_two_cores", lambda measure, samples: measure(samples))
    runs, capturing, forward, captured_calls = [], [], lora_layer.Linear.forward, layer_trace._captured_calls

    def counted_forward(self, x, *args, **kwargs):
        runs.append((bool(capturing), self.disable_adapters))
        return forward(self, x, *args, **kwargs)

    def counted_capture(*args, **kwargs):
        capturing.append(1)
        try:
            return captured_calls(*args, **kwargs)
        finally:
            capturing.pop()

    monkeypatch.setattr(lora_layer.Linear, "forward", counted_forward)
    monkeypatch.setattr(layer_trace, "_captured_calls", counted_capture)
    traced = layer_trace._trace(key, cfg)
    assert 2 not in traced.kind_of and 3 not in traced.kind_of  # the layers that write the shared keys: captured only
    assert (True, True) in runs and (False, False) in runs and set(runs) == {(True, True), (False, False)}
    monkeypatch.setattr(layer_trace, "_adapters_off", lambda model: contextlib.nullcontext())
    assert layer_trace._trace(key, cfg) == traced
