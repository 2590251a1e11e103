"""Sequence-tiled decoder layers: the loss and every gradient equal the untiled model's.

One rank: dense rows, packed documents, GQA, LoRA (first layer's input without gradient), other
families (Qwen2 biases, Gemma 3 sandwich and q/k norms), Gemma 3 sliding-window layers (windows
shorter and longer than a tile), tile counts from 1 to one token per tile, in
fp32 (<= 1e-5) and bf16 (tolerance below), with the activation offloader, and LoRA dropout (checked
against finite differences: masks are drawn per tile, so only the gradient of the sampled function
can be exact). Context parallelism: ring and Ulysses with cp=2 under FSDP2 on real gloo ranks against
one untiled process, sliding windows included. The blocks of a tile cover exactly the pairs it may see.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from memory_helpers import loss_sum, packed_batch, tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.memory.checkpointing import ActivationOffloader
from longfit.memory.offload import OffloadStore
from longfit.memory.switches import CheckpointPlacement
from longfit.memory.tiled_layers import (
    TILED_LAYER_ATTR,
    TileRandomness,
    apply_tiled_layers,
)
from longfit.memory.tiled_mlp import apply_tiled_final_norm
from longfit.models.structure import decoder_layers
from longfit.parallel.tiled_attention import (
    LocalTileAttention,
    RingTileAttention,
    UlyssesTileAttention,
)

LAYERS = 2
BF16_TOLERANCE = dict(rtol=5e-2, atol=5e-3)  # bf16 sums in another order: the repo's bf16 parity tolerance


def randomize_norms(model):
    """Norm weights start at 1 (or 0 in Gemma's 1 + w form): make them, and their gradients, non-trivial."""
    g = torch.Generator().manual_seed(5)
    for module in model.modules():
        if "RMSNorm" in type(module).__name__:
            module.weight.data = torch.rand(module.weight.shape, generator=g) + 0.5
    return model


def with_lora(model, dropout: float = 0.0, targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj")):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=dropout,
                                            init_lora_weights=False))


def family_model(family: str, window: int | None = None):
    """A 2-layer model of another family with longfit attention (Gemma 3: a sliding-window layer of
    `window` tokens then a global one; full-attention layers only without `window`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.attention import register_attention

    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, vocab_size=384)
    if family == "gemma3_text" and window is None:
        common.update(layer_types=["full_attention"] * LAYERS, sliding_window=None, query_pre_attn_scalar=16)
    elif family == "gemma3_text":
        common.update(layer_types=["sliding_attention", "full_attention"], sliding_window=window,
                      query_pre_attn_scalar=16)
    config = AutoConfig.for_model(family, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    model.config.use_cache = False
    return randomize_norms(model)


def mean_loss(model, labels, **inputs):
    """The trainer's objective: the mean token loss (its gradients are O(1), so 1e-5 is a meaningful bound)."""
    return loss_sum(model, labels, None, **inputs) / (labels != -100).sum()


def loss_and_grads(model, dtype=torch.float32):
    inputs, labels = packed_batch()
    model = model.to(dtype)
    loss = mean_loss(model, labels, **inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tiled(model, tiles: int, offloader=None):
    """Tiled decoder layers and the tiled final norm, as `apply_memory_techniques` applies them."""
    apply_tiled_layers(model, LocalTileAttention.for_sequence, tiles=tiles, offloader=offloader)
    apply_tiled_final_norm(model, tiles)
    return model


def assert_same(reference, result, **tolerance):
    (ref_loss, ref_grads), (loss, grads) = reference, result
    torch.testing.assert_close(loss, ref_loss, **tolerance)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name, **tolerance)


FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", [1, 3, 7, 48])
def test_tiled_layers_match_untiled_packed_documents_gqa(tiles):
    """Packed rows (a document boundary inside a tile), 4 query heads over 2 K/V heads; 48 = one token per tile."""
    reference = loss_and_grads(randomize_norms(tiny_llama(layers=LAYERS)))
    model = tiled(randomize_norms(tiny_llama(layers=LAYERS)), tiles)
    assert_same(reference, loss_and_grads(model), **FP32)
    assert all(getattr(layer, TILED_LAYER_ATTR).tile_counts == [tiles] for layer in decoder_layers(model))


