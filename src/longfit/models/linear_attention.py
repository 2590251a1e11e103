"""longfit's kernels for the linear-attention layers of hybrid models (Gated DeltaNet: Qwen3.5, Qwen3-Next),
exact on packed documents.

A hybrid config lists its layer kinds in `layer_types`; a "linear_attention" layer mixes tokens with a short
causal convolution followed by the gated delta rule instead of softmax attention. transformers' layer
(e.g. Qwen3_5GatedDeltaNet) projects the hidden states itself and calls two kernels its modeling module names
`causal_conv1d_fn` and `torch_chunk_gated_delta_rule`, handing both the keyword arguments of the model call
(`cu_seq_lens_q`, `longfit_documents`). Its own torch versions run each row as ONE sequence (its guard refuses
document boundaries without flash-linear-attention), so packed documents would leak state into each other.
`prepare_linear_attention` keeps transformers' projections and replaces the two kernels: it wraps the two
names in the layer's modeling module with entries that defer to transformers' own function unless the call
carries `longfit_linear_attention` (which only longfit's models pass: a forward pre-hook on each of their
linear-attention modules adds it), so a model longfit did not prepare runs exactly as before. The value is
the kernels object: `LocalLinearAttention` on one rank, the context-parallel one (parallel/linear.py) that
`parallelize` puts on the module as `longfit_context_parallel`, as it does for attention modules.

The convolution (kernel K, depthwise over the C = 2 Hk Dk + Hv Dv channels of q, k and v, then the activation):
    y[p] = act(bias + sum_{j=0..K-1} w[K-1-j] x[p-j]),   x[p-j] counted only when p-j is in p's document,
i.e. when j <= o[p], o[p] = p - start(document of p): the in-document offset. Every document restarts with
zero history, exactly what transformers computes for a document on its own (left zero padding). K shifted
multiply-adds, linear in L; the offsets come from the host layout. Under context parallelism the K-1 inputs
before a shard come from its neighbour as a halo and the offsets are the global ones.

The gated delta rule (per value head; S the Dk x Dv state, q and k L2-normalised, q scaled by Dk^-1/2):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t,
with S = 0 before the first token of every document. The chunked form (transformers' torch version, the
DeltaNet paper's WY/UT transform) splits the sequence into chunks of 64 tokens: inside a chunk everything is
matrix products and one triangular solve; across chunks only S is carried, in a loop over the chunks (linear
in L). To restart at documents without cutting a chunk in two, each document is laid out on its own whole
chunks: padded with zero tokens (k = v = 0, beta = 0, g = 0 leave S unchanged and their outputs are
dropped) to a multiple of 64, and S is set to zero before a chunk that starts a document:
    S <- keep_c S,  keep_c = 0 if chunk c starts a document else 1,
which is the recurrence above. The rows of a batch run side by side (each row's chunks padded to the
longest row's count). A single document gives transformers' own chunks, values and order of operations.

Spans: the state carried in. Both kernels also run on a span [s, e) of whole rows whose earlier tokens ran
before: the convolution on a rank's shard under context parallelism (parallel/linear.py, where the delta rule
runs head-split over whole rows instead) and both on a sequence tile of a tiled layer (memory/tiled_layers.py).
The convolution reads the K-1 inputs before s (the span's history, a halo) and, with the GLOBAL offsets
o[s..e), reads them only inside the document that crosses s; the gated delta rule starts from the state
S_{s-1} the earlier tokens left (`initial_state`) where the document of token s began before s, and from zero
where one starts at s (the first chunk's keep_0). Each returns what the next span needs: the K-1 inputs before
e and S_{e-1} (the padded slots after a row's last token leave S unchanged, so the state after its last chunk
is S_{e-1}). All of it is differentiable: the gradient of the state and of the history a span receives flows
back to the span that produced them. Spans run one after the other in the order of the sequence give the
values of the whole rows; only the chunk boundaries (and so the fp32 rounding) move.

On CUDA with flash-linear-attention installed (the `linear` extra), its chunk_gated_delta_rule runs
instead, documents as its `cu_seqlens` over the flattened rows (its varlen mode), a span's incoming state as
the `initial_state` of each row's first document; the convolution stays the torch one above (K = 4 shifted
adds). Its release must be 0.5.0 or later (`FLA_LEAST`): grouped value heads (more value than key heads, Qwen3.5's
48 over 16) came in 0.5.0, whose kernels read key head h // (Hv / Hk) for value head h, as the torch kernel repeats
them; 0.4.x take the head count from k and read v with the wrong stride, silently, so an older release is refused
(`check_flash_linear_attention`) where the model is prepared. Nothing of a call waits for the device: the batch's
cu_seqlens are one device tensor and one host tensor per layout (`DocumentLayout.starts_on`), handed to every layer
(flash-linear-attention derives its chunk indices from the host one, and caches them by the tensors' identity), and
the per-row indices into its sequences are made once per layout, copied from pinned memory (`host_to_device`).
The flash-linear-attention path is UNVERIFIED on a GPU (no GPU and no flash-linear-attention package were
available to this work).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

from longfit.config import ConfigError
from longfit.data.packing import DocumentLayout, Spans, device_cache, document_rows, host_to_device
from longfit.models.attention import batch_documents
from longfit.models.document_mixers import LINEAR_ATTENTION, find_document_mixers, prepare_document_mixers
from longfit.models.sparse_attention import indexed_attention_modules, untileable_indexed_attention
from longfit.models.structure import decoder_layers, unwrap_peft

CONV_KERNEL = "causal_conv1d_fn"
DELTA_RULE_KERNEL = "torch_chunk_gated_delta_rule"
KERNELS_KWARG = "longfit_linear_attention"
CHUNK = 64  # transformers' and flash-linear-attention's chunk size
FLA_LEAST = (0, 5, 0)  # flash-linear-attention's first release with grouped value heads (module docstring)


# ---- the convolution -------------------------------------------------------------------------------------


@device_cache(16)
def document_offsets(rows: Spans, length: int, device: torch.device) -> torch.Tensor:
    """(B, length) long on `device`: each token's offset from the start of its document (rows of [start, end)
    spans). Made on the host once per batch layout and device (every layer, and its recomputation, reuses it:
    no host-to-device copy per call)."""
    offsets = torch.empty(len(rows), length, dtype=torch.long)
    for b, docs in enumerate(rows):
        for start, end in docs:
            offsets[b, start:end] = torch.arange(end - start)
    return host_to_device(offsets, device)


def document_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    offsets: torch.Tensor, history: torch.Tensor | None = None,
) -> torch.Tensor:
    """The depthwise causal convolution restarting at every document (module docstring).

    x (B, C, n); weight (C, K); offsets (B, n) in-document offsets of x's tokens (on x's device); history
    (B, C, K-1): the inputs just before x (a halo; None: zeros). Returns (B, C, n) in x's dtype, computed in the
    weight's dtype as transformers does.
    """
    from transformers.activations import ACT2FN

    B, C, n = x.shape
    K = weight.shape[1]
    if history is None:
        history = x.new_zeros(B, C, K - 1)
    padded = torch.cat([history, x], dim=2).to(weight.dtype)  # (B, C, K-1+n)
    out = padded[:, :, K - 1 :] * weight[:, K - 1, None]
    for j in range(1, K):  # tap j reads x[p-j]
        visible = (offsets >= j).unsqueeze(1)  # (B, 1, n)
        out = out + padded[:, :, K - 1 - j : K - 1 - j + n] * weight[:, K - 1 - j, None] * visible
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def span_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    documents: DocumentLayout | None, length: int, start: int, history: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution of the span [start, start + n) of whole rows of `length` tokens (module docstring, "Spans").

    x (B, C, n) the span's inputs; documents: the whole rows' layout (None: one document per row); history
    (B, C, K-1): the inputs before the span (None: zeros). Returns the output (B, C, n) and the K-1 inputs before
    the span's end (the next span's history).
    """
    B, _, n = x.shape
    K = weight.shape[1]
    offsets = document_offsets(document_rows(documents, B, length), length, x.device)[:, start : start + n]
    if history is None:
        history = x.new_zeros(B, x.shape[1], K - 1)
    out = document_causal_conv(x, weight, bias, activation, offsets, history)
    inputs = torch.cat([history, x[:, :, max(0, n - (K - 1)) :]], dim=2)  # the last K-1 (or more) inputs
    return out, inputs[:, :, inputs.shape[2] - (K - 1) :]


