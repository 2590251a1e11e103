"""The shrunken copy of `longfit check` (longfit.check.shrink) on transformers' default configs that did not shrink
or whose copy transformers could not run: each shrinks through its config object to a copy transformers builds
(shrinking alone, on the meta device: no step), and a config transformers itself cannot build is told apart."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from longfit.check.shrink import ModelFails, every_expert, shrink_config


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