def test_tiled_layers_match_untiled_dense_rows():
    inputs, labels = packed_batch()
    dense = dict(input_ids=inputs["input_ids"], position_ids=torch.arange(48).expand(2, 48))

    def run(model):
        loss = mean_loss(model, labels, **dense)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    assert_same(run(tiny_llama(layers=LAYERS)), run(tiled(tiny_llama(layers=LAYERS), 5)), **FP32)


def test_tiled_layers_match_untiled_lora():
    """LoRA everywhere; the first layer's input (frozen embeddings) needs no gradient."""
    reference = loss_and_grads(with_lora(tiny_llama(layers=LAYERS)))
    model = tiled(with_lora(tiny_llama(layers=LAYERS)), 4)
    result = loss_and_grads(model)
    assert all("lora_" in name for name in result[1])
    assert_same(reference, result, **FP32)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_tiled_layers_match_untiled_other_families(family):
    assert_same(loss_and_grads(family_model(family)), loss_and_grads(tiled(family_model(family), 3)), **FP32)


@pytest.mark.parametrize("window,tiles", [(5, 3), (21, 3), (7, 48), (30, 1)])
def test_tiled_sliding_window_layers_match_untiled(window, tiles):
    """Gemma 3 local layers: windows shorter than a tile (16 tokens), longer, with one-token tiles, one tile;
    packed documents (one of 20 tokens, shorter than some windows)."""
    reference = loss_and_grads(family_model("gemma3_text", window))
    assert_same(reference, loss_and_grads(tiled(family_model("gemma3_text", window), tiles)), **FP32)


def test_tiled_layers_bf16():
    reference = loss_and_grads(randomize_norms(tiny_llama(layers=LAYERS)), torch.bfloat16)
    result = loss_and_grads(tiled(randomize_norms(tiny_llama(layers=LAYERS)), 3), torch.bfloat16)
    assert_same(reference, result, **BF16_TOLERANCE)


def test_tiled_layer_saves_only_its_input():
    """A layer after the first (the first saves nothing: test_first_tiled_layer_looks_its_input_up_again)."""
    model = tiled(tiny_llama(layers=LAYERS), 3)
    inputs, _ = packed_batch()
    decoder = model.model
    hidden = decoder.embed_tokens(inputs["input_ids"]).detach().requires_grad_()
    rotary = decoder.rotary_emb(hidden, position_ids=inputs["position_ids"])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = decoder.layers[1](hidden, position_embeddings=rotary, position_ids=inputs["position_ids"],
                                cu_seq_lens_q=inputs["cu_seq_lens_q"])
    assert len(saved) == 1 and saved[0] is hidden  # no activation, no K/V: only the (B, L, H) input
    out.sum().backward()
    assert hidden.grad is not None


class NewStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Byte sizes of the storages that aten ops create: outputs that are not (views of) one of the op's inputs.

    Judged per op, not against the addresses seen so far, which the allocator reuses once a tensor is freed."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                inputs.add(t.untyped_storage().data_ptr())
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("kind", ["produced", "leaf", "view_of_leaf"])
def test_input_gradient_takes_the_inputs_storage_unless_the_input_is_a_leaf(kind):
    """One pass: dx is written over the layer input's rows as their tiles finish, so backward allocates no
    (B, L, H) tensor (K/V are narrower here); a caller's leaf tensor is left alone and gets its own dx, also
    when the layer sees a view of it (FSDP2's pre-forward hook passes inputs on as views)."""
    model = tiled(tiny_llama(layers=LAYERS), 3)
    inputs, _ = packed_batch()
    decoder = model.model
    embedded = decoder.embed_tokens(inputs["input_ids"]).detach().requires_grad_()
    leaf = kind != "produced"
    hidden = {"produced": embedded * 1.0, "leaf": embedded, "view_of_leaf": embedded.view_as(embedded)}[kind]
    original = hidden.detach().clone()
    rotary = decoder.rotary_emb(hidden, position_ids=inputs["position_ids"])
    out = decoder.layers[1](hidden, position_embeddings=rotary, position_ids=inputs["position_ids"],
                            cu_seq_lens_q=inputs["cu_seq_lens_q"])
    grad_out = torch.randn_like(out)
    with NewStorages() as created:
        (dx,) = torch.autograd.grad(out, hidden, grad_out)
    row_bytes = hidden.numel() * hidden.element_size()
    assert created.sizes.count(row_bytes) == (1 if leaf else 0)
    assert (dx.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()) == (not leaf)
    assert torch.equal(hidden, original) == leaf
    reference = tiny_llama(layers=LAYERS).model.layers[1]
    x = original.clone().requires_grad_()
    expected = torch.autograd.grad(reference(x, position_embeddings=rotary, position_ids=inputs["position_ids"],
                                             cu_seq_lens_q=inputs["cu_seq_lens_q"]), x, grad_out)[0]
    torch.testing.assert_close(dx, expected, **FP32)


def test_tiled_layers_with_offload_match_untiled():
    layers = 3  # the first looks its input up again; the third's backward prefetches the second's input
    offloader = ActivationOffloader(min_offload_bytes=1024, layers=layers - 1)
    model = tiled(tiny_llama(layers=layers), 3, offloader)
    assert_same(loss_and_grads(tiny_llama(layers=layers)), loss_and_grads(model), **FP32)
    stats = offloader.stats
    assert stats.offloaded_tensors == layers - 1 and stats.offloaded_bytes == (layers - 1) * 2 * 48 * 64 * 4
    assert stats.reloaded_bytes == stats.offloaded_bytes and stats.prefetched_tensors == 1
    assert offloader.store.stats.unplanned_bytes == 0  # the store's layers are the stored inputs


def test_first_tiled_layer_looks_its_input_up_again():
    """The first layer saves no tensor; its backward calls the embedding again on the same ids."""
    model = tiled(tiny_llama(layers=LAYERS), 3)
    inputs, labels = packed_batch()
    ids = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, output: ids.append(args[0]))
    inside = []  # the decoder layer running now
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: inside.append(module))
        layer.register_forward_hook(lambda module, args, output: inside.remove(module))
    saved = {layer: 0 for layer in model.model.layers}

    def pack(tensor):
        if inside:
            saved[inside[-1]] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = mean_loss(model, labels, **inputs)
    assert list(saved.values()) == [0] + [1] * (LAYERS - 1)  # the others save their input
    loss.backward()
    assert len(ids) == 2 and ids[1] is ids[0] is inputs["input_ids"]


