"""Token mixers longfit has no kernel for, computed exactly on packed rows by running transformers' own module on
each document.

Which (`find_document_mixers`): in a decoder layer, each child module that convolves over the sequence (an nn.Conv1d
of kernel > 1) or shifts it (RWKV's time shift) and is not a Gated DeltaNet that longfit's kernels route
(models/linear_attention.py): the Mamba / Mamba-2 mixers of Mamba, Falcon-Mamba, Bamba, Falcon-H1, Granite-4
hybrids, Jamba, Nemotron-H and Zamba, the short convolutions of LFM2 / LFM3, attention modules with query/key
convolutions (Zaya, Inkling), Kimi's delta attention, RecurrentGemma's recurrent block, RWKV's time and channel
mixing; and the token mixer of a layer `config.layer_types` calls linear attention that owns neither (MiniMax's
lightning attention, Ling's): its one child with weights beside the feed-forward block. transformers runs such a module over each
row as ONE sequence: on a packed row a document's first tokens would read the state (the convolution's window, the
scan's state) the document before it left.

Why per document is exact: such a mixer is causal and carries state only along the sequence (its output at token p
is a function of the inputs at tokens <= p, through a convolution window and a recurrent state that start at zero
with the sequence). The semantics of packing is that each document is a sequence of its own, which is exactly what
transformers computes when it is given the document alone, so for the documents [s_i, e_i) of row b

    out[b, s_i:e_i] = mixer(x[b:b+1, s_i:e_i], <every per-token argument sliced the same way>)

concatenated over the documents, is transformers' per-document result by construction -- the same module, the same
code path, the same order of operations (on a GPU its own CUDA kernels, mamba_ssm and causal-conv1d, where
installed). Linear in L: each token is computed once. A row of one document calls the module once, on the row.

Arguments: a tensor whose first two dimensions are the call's (B, L) (hidden states, position_ids, (cos, sin)
position embeddings) is sliced to the document; the document keywords of the call (`cu_seq_lens_q`,
`longfit_documents`, ...) are dropped (a slice is one document); any other tensor argument (a 4-D mask, a cache) is
refused in one line when the row is packed. Outputs: per-token tensors are joined in row order; anything else (a
recurrent state, attention weights, which a training forward's layer drops) is None. The call's documents come from the mixer's own keywords, else its
layer's (cu_seq_lens_q, longfit_documents, position_ids remembered by `remember_documents`), else those of the
decoder body's call (a forward pre-hook on the body: Mamba's blocks are called with nothing but the hidden states).

What it cannot do, refused where it would run: context parallelism (a document spanning ranks needs its state
carried across them: `refuse_context_parallel`), tiled layers (a sequence tile cuts documents:
memory/tiled_layers.py refuses them, `auto` leaves them off), pipeline parallelism (`refuse_pipeline`: the layout a
mixer reads is its layer's last call's, and a schedule interleaves micro-batches before a recomputation).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.data.packing import document_rows
from longfit.models.attention import call_documents
from longfit.models.structure import decoder, decoder_layers, feed_forward, unwrap_peft

LINEAR_ATTENTION = "linear_attention"  # config.layer_types' entry (models/linear_attention.py)
DOCUMENT_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "longfit_documents")
MIXER_ATTR = "longfit_document_mixer"
_UNKNOWN = object()  # a call whose keywords say nothing of its documents


def owns_sequence_convolution(module: nn.Module) -> bool:
    """The module convolves over the sequence (an nn.Conv1d of kernel > 1) or shifts it (RWKV's `time_shift`, a
    zero padding that moves each token's input one step along the sequence)."""
    return any((isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1) or isinstance(m, nn.ZeroPad2d)
               for m in module.modules())


def _linear_mixer(layer: nn.Module, candidates: list[nn.Module]) -> nn.Module | None:
    """The token mixer of a linear-attention layer that owns no convolution (MiniMax's lightning attention, Ling's):
    its one child with a matrix among its weights that is not its feed-forward block."""
    ffn = feed_forward(layer)
    found = [child for child in candidates if child is not ffn and any(p.dim() >= 2 for p in child.parameters())]
    return found[0] if len(found) == 1 else None


def find_document_mixers(model: nn.Module, routed: list[nn.Module]) -> dict[int, list[nn.Module]]:
    """The per-document mixers of each decoder layer that has them (module docstring), by layer index: its children
    that convolve over or shift the sequence outside the `routed` (Gated DeltaNet) mixers (Inkling's layer has three:
    its attention's and two short convolutions; RWKV's two: its time-mixing and channel-mixing blocks; each is causal
    alone, so each runs per document), and the token mixer of a layer `config.layer_types` calls linear attention
    (`_linear_mixer`) when it owns none. A linear-attention layer without either is refused."""
    config = unwrap_peft(model).config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    routed_ids = {id(module) for mixer in routed for module in mixer.modules()}
    mixers = {}
    for index, layer in enumerate(decoder_layers(model)):
        if any(id(module) in routed_ids for module in layer.modules()):
            continue
        candidates = list(layer.children())
        found = [child for child in candidates if owns_sequence_convolution(child)]
        if not found and index < len(types) and types[index] == LINEAR_ATTENTION:
            mixer = _linear_mixer(layer, candidates)
            if mixer is None:
                raise ConfigError(
                    f"decoder layer {index} ({type(layer).__name__}) is a linear-attention layer whose token mixer "
                    "longfit cannot find (no Gated DeltaNet, no convolution over the sequence, not one module beside "
                    "its feed-forward block), so it cannot compute it exactly on packed documents"
                )
            found = [mixer]
        if found:
            mixers[index] = found
    return mixers


def document_mixers(model: nn.Module) -> dict[int, nn.Module]:
    """The first mixer `prepare_document_mixers` wrapped in each layer that has one, by decoder layer index."""
    found = {}
    for index, layer in enumerate(decoder_layers(model)):
        for child in layer.children():
            if getattr(child, MIXER_ATTR, False):
                found.setdefault(index, child)
    return found


def refuse_context_parallel(model: nn.Module) -> None:
    """Refuse context parallelism over a model with per-document mixers (module docstring)."""
    for index, mixer in document_mixers(model).items():
        raise ConfigError(f"decoder layer {index}'s {type(mixer).__name__} runs per document on one rank (a document "
                          "spanning ranks would need its state carried across them): set parallel.cp=1")


def refuse_pipeline(model: nn.Module) -> None:
    """Refuse pipeline parallelism over a model with per-document mixers: a mixer reads its call's layout from its
    layer's or the body's last call, and a pipeline schedule runs other micro-batches' forwards (other layouts)
    before a checkpointed layer's recomputation."""
    for index, mixer in document_mixers(model).items():
        raise ConfigError(f"decoder layer {index}'s {type(mixer).__name__} runs per document of the micro-batch whose "
                          "layout it last saw, which a pipeline schedule's interleaved micro-batches change before "
                          "its recomputation: set parallel.pp=1")


def _known_documents(kwargs: dict, batch: int):
    if not any(key in kwargs for key in ("cu_seq_lens_q", "longfit_documents", "position_ids")):
        return _UNKNOWN
    return call_documents(kwargs.get("cu_seq_lens_q"), kwargs.get("longfit_documents"), kwargs.get("position_ids"), batch)


def _record_body_call(body: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on the decoder body: the layout of its call, for layers called without it."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    found = _known_documents(kwargs, inputs.shape[0]) if inputs is not None else _UNKNOWN
    body.longfit_call_documents = None if found is _UNKNOWN else found


def _record_layer_call(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on a layer with a per-document mixer: its call's layout when its keywords carry one."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    layer.longfit_call_documents = _known_documents(kwargs, hidden.shape[0]) if hidden is not None else _UNKNOWN


def _slice(value, b: int, start: int, end: int, batch: int, length: int, name: str, where: str):
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, b, start, end, batch, length, name, where) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() >= 2 and value.shape[1] == length and value.shape[0] in (batch, 1):
        row = b if value.shape[0] == batch else 0  # (1, L, ...): the same for every row (RoPE's cos and sin)
        return value[row : row + 1, start:end]
    raise ConfigError(f"{where} gets `{name}` of shape {tuple(value.shape)}, not one entry per token of its (B={batch}, "
                      f"L={length}) rows, so longfit cannot call it per document of a packed row")


def _joined(pieces: list, batch: int, length: int):
    """The documents' outputs of one kind as the rows' (B, L, ...): per-token tensors (1, document length, ...) laid
    side by side in row order; anything else (MiniMax's recurrent state, attention weights) None, as a training
    forward's layer drops it: a layer that read it would fail, never read one document's as the row's."""
    if all(isinstance(p, torch.Tensor) and p.dim() >= 2 and p.shape[0] == 1 for p in pieces):
        if sum(p.shape[1] for p in pieces) == batch * length and len({p.shape[2:] for p in pieces}) == 1:
            return torch.cat(pieces, dim=1).view(batch, length, *pieces[0].shape[2:])
    return None


def _per_document_forward(layer: nn.Module, body: nn.Module, where: str, forward):
    @functools.wraps(forward)
    def per_document(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        B, L = hidden.shape[:2]
        documents = _known_documents(kwargs, B)
        if documents is _UNKNOWN:
            documents = getattr(layer, "longfit_call_documents", _UNKNOWN)
        if documents is _UNKNOWN:
            documents = getattr(body, "longfit_call_documents", None)
        kwargs = {k: v for k, v in kwargs.items() if k not in DOCUMENT_KEYWORDS}
        if documents is None or documents.one_per_row:
            return forward(*args, **kwargs)
        for key in ("cache", "cache_params", "past_key_values"):
            if kwargs.get(key) is not None:
                raise ConfigError(f"{where} got a cache on packed rows: longfit trains without one (use_cache=False)")
        outputs = []
        for b, docs in enumerate(document_rows(documents, B, L)):
            for start, end in docs:
                doc_args = tuple(_slice(a, b, start, end, B, L, f"argument {i}", where) for i, a in enumerate(args))
                doc_kwargs = {k: _slice(v, b, start, end, B, L, k, where) for k, v in kwargs.items()}
                outputs.append(forward(*doc_args, **doc_kwargs))
        if isinstance(outputs[0], torch.Tensor):
            return _joined(outputs, B, L)
        return type(outputs[0])(_joined([out[i] for out in outputs], B, L) for i in range(len(outputs[0])))

    return per_document


def prepare_document_mixers(model: nn.Module, routed: list[nn.Module]) -> int:
    """Run each per-document mixer of `model` (module docstring) per document of a packed row; returns how many
    there are. Idempotent."""
    mixers = find_document_mixers(model, routed)
    if not mixers:
        return 0
    body = decoder(model)
    if not getattr(body, "longfit_documents_hooked", False):
        body.register_forward_pre_hook(_record_body_call, with_kwargs=True)
        body.longfit_documents_hooked = True
    layers = decoder_layers(model)
    for index, found in mixers.items():
        layer = layers[index]
        if not getattr(layer, "longfit_documents_hooked", False):
            layer.register_forward_pre_hook(_record_layer_call, with_kwargs=True)
            layer.longfit_documents_hooked = True
        for mixer in found:
            if getattr(mixer, MIXER_ATTR, False):
                continue
            where = f"decoder layer {index}'s {type(mixer).__name__}"
            mixer.forward = _per_document_forward(layer, body, where, mixer.forward)
            setattr(mixer, MIXER_ATTR, True)
    return sum(len(found) for found in mixers.values())
