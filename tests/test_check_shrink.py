"""The shrunken copy of `longfit check` (longfit.check.shrink) on transformers' default configs that did not shrink
or whose copy transformers could not run: each shrinks through its config object to a copy transformers builds
(shrinking alone, on the meta device: no step), and a config transformers itself cannot build is told apart."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from longfit.check.shrink import ModelFails, every_expert, shrink_config

sys.path.insert(0, str(Path(__file__).parent))
from phi35_mini import PHI35_MINI  # noqa: E402


def shrunk(model_type: str):
    return shrink_config(AutoConfig.for_model(model_type).get_text_config(), 64)


def test_the_layer_count_is_read_where_the_config_keeps_it() -> None:
    """LongCat-Flash counts its layers in `num_layers` (`num_hidden_layers` is a property: twice that), HRM in
    `num_layers_per_stack` (`num_hidden_layers` counts the stacks' passes): the copy has one layer, as many as kinds."""
    longcat = shrunk("longcat_flash")
    assert longcat.config.num_layers == len(longcat.kinds) == 1 and longcat.kinds[0].layers == tuple(range(28))
    # its router chooses among the routed experts and experts that output zero: under bf16 every one of them
    assert every_expert(longcat.config)["moe_topk"] == longcat.config.n_routed_experts + longcat.config.zero_expert_num
    hrm = shrunk("hrm_text")
    assert hrm.config.num_layers_per_stack == len(hrm.kinds) == 1 and hrm.full_layers == 16


def test_parts_of_the_layers_shrink_together() -> None:
    """Dory writes its counts doubled (an attention and an MLP block per layer; read as the config object reads
    them: 36 layers) and its input, recurrent and output parts must sum to the layers: each part keeps one layer
    of each kind it has (sliding, full), and the parts' counts are the copy's."""
    dory = shrunk("dory")
    config = dory.config
    assert dory.full_layers == 36 and len(dory.kinds) == config.num_hidden_layers == 6
    assert (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers) == (2, 2, 2)
    assert [kind.layers[0] for kind in dory.kinds] == [0, 3, 8, 11, 28, 31]


def test_sub_configs_shrink_with_the_widths_they_share() -> None:
    """BLT's stacks are sub-configs: each shrinks, and the encoder's `hidden_size_global` follows the global one."""
    blt = shrunk("blt").config
    for sub in (blt.encoder_config, blt.decoder_config, blt.global_config, blt.patcher_config):
        assert sub.hidden_size <= 64
    assert blt.encoder_config.hidden_size_global == blt.global_config.hidden_size


@pytest.mark.parametrize(("model_type", "holds"), [
    # o_proj maps hidden_size to hidden_size: heads x head_dim stays the hidden size
    ("helium", lambda c: c.hidden_size == c.num_attention_heads * c.head_dim),
    # 6 query heads: the hidden size a multiple of them and of 8 (grouped matmuls take rows of 16 bytes)
    ("inkling2_loop_text", lambda c: c.hidden_size % c.num_attention_heads == 0 and c.hidden_size % 8 == 0),
    # embedding_dim and num_blocks: derived from hidden_size and num_hidden_layers, they follow the copy's
    ("xlstm", lambda c: (c.embedding_dim, c.num_blocks) == (c.hidden_size, c.num_hidden_layers) == (64, 1)),
    # experts, experts per token and shared experts left None by the default config: the copy's counts
    ("dots1", lambda c: (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (4, 2, 1)),
])
def test_the_copy_keeps_the_relations_its_model_needs(model_type: str, holds) -> None:
    assert holds(shrunk(model_type).config)


def test_a_none_count_the_model_builds_without_stays_none() -> None:
    """Gemma 4's `num_experts` None means no mixture of experts: the copy has none either."""
    assert shrunk("gemma4_text").config.num_experts is None


@pytest.mark.parametrize(("model_type", "error"), [
    ("dbrx", "'DbrxAttentionConfig' object has no attribute 'rope_theta'"),  # its attention reads a field it lacks
    ("cohere_compass_text", "KeyError: 'full_attention'"),  # rope_parameters {} indexed by layer type
])
def test_a_config_transformers_cannot_build_unshrunk_is_told_apart(model_type: str, error: str) -> None:
    with pytest.raises(ModelFails, match="unshrunk") as raised:
        shrunk(model_type)
    assert error in str(raised.value)


def test_a_wrapper_transformers_cannot_build_is_told_apart(tmp_path) -> None:
    """Qwen4-Exp's default config leaves its indexer's widths None: transformers fails building the wrapper (as
    longfit reads its tied embeddings), before any copy; the check says so in one line instead of a traceback."""
    from longfit.check.parity import check_run
    from longfit.config import ConfigError, load_config

    AutoConfig.for_model("qwen4_exp").save_pretrained(tmp_path)
    cfg = load_config(None, [f"model={tmp_path}", "seq_len=512", "train.device=cpu"])
    with pytest.raises(ConfigError, match="transformers cannot build the qwen4_exp model of this config"):
        check_run(cfg, "cpu")


# -- fields sized by a width the copy shrinks (#52) -----------------------------------------------------------------

PHI4_MINI_FACTORS = [1.0 + i / 16 for i in range(48)]  # constructed: 48 = its 128-wide heads x 0.75 rotated / 2
LONGROPE = {
    "phi-3.5-mini": PHI35_MINI,
    "phi-4-mini": dict(PHI35_MINI, vocab_size=200064, num_attention_heads=24, num_key_value_heads=8,
                       partial_rotary_factor=0.75, tie_word_embeddings=True,
                       rope_scaling={"type": "longrope", "long_factor": PHI4_MINI_FACTORS,
                                     "short_factor": PHI4_MINI_FACTORS}),
}


def published(values: dict):
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values).get_text_config()


@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_factors_keep_the_checkpoints_rotary_width(name) -> None:
    """LongRoPE's factors are one per rotated frequency (Phi-3.5-mini's published 48 over heads of 96; Phi-4-mini's
    48 over 0.75 of heads of 128): the copy keeps the head width, so its frequencies and attention scaling are the
    checkpoint's, computed by transformers on both configs (once refused: "short_factor field must have length 8")."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    full = published(LONGROPE[name])
    copy = shrink_config(full, 64)
    head = full.hidden_size // full.num_attention_heads
    assert copy.config.hidden_size == copy.config.num_attention_heads * head
    assert copy.config.rope_parameters == full.rope_parameters
    assert any(f"head_dim={head} kept" in note for note in copy.notes)
    for seq_len in (64, 8192):  # within and past the original window: short and long factors
        theirs = ROPE_INIT_FUNCTIONS["longrope"](full, "cpu", seq_len=seq_len)
        ours = ROPE_INIT_FUNCTIONS["longrope"](copy.config, "cpu", seq_len=seq_len)
        torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
        assert ours[1] == theirs[1]


def test_mrope_sections_sum_to_the_copys_rotated_frequencies() -> None:
    """Qwen3.5's published text RoPE: 0.25 of heads of 256 rotated (32 frequencies) split 11/11/10 among time,
    height and width, interleaved: the copy keeps the head width, so the sections still cover its frequencies."""
    full = published(dict(model_type="qwen3_5_text", hidden_size=4096, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=256, num_hidden_layers=32,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                           "mrope_section": [11, 11, 10], "mrope_interleaved": True}))
    copy = shrink_config(full, 64).config
    parameters = copy.rope_parameters
    assert sum(parameters["mrope_section"]) == int(copy.head_dim * parameters["partial_rotary_factor"]) // 2
    assert parameters == full.rope_parameters


def test_per_layer_widths_shrink() -> None:
    """Gemma 3n's intermediate_size is one width per layer (35 of 16384): each shrinks as the config's own width."""
    copy = shrunk("gemma3n_text").config
    assert len(copy.intermediate_size) == copy.num_hidden_layers and max(copy.intermediate_size) <= 96


def test_a_width_of_zero_stays_off() -> None:
    """A Gemma 4 config without per-layer inputs (hidden_size_per_layer_input=0), with experts as 26B-A4B's layers
    have them: the copy keeps it off, where it gave the copy per-layer inputs of its width, whose layers then differed
    from the model's ("cannot shrink")."""
    full = AutoConfig.for_model("gemma4_text", hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=256)
    copy = shrink_config(full, 64).config
    assert copy.hidden_size_per_layer_input == 0 and copy.enable_moe_block


def test_per_layer_query_heads_follow_the_copys_heads() -> None:
    """Laguna sets each layer's query heads (`num_attention_heads_per_layer`): as many per key/value head as the
    copy's `num_attention_heads` (its default: 48 over 8 key/value heads, checked as 6 over 2)."""
    copy = shrunk("laguna").config
    assert copy.num_attention_heads_per_layer == [copy.num_attention_heads] * copy.num_hidden_layers == [12, 12]


@pytest.mark.parametrize(("values", "key", "indices"), [
    # IBM Bamba-9B: attention at layers 9, 18 and 27 of 32, Mamba-2 elsewhere
    (dict(model_type="bamba", num_hidden_layers=32, attn_layer_indices=[9, 18, 27]), "attn_layer_indices", [1]),
    # LiquidAI LFM2-1.2B: attention at 6 of 16 layers, short convolutions elsewhere
    (dict(model_type="lfm2", num_hidden_layers=16, full_attn_idxs=[2, 5, 8, 10, 12, 14]), "full_attn_idxs", [1]),
])
def test_lists_of_layer_indices_are_cut_to_the_copys_layers(values, key, indices) -> None:
    """A list of layer indices named otherwise than `*_layers` is cut like `mlp_only_layers`: one layer of each kind,
    the indices the copy's (once Bamba's copy kept its first 10 layers, LFM2's indices past its 2 layers)."""
    copy = shrink_config(published(values), 64)
    assert copy.config.num_hidden_layers == len(copy.kinds) == 2 and getattr(copy.config, key) == indices


def test_layers_sharing_keys_and_values_keep_one_of_each_kind_and_role() -> None:
    """Gemma-4-E2B's published config: its last 20 of 35 layers reuse the keys and values of the last layer of
    their attention type before them, which stores them (`store_full_length_kv`, a switch, no module of its own).
    The copy keeps one layer of each type in each role -- plain, storing, reusing, in the model's order -- with
    `num_kv_shared_layers` counted among its layers (#52; the copy was all 35 layers: 22 CPU s of `longfit check`)."""
    from longfit.check.shrink import causal_lm
    from longfit.models.loading import resolve_model_config

    model = Path(__file__).parent / "data" / "checkpoint_configs" / "google--gemma-4-E2B"
    copy = shrink_config(resolve_model_config(str(model)), 64)
    assert copy.config.num_hidden_layers == 6 and copy.config.num_kv_shared_layers == 2
    assert [kind.layers[0] for kind in copy.kinds] == [0, 4, 13, 14, 15, 19]
    with torch.device("meta"):
        layers = [layer.self_attn for layer in causal_lm(copy.config).model.layers]
    assert [(a.is_sliding, a.store_full_length_kv, a.is_kv_shared_layer) for a in layers] == [
        (True, False, False), (False, False, False), (True, True, False), (False, True, False),
        (True, False, True), (False, False, True)]