def test_first_tiled_layer_looks_up_exactly_its_forward_input_under_autocast():
    """LoRA on the input embedding multiplies its adapter under bf16 autocast: the lookup in backward re-enters the
    forward's autocast, so layer 0 is recomputed from the very input it saw."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(tiny_llama(layers=LAYERS), LoraConfig(r=4, target_modules=["embed_tokens"],
                                                                 init_lora_weights=False))
    tiled(model, 3)
    embedding = getattr(decoder_layers(model)[0], TILED_LAYER_ATTR).embedding
    inputs, _ = packed_batch()
    with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        embedded = model.get_input_embeddings()(inputs["input_ids"])
        lookup = embedding.of(embedded)
    with torch.no_grad():
        assert not torch.equal(model.get_input_embeddings()(inputs["input_ids"]), embedded)  # autocast matters
    assert torch.equal(lookup(), embedded)


def saved_per_layer(model, run) -> list[int]:
    """How many tensors each decoder layer saved for backward while `run()` ran its forward."""
    inside = []  # the decoder layer running now
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(lambda module, args: inside.append(module))
        layer.register_forward_hook(lambda module, args, output: inside.remove(module))
    saved = {layer: 0 for layer in decoder_layers(model)}

    def pack(tensor):
        if inside:
            saved[inside[-1]] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return list(saved.values()), result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_first_tiled_layer_saves_an_input_it_cannot_look_up(dtype):
    """Input embeddings that are not the embedding's output (image rows write the images' embeddings over their
    placeholders, #54; here every fifth token's embedding replaced by a trained one): the first layer saves its
    input as the others do, and the loss and every gradient are the untiled model's."""
    def step(model):
        model = model.to(dtype)
        inputs, labels = packed_batch()
        torch.manual_seed(3)
        image = torch.nn.Parameter(torch.randn(model.config.hidden_size, dtype=dtype))
        ids = inputs.pop("input_ids")

        def loss():
            embeds = model.get_input_embeddings()(ids)  # (B, L, H)
            placeholders = (torch.arange(ids.shape[1]) % 5 == 0).view(1, -1, 1)
            return mean_loss(model, labels, inputs_embeds=torch.where(placeholders, image, embeds), **inputs)

        saved, value = saved_per_layer(model, loss)
        value.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return saved, (value.detach(), grads | {"image": image.grad})

    _, reference = step(randomize_norms(tiny_llama(layers=LAYERS)))
    saved, result = step(tiled(randomize_norms(tiny_llama(layers=LAYERS)), 3))
    assert saved == [1] * LAYERS
    assert_same(reference, result, **(FP32 if dtype == torch.float32 else BF16_TOLERANCE))


def granite_moe(seed: int = 0):
    """A 2-layer Granite MoE model (granite-3.1-1b-a400m's kind, #52) with longfit attention and its multipliers:
    the embeddings scaled in the model's forward, the residual branches, the attention scale, the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.attention import register_attention

    config = AutoConfig.for_model("granitemoe", hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=384, num_local_experts=4,
                                  num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                                  attention_multiplier=0.015625, logits_scaling=6.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16 autocast"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_layers_match_untiled_with_granites_multipliers(dtype: str, lora: bool):
    """Granite scales the embedding output in its model forward (embedding_multiplier 12): the first tiled layer
    looks its input up again times the multiplier, saving nothing, and the loss and every gradient are the untiled
    model's (fp32 <= 1e-5; bf16 weights, and fp32 weights under bf16 autocast (train.dtype=bf16 on one process),
    within the bf16 tolerance)."""
    def step(tiles: int | None):
        made = granite_moe()
        made = with_lora(made, targets=("q_proj", "k_proj", "v_proj", "o_proj")) if lora else made
        made = (tiled(made, tiles) if tiles else made).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        inputs, labels = packed_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16 autocast"):
            saved, loss = saved_per_layer(made, lambda: mean_loss(made, labels, **inputs))
        loss.backward()
        return saved, (loss.detach(), {n: p.grad.clone() for n, p in made.named_parameters() if p.grad is not None})

    _, reference = step(None)
    saved, result = step(3)
    assert saved == [0] + [1] * (LAYERS - 1)
    assert_same(reference, result, **(FP32 if dtype == "fp32" else BF16_TOLERANCE))


def test_a_second_backward_after_the_input_was_consumed_is_refused():
    """The offloader's device tier hands the saved input back through saved-tensor hooks, which skip autograd's
    version check: a second backward would recompute the layer from the gradient written over its input."""
    store = OffloadStore(CheckpointPlacement(device=LAYERS, host=0, disk=0, slot_bytes=2 * 48 * 64 * 4))
    model = tiled(tiny_llama(layers=LAYERS), 3, ActivationOffloader(min_offload_bytes=1024, store=store))
    inputs, _ = packed_batch()
    decoder = model.model
    hidden = decoder.embed_tokens(inputs["input_ids"]) * 1.0  # produced by the graph: its storage is reused
    rotary = decoder.rotary_emb(hidden, position_ids=inputs["position_ids"])
    out = decoder.layers[1](hidden, position_embeddings=rotary, position_ids=inputs["position_ids"],
                            cu_seq_lens_q=inputs["cu_seq_lens_q"])
    grad_out = torch.randn_like(out)
    out.backward(grad_out, retain_graph=True)
    with pytest.raises(RuntimeError, match="tiled decoder layer's backward ran a second time"):
        out.backward(grad_out)


def test_each_tile_draws_from_its_own_random_stream():
    """Under context parallelism a tile's first run stops after q, k, v (its key pass): the draws of its full
    run afterwards must be its own, not the next tile's, and every run of a tile replays the same draws."""
    randomness = TileRandomness(torch.device("cpu"))
    torch.manual_seed(0)
    with randomness.replay(0):
        key_pass = torch.rand(3)
    with randomness.replay(1):
        next_tile = torch.rand(6)
    with randomness.replay(0):
        full_run = torch.rand(6)
    assert torch.equal(full_run[:3], key_pass)
    assert not torch.equal(full_run[3:], next_tile[:3])
    with randomness.replay(1):
        assert torch.equal(torch.rand(6), next_tile)