# ---- the gated delta rule --------------------------------------------------------------------------------


@device_cache(16)
def _chunk_layout(
    rows: Spans, length: int, device: torch.device, continued: tuple[bool, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every document on whole chunks (module docstring), made on the host once per layout and put on `device`.
    `continued[b]`: row b's first document began before the row (a span's), so its first chunk keeps the state.

    Returns gather (B, T) long: the row position each padded slot reads (`length`: a zero token);
    restart (B, T / CHUNK) bool: the chunk starts a document; scatter (B, length) long: each token's slot.
    The chunks padding a row to the longest row's count keep the state (zero tokens leave it unchanged), so the
    state after the last chunk is the row's last token's.
    """
    gathers, restarts = [], []
    scatter = torch.empty(len(rows), length, dtype=torch.long)
    for b, docs in enumerate(rows):
        pieces, starts, slot = [], [], 0
        for index, (start, end) in enumerate(docs):
            chunks = -(-(end - start) // CHUNK)
            pieces += [torch.arange(start, end), torch.full((chunks * CHUNK - (end - start),), length)]
            starts += [not (index == 0 and continued and continued[b])] + [False] * (chunks - 1)
            scatter[b, start:end] = torch.arange(slot, slot + end - start)
            slot += chunks * CHUNK
        gathers.append(torch.cat(pieces))
        restarts.append(torch.tensor(starts))
    slots = max(len(g) for g in gathers)
    gather = torch.stack([F.pad(g, (0, slots - len(g)), value=length) for g in gathers])
    restart = torch.stack([F.pad(r, (0, slots // CHUNK - len(r)), value=False) for r in restarts])
    return host_to_device(gather, device), host_to_device(restart, device), host_to_device(scatter, device)


@functools.lru_cache(maxsize=64)
def _span_documents(rows: Spans, length: int, start: int, end: int) -> tuple[DocumentLayout, tuple[bool, ...]]:
    """The documents of the span [start, end) of whole rows of `length` tokens, in span coordinates, and whether
    each row's first one began before the span (its state comes in). Made once per layout and span."""
    spans, continued = [], []
    for docs in rows:
        inside = [(max(s, start) - start, min(e, end) - start) for s, e in docs if s < end and e > start]
        spans.append(tuple(inside))
        continued.append(any(s < start < e for s, e in docs))
    return DocumentLayout(tuple(spans), end - start), tuple(continued)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rows: Spans,
    use_qk_l2norm: bool, initial_state: torch.Tensor | None = None, continued: tuple[bool, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule restarting at every document (module docstring), in fp32.

    q, k (B, L, Hk, Dk); v (B, L, Hv, Dv); g (log decay, <= 0), beta (B, L, Hv); rows: each row's documents;
    initial_state (B, Hv, Dk, Dv): the state before each row, taken where `continued[b]` (module docstring,
    "Spans"; None: zeros). Returns the output (B, L, Hv, Dv) in q's dtype and the state after each row's last
    token (B, Hv, Dk, Dv) fp32.
    """
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    dtype = q.dtype
    if Hv != Hk:  # grouped values: each q/k head serves Hv / Hk consecutive value heads
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    gather, restart, scatter = _chunk_layout(rows, L, q.device, continued if initial_state is not None else None)
    rows_index = torch.arange(B, device=q.device)[:, None]

    def laid_out(t: torch.Tensor) -> torch.Tensor:  # (B, L, H, ...) -> (B, H, T, ...) fp32, zero slots added
        t = t.float()
        t = torch.cat([t, t.new_zeros(B, 1, *t.shape[2:])], dim=1)[rows_index, gather]
        return t.transpose(1, 2).contiguous()

    q, k, v, g, beta = (laid_out(t) for t in (q, k, v, g, beta))  # (B, H, T, D) / (B, H, T)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * Dk**-0.5
    T = q.shape[2]
    n = T // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(B, Hv, n, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(B, Hv, n, CHUNK).cumsum(dim=-1)  # log decay from the chunk start to each token
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, n, C, C)
    # The UT transform of the chunk's delta rule updates: (I + strictly-lower beta K K^T) u = beta V
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    within = (q @ k.transpose(-1, -2)) * pair_decay  # causal q.k inside the chunk, decayed
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q_read = q * cum.exp()[..., None]  # reads the chunk's incoming state
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]  # writes to the outgoing state
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1)
    keep = (~restart).to(q.dtype)[:, None, :, None, None]  # (B, 1, n, 1, 1): 0 where a document starts
    state = q.new_zeros(B, Hv, Dk, Dv) if initial_state is None else initial_state.float()
    out = []
    for c in range(n):
        state = state * keep[:, :, c]
        v_new = u[:, :, c] - w[:, :, c] @ state
        out.append(q_read[:, :, c] @ state + within[:, :, c] @ v_new)
        state = state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ v_new
    out = torch.stack(out, dim=2).reshape(B, Hv, T, Dv).transpose(1, 2)  # (B, T, Hv, Dv)
    return out[rows_index, scatter].to(dtype), state


def flash_linear_attention_version() -> tuple[int, ...] | None:
    """The installed flash-linear-attention's release (None: not installed), read without importing it."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        text = importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path: the module says
        text = getattr(importlib.import_module("fla"), "__version__", "0")
    found = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(x or 0) for x in found.groups()) if found else (0,)


def check_flash_linear_attention() -> None:
    """Refuse an installed flash-linear-attention older than FLA_LEAST (module docstring): on CUDA it would compute
    grouped value heads wrongly without a word."""
    version = flash_linear_attention_version()
    if version is not None and version < FLA_LEAST:
        least = ".".join(map(str, FLA_LEAST))
        raise ConfigError(
            f"flash-linear-attention {'.'.join(map(str, version))} is installed: before {least} its "
            "chunk_gated_delta_rule reads grouped value heads (more value than key heads, as Qwen3.5's) with the wrong "
            f"stride, silently: upgrade it (pip install -U 'flash-linear-attention>={least}', longfit's `linear` "
            "extra) or uninstall it (longfit then runs its torch kernel)"
        )


@functools.cache
def _fla_chunk_gated_delta_rule():
    """flash-linear-attention's chunk_gated_delta_rule when installed (FLA_LEAST or later: older ones are refused),
    else None."""
    if importlib.util.find_spec("fla") is None:
        return None
    check_flash_linear_attention()
    return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule


@device_cache(64)
def _row_sequences(rows: Spans, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(firsts, lasts), each (B,) long on `device`: the index of each row's first and last document among all the
    rows' documents in order (flash-linear-attention's sequences). Made on the host once per layout and device."""
    counts = torch.tensor([len(docs) for docs in rows])
    lasts = counts.cumsum(0) - 1
    return host_to_device(lasts - counts + 1, device), host_to_device(lasts, device)


@device_cache(64)
def _continued_rows(continued: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """(B, 1, 1, 1) fp32 on `device`: 1 where row b's first document began before it (its state comes in), else 0."""
    return host_to_device(torch.tensor(continued, dtype=torch.float32).view(-1, 1, 1, 1), device)


def _fla_gated_delta_rule(kernel, q, k, v, g, beta, documents: DocumentLayout | None, use_qk_l2norm: bool,
                          initial_state: torch.Tensor | None, continued: tuple[bool, ...] | None):
    """flash-linear-attention's kernel over (B, L, H, D) rows, documents as cu_seqlens of the flat rows (varlen); the
    state before each row enters as the initial state of the row's first document where `continued`, and the
    final state of each row's last document leaves (torch_gated_delta_rule's contract). q and k keep their Hk heads:
    the kernel serves Hv = g x Hk value heads itself (FLA_LEAST). Every index tensor is the layout's, made once."""
    B, L = q.shape[:2]
    if initial_state is not None:  # (B, Hv, Dk, Dv): a row that starts a document starts from zero
        initial_state = initial_state * _continued_rows(continued, initial_state.device).to(initial_state.dtype)
    if documents is None or documents.one_per_row:
        return kernel(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                      use_qk_l2norm_in_kernel=use_qk_l2norm)
    firsts, lasts = _row_sequences(documents.rows, q.device)
    if initial_state is not None:
        sequences = sum(len(docs) for docs in documents.rows)
        initial_state = initial_state.new_zeros(sequences, *initial_state.shape[1:]).index_copy(0, firsts, initial_state)
    flat = [t.reshape(1, B * L, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out, final = kernel(*flat[:3], g=flat[3], beta=flat[4], cu_seqlens=documents.starts_on(q.device, torch.int64),
                        cu_seqlens_cpu=documents.starts_on(torch.device("cpu"), torch.int64),
                        initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out.reshape(B, L, *out.shape[2:]), final[lasts]


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    documents: DocumentLayout | None, use_qk_l2norm: bool, initial_state: torch.Tensor | None = None,
    continued: tuple[bool, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of whole rows, restarting at every document: flash-linear-attention's kernel for CUDA
    fp16/bf16 inputs when installed (it refuses fp32), else `torch_gated_delta_rule`. Shapes, the state in and
    out as there; `documents` None: one document per row."""
    B, L = q.shape[:2]
    rows = document_rows(documents, B, L)  # refuses a layout of other rows, whichever kernel runs
    half = q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype  # its kernels' inputs
    kernel = _fla_chunk_gated_delta_rule() if q.is_cuda and half else None
    if kernel is not None:
        return _fla_gated_delta_rule(kernel, q, k, v, g, beta, documents, use_qk_l2norm, initial_state, continued)
    return torch_gated_delta_rule(q, k, v, g, beta, rows, use_qk_l2norm, initial_state, continued)


def span_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    documents: DocumentLayout | None, length: int, start: int, use_qk_l2norm: bool, state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of the span [start, start + n) of whole rows of `length` tokens (module docstring,
    "Spans"): q, k, v, g, beta the span's (B, n, ...); documents the whole rows' layout (None: one per row); state
    (B, Hv, Dk, Dv) after the token before the span (None: zeros). Returns the output and the state after the
    span's last token."""
    B, n = q.shape[:2]
    span, continued = _span_documents(document_rows(documents, B, length), length, start, start + n)
    return gated_delta_rule(q, k, v, g, beta, span, use_qk_l2norm, state, continued)


def linear_kernel_name(device: torch.device | str, dtype: torch.dtype) -> str:
    """What computes the gated delta rule on `device` for inputs in `dtype` (`gated_delta_rule`'s choice; the
    trainer's log)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if torch.device(device).type == "cuda" and half and _fla_chunk_gated_delta_rule() is not None:
        return "flash-linear-attention chunk_gated_delta_rule (varlen)"
    return "torch chunked gated delta rule"


# ---- the kernels object and the model's preparation ----------------------------------------------------


class LocalLinearAttention:
    """The kernels of a linear-attention layer on one rank: whole rows, the batch's document layout."""

    def conv(self, x, weight, bias, activation, documents: DocumentLayout | None) -> torch.Tensor:
        """x (B, C, L) -> (B, C, L)."""
        return span_causal_conv(x, weight, bias, activation, documents, x.shape[2], 0, None)[0]

    def delta_rule(self, q, k, v, g, beta, documents: DocumentLayout | None, use_qk_l2norm: bool) -> torch.Tensor:
        return gated_delta_rule(q, k, v, g, beta, documents, use_qk_l2norm)[0]


LOCAL = LocalLinearAttention()


def _documents(kwargs: dict, cu_seqlens: torch.Tensor | None, batch: int) -> DocumentLayout | None:
    return batch_documents(cu_seqlens, kwargs.get("longfit_documents"), batch)


def _conv_entry(transformers_conv):
    """The modeling module's `causal_conv1d_fn`, computed by longfit when the call carries its kernels."""

    @functools.wraps(transformers_conv)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        kernels = kwargs.get(KERNELS_KWARG)
        if kernels is None:
            return transformers_conv(hidden_states, weight, bias, activation=activation, **kwargs)
        documents = _documents(kwargs, kwargs.get("cu_seq_lens_q"), hidden_states.shape[0])
        return kernels.conv(hidden_states, weight, bias, activation, documents)

    causal_conv1d_fn.longfit_entry = True
    return causal_conv1d_fn


def _delta_rule_entry(transformers_rule):
    """The modeling module's `torch_chunk_gated_delta_rule`, computed by longfit when the call carries its kernels."""

    @functools.wraps(transformers_rule)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):
        kernels = kwargs.get(KERNELS_KWARG)
        if kernels is None:
            return transformers_rule(query, key, value, g, beta, *args, **kwargs)
        if args or kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError(
                "longfit's linear-attention kernels compute training forwards: no cache, initial_state or "
                "output_final_state (set use_cache=False)"
            )
        documents = _documents(kwargs, kwargs.get("cu_seqlens"), query.shape[0])
        use_qk_l2norm = bool(kwargs.get("use_qk_l2norm_in_kernel", False))
        return kernels.delta_rule(query, key, value, g, beta, documents, use_qk_l2norm), None

    torch_chunk_gated_delta_rule.longfit_entry = True
    return torch_chunk_gated_delta_rule


def _install_entries(modeling) -> None:
    """Wrap the two kernel names of a transformers modeling module (idempotent; inert without longfit's kwarg)."""
    for name, entry in ((CONV_KERNEL, _conv_entry), (DELTA_RULE_KERNEL, _delta_rule_entry)):
        current = getattr(modeling, name)
        if not getattr(current, "longfit_entry", False):
            setattr(modeling, name, entry(current))


def _pass_kernels(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the module's kernels (context-parallel when `parallelize` set them) join the call."""
    return args, {**kwargs, KERNELS_KWARG: getattr(module, "longfit_context_parallel", None) or LOCAL}


def forget_layouts() -> None:
    """Drop the layouts made on the host for earlier batches (document offsets, chunk layouts, spans, rows). The
    planner traces each length from none (plan/layer_trace.py): a layout kept from another length would be found
    or evicted in the middle of a traced layer, and its tensors counted with that layer or not by the order of the
    lengths (Qwen3.5-27B's tiled layer saved 16,898, 33,796 and 44,544 bytes at 1,856, 3,712 and 5,568 tokens in
    29 tiles, 9.1 a token from none: #52)."""
    for cached in (document_offsets, _chunk_layout, _span_documents, _row_sequences, _continued_rows):
        cached.cache_clear()


def linear_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The token mixers of the model's linear-attention layers (`config.layer_types`), in layer order
    (`linear_attention_layers`)."""
    return list(linear_attention_layers(model).values())


def linear_attention_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The token mixer of each linear-attention layer of the model (`config.layer_types`), by decoder layer index.

    In such a layer the mixer is the child module that owns the short convolution (`conv1d`); its class's
    modeling module names transformers' two kernels (another linear-attention layer's mixer runs per document:
    models/document_mixers.py).
    transformers < 5.15 (Qwen3.5 came in 5.2) kept the kernels on the layer instance instead: refused.
    """
    config = unwrap_peft(model).config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    if LINEAR_ATTENTION not in types:
        return {}
    mixers = {}
    for index, layer in enumerate(decoder_layers(model)):
        if types[index] != LINEAR_ATTENTION:
            continue
        found = [child for child in layer.children() if isinstance(getattr(child, "conv1d", None), nn.Conv1d)]
        modeling = sys.modules[type(found[0]).__module__] if len(found) == 1 else None
        if modeling is not None and hasattr(found[0], "chunk_gated_delta_rule"):
            raise ConfigError(
                f"decoder layer {index}'s {type(found[0]).__name__} picks its kernels itself (transformers < 5.15), out "
                f"of longfit's reach: upgrade transformers to 5.15 or later (pip install -U transformers)"
            )
        if modeling is None or not all(callable(getattr(modeling, name, None)) for name in (CONV_KERNEL, DELTA_RULE_KERNEL)):
            continue  # not a Gated DeltaNet: its mixer runs per document (models/document_mixers.py) or is refused there
        mixers[index] = found[0]
    return mixers


def untileable_layers(model: nn.Module) -> str | None:
    """Why tiled layers cannot run `model`: its first layer with a per-document mixer (models/document_mixers.py: a
    sequence tile cuts documents), its sparse indexed attention (models/sparse_attention.py), or its last layers
    attending to an earlier layer's keys and values (num_kv_shared_layers: Gemma 3n's and Gemma 4's; a tile computes
    only its own keys); None when they can. `memory.switches.resolve_memory_switches` decides `auto` with it, and
    the planner reads it off the model it counts (`plan.shapes.counted_parameters`)."""
    for index, mixers in find_document_mixers(model, linear_attention_modules(model)).items():
        return f"decoder layer {index}'s {type(mixers[0]).__name__} runs per document, and a sequence tile cuts documents"
    for module in indexed_attention_modules(model):
        return untileable_indexed_attention(module.config.model_type)
    shared = getattr(unwrap_peft(model).config.get_text_config(), "num_kv_shared_layers", 0)
    if shared:
        return (f"its last {shared} layers attend to the keys and values of an earlier layer (num_kv_shared_layers), "
                "and a tile computes only its own keys")
    return None


def prepare_linear_attention(model: nn.Module) -> int:
    """Route every linear-attention layer of `model` through longfit's kernels; returns how many there are. Where
    CUDA runs them, an installed flash-linear-attention older than FLA_LEAST is refused here, before anything runs.
    Any other token mixer with a convolution over the sequence (Mamba, LFM2's short convolution) runs per document
    (models/document_mixers.py)."""
    mixers = linear_attention_modules(model)
    prepare_document_mixers(model, mixers)
    if mixers and torch.cuda.is_available():
        check_flash_linear_attention()
    for mixer in mixers:
        _install_entries(sys.modules[type(mixer).__module__])
        if not getattr(mixer, "longfit_kernels_hooked", False):
            mixer.register_forward_pre_hook(_pass_kernels, with_kwargs=True)
            mixer.longfit_kernels_hooked = True
    return len(mixers)