class PrefixAttention:
    """Plain differentiable attention of a tile's queries over the keys of this and every earlier tile (dense rows)."""

    def __init__(self):
        self.keys, self.values = [], []

    def __call__(self, q, k, v, scale=None, documents=None, window=None, softcap=None, sinks=None):
        assert window is None and softcap is None and sinks is None
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)
        t, seen = q.shape[2], keys.shape[2]
        visible = torch.ones(t, seen, dtype=torch.bool).tril(diagonal=seen - t)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                                                enable_gqa=True)


def test_lora_dropout_replays_each_tiles_masks():
    """Masks are drawn per tile and replayed in backward: the gradient is that of the sampled function.

    The reference runs the same tiles in the same order with plain autograd (so it draws the same masks)
    and attends each tile's queries to the keys of the tiles so far.
    """
    from longfit.parallel.tiled_attention import even_tiles

    reference, model = (with_lora(tiny_llama(layers=LAYERS), dropout=0.3) for _ in range(2))
    tiled(model, 3)
    inputs, labels = packed_batch()
    inputs = dict(input_ids=inputs["input_ids"], position_ids=torch.arange(48).expand(2, 48))
    tiles = even_tiles(0, 48, 3)

    def tiled_by_hand(layer, hidden_states, position_embeddings=None, position_ids=None, **kwargs):
        cos, sin = position_embeddings
        attention, outputs, randomness = PrefixAttention(), [], TileRandomness(hidden_states.device)
        layer.self_attn.longfit_context_parallel = attention
        for index, (start, end) in enumerate(tiles):
            with randomness.replay(index):  # each tile's own stream, seeded in tile order as the tiled layer does
                outputs.append(type(layer).forward(layer, hidden_states[:, start:end],
                                                   position_embeddings=(cos[:, start:end], sin[:, start:end]),
                                                   position_ids=position_ids[:, start:end]))
        del layer.self_attn.longfit_context_parallel
        return torch.cat(outputs, dim=1)

    for layer in decoder_layers(reference):
        layer.forward = lambda *args, layer=layer, **kwargs: tiled_by_hand(layer, *args, **kwargs)
    results = []
    for net in (reference, model):
        net.train()
        torch.manual_seed(123)
        loss = mean_loss(net, labels, **inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}))
    assert_same(*results, **FP32)
    torch.manual_seed(124)  # the masks matter: another draw, another loss
    assert not torch.allclose(mean_loss(model, labels, **inputs), results[1][0])


def covered_pairs(blocks, query_index, key_index) -> set[tuple[int, int, int]]:
    """(row, query position, key position) of every pair the blocks compute (their masks applied)."""
    pairs = set()
    for b in blocks:
        for row in range(b.rows.start, b.rows.stop):
            for i, qi in enumerate(range(b.q.start, b.q.stop)):
                for j, kj in enumerate(range(b.kv.start, b.kv.stop)):
                    visible = {"full": True, "lower": j <= i, "upper": j >= i}[b.mask]
                    if b.window is not None:
                        visible = j <= i < j + b.window
                    if visible:
                        pairs.add((row, query_index[qi], key_index[kj]))
    return pairs


def visible_pairs(rows, queries, window) -> set[tuple[int, int, int]]:
    return {(r, q, k) for r, docs in enumerate(rows) for q in queries for k in range(q + 1)
            if any(d0 <= k <= q < d1 for d0, d1 in docs) and (window is None or q - k < window)}


@pytest.mark.parametrize("window", [None, 3, 6, 40])
def test_tile_blocks_cover_exactly_the_visible_pairs(window):
    """Every backend's blocks for a tile: each visible (row, query, key) pair once, none across documents or
    outside the window; key blocks hold at most max_keys keys, except a tile against its own keys."""
    rows = [[(0, 10), (10, 30), (30, 48)], [(0, 48)]]
    local = LocalTileAttention(rows, 48)
    local.tiles(6)  # tiles of 8, max_keys 8
    for start in (0, 8, 24, 40):
        blocks = local._blocks(start, start + 8, window)
        index = {i: start + i for i in range(8)}
        pairs = covered_pairs(blocks, index, {k: k for k in range(48)})
        assert pairs == visible_pairs(rows, range(start, start + 8), window)
        assert sum(len(range(b.rows.start, b.rows.stop)) for b in blocks) >= len(blocks)
        assert all(b.kv.stop - b.kv.start <= 8 for b in blocks)
    # Ulysses, cp=2 over a 48-token row: rank j's tile [s, e) at j 24 + [s, e), at query index j t
    ulysses = UlyssesTileAttention(None, rows, 24)
    ulysses.cp, ulysses.row_length = 2, 48
    ulysses.tiles(3)
    blocks = ulysses._blocks(8, 16, window)
    index = {j * 8 + i: j * 24 + 8 + i for j in range(2) for i in range(8)}
    assert covered_pairs(blocks, index, {k: k for k in range(48)}) == visible_pairs(
        rows, [*range(8, 16), *range(32, 40)], window)
    # Ring, cp=2, chunks of 12: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    ring = RingTileAttention(None, rows, 24)
    ring.cp, ring.rank, ring.chunk = 2, 0, 12
    tiles = ring.tiles(4)
    assert tiles == [(0, 6), (6, 12), (12, 18), (18, 24)]
    queries = ring._queries(18, 24)
    assert queries == (42, 48)
    pairs = set()
    for owner, chunks in ((0, (0, 3)), (1, (1, 2))):
        shard_index = {h * 12 + i: c * 12 + i for h, c in enumerate(chunks) for i in range(12)}
        pairs |= covered_pairs(ring._shard_blocks(queries, owner, window), {i: 42 + i for i in range(6)}, shard_index)
    assert pairs == visible_pairs(rows, range(42, 48), window)


# -- context parallelism ---------------------------------------------------------------------------------

CP_CASES = [  # (name, method, rows, documents per row, LoRA, K/V heads, tiles, sliding window of Gemma 3's layer 0)
    ("ring-dense", "ring", 2, None, False, 2, 4, None),
    ("ring-packed-lora", "ring", 1, [17, 47], True, 2, 6, None),
    ("ulysses-packed", "ulysses", 2, [10, 23, 31], False, 2, 3, None),
    ("ulysses-gqa-repeated-kv-heads", "ulysses", 1, [40, 24], False, 1, 5, None),
    # L=64 over cp=2: ring chunks of 16 tokens; a window inside a tile, and one wider than a chunk
    ("ring-window-packed", "ring", 1, [30, 34], False, 1, 4, 6),
    ("ring-window-wide", "ring", 2, None, False, 1, 2, 40),
    ("ulysses-window-packed", "ulysses", 1, [21, 43], False, 1, 3, 9),
]


def cp_model(kv_heads: int, lora: bool, window: int | None = None):
    from test_parallel_model import tiny_llama as parallel_tiny_llama

    if window is not None:
        return family_model("gemma3_text", window)
    model = parallel_tiny_llama()
    if kv_heads != model.config.num_key_value_heads:
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(model.config)
        config.num_key_value_heads = kv_heads
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    randomize_norms(model)
    if lora:
        from test_parallel_model import with_lora as parallel_lora

        model = parallel_lora(model)
    return model


def cp_worker(rank: int, world_size: int) -> dict:
    from test_parallel_model import L, make_batch

    from longfit.config import load_config
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    dims = ParallelDims(dp_shard=-1, cp=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    results = {}
    for name, method, rows, docs, lora, kv_heads, tiles, window in CP_CASES:
        batch = make_batch(rows, docs and [docs] * rows, seed=3)
        reference = cp_model(kv_heads, lora, window)
        ref_loss = batch_loss_sum(CausalLMLoss(reference), batch) / batch.num_label_tokens
        ref_loss.backward()
        cfg = load_config(None, [f"seq_len={L}", "parallel.cp=2", f"parallel.cp_method={method}", "train.dtype=fp32",
                                 "memory.tiled_layers=true", f"memory.layer_tiles={tiles}", "memory.tiled_mlp=false",
                                 "memory.chunked_loss=false"])
        model = cp_model(kv_heads, lora, window)
        case_dims = ParallelDims.from_config(cfg, world_size, model.config.num_attention_heads)
        assert case_dims.cp_method == method
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), case_dims, cfg, mesh)
        shard = shard_batch(batch, mesh.cp_rank, 2, cp_layout(method))
        count = global_valid_tokens(shard.labels, mesh.world_group)
        local = batch_loss_sum(loss_module, shard)
        (local / count).backward()
        loss = all_reduce_sum(local.detach().clone(), mesh.world_group) / count
        torch.testing.assert_close(loss, ref_loss.detach(), **FP32, msg=f"{name}: loss")
        grads = {n: p.grad.full_tensor() for n, p in loss_module.model.named_parameters() if p.requires_grad}
        expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
        assert grads.keys() == expected.keys(), name
        for param, grad in expected.items():
            torch.testing.assert_close(grads[param], grad, **FP32, msg=f"{name}: {param}")
        counts = [getattr(layer, TILED_LAYER_ATTR).tile_counts for layer in decoder_layers(loss_module.model)]
        results[name] = (float(loss), counts)
    return results


@pytest.mark.slow  # 13 s, for the default suite's 15 minutes; .ci/run runs it
@pytest.mark.timeout(300)
def test_tiled_layers_under_ring_and_ulysses_match_one_process():
    results = run_distributed(cp_worker, 2)
    for name, _, _, _, _, _, tiles, _ in CP_CASES:
        assert results[0][name][0] == results[1][name][0], name
        # ring tiles stay inside the two zigzag chunks: an even count
        expected = tiles + tiles % 2 if name.startswith("ring") else tiles
        assert results[0][name][1] == [[expected]] * 2, (name, results[0][name][1])


def test_the_published_granite_moe_config_checks_exact_at_128k_with_lora(tmp_path, monkeypatch):
    """granite-3.1-1b-a400m's published config at 128K with LoRA (#52): the run's techniques tile its layers, and the
    check is exact (before, its first tiled layer refused the scaled embeddings). 8 s quiet, 77 s at load 16."""
    from longfit.check.parity import check_run
    from longfit.config import load_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = Path(__file__).parent / "data" / "checkpoint_configs" / "ibm-granite--granite-3.1-1b-a400m-instruct"
    report = check_run(load_config(None, [f"model={model}", "seq_len=131072", "lora.enabled=true",
                                          "memory.tiled_layers=true"]), "cpu")
    assert report.exact, report.refusal
    assert any("techniques" in c.name for c in report.comparisons)
