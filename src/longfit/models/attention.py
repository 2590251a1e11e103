"""longfit's attention function, registered with transformers' AttentionInterface as "longfit".

transformers hands a custom attention function no mask at all (not even padding), so causality,
sliding windows and document boundaries are this module's job, and nothing quadratic in L is ever built:
- one document per row (no documents passed, or a layout of one document per row): on Hopper with the
  flash-attn 3 package installed its kernel, else the fused causal SDPA kernel (`is_causal=True`, GQA
  through `enable_gqa`), whose backend PyTorch picks: cuDNN on Hopper/Blackwell where PyTorch trusts the
  bundled cuDNN (torch >= 2.10 with cuDNN > 9.15, i.e. the torch 2.11 wheels), else FlashAttention-2;
  PyTorch's own guards stay in force;
- packed documents: flash-attn's varlen kernel on CUDA when installed (3 on Hopper, else 2), else one causal
  SDPA call per document, which has a backward on every device. The model call describes them twice: as
  transformers' flash-attn convention `cu_seq_lens_q` (a tensor of document starts over the flattened B x L
  tokens) and as `longfit_documents` (longfit.data.packing.DocumentLayout: the same on the host, made once
  per batch where the batch is made). transformers' model bodies hand both keywords, untouched, through
  every decoder layer to this function (`**kwargs` in transformers 5). Every decision below is taken on the
  host from the layout, so no layer waits for the device; reading `cu_seq_lens_q` at every layer would
  synchronise with it each time. A caller that passes the tensor alone (transformers' convention) still
  works: the layout is then read from it at each call (`batch_documents`);
- sliding-window layers (transformers passes `sliding_window=W` on local layers, None on global ones:
  query i sees keys i - W < j <= i of its own document): blockwise.py's exact window, about L x W scores
  per document instead of L^2 / 2, the kernel's own window argument on CUDA;
- context parallelism: `parallelize` puts a callable on each attention module as
  `longfit_context_parallel`; the call is routed there with the same arguments.
One dtype reaches every kernel (`kernel_dtype`): the entry casts q, k and v to autocast's dtype when autocast
is on for their device, else to their common promoted dtype. Under autocast over fp32 weights (one GPU, full
fine-tuning) q and k leave the rotary embedding in fp32 (its cos/sin follow the fp32 embedding output) while
v leaves its projection in bf16; SDPA casts such inputs itself, but the block kernels, the ring, Ulysses and
tiled layers call aten's kernels directly, and CUDA's memory-efficient kernel reads v's buffer in q's type.
Casting at the entry also makes the kernel that runs the one chosen for the compute dtype (FlashAttention
and cuDNN need 16-bit inputs), which is the dtype `attention_kernel_name` is asked about.
Attention-logit softcapping (Gemma 2), attention sinks (gpt-oss) and a value head size unlike the query's
(DeepSeek-V3's multi-head latent attention) take the blockwise path on one device and in every context-parallel
method, exactly (the derivations are in kernels.py), with one exception (`capped_by_flash_attn`): where an installed
flash-attn caps scores itself, forward and backward (its `softcap` argument, from 2.6.2), a softcapped layer of one
device or one Ulysses rank runs in its varlen kernel, window and documents included, which computes the same cap
inside the kernel. Chunked attention (Llama 4) is causal attention inside each chunk of each document: its chunks
are documents (`layer_documents`). Layers may differ in head size (Gemma 4's global layers; `layer_configs`).
Anything longfit cannot compute exactly (bidirectional attention, Llama 4's temperature tuning past floor_scale on
packed rows, shards or tiles, dropout, a mask) is refused rather than silently ignored. `attention_kernel_name`
names the kernel these rules pick (the trainer logs it, `longfit bench gpu` reports it). The flash-attn paths are
UNVERIFIED on a GPU (no GPU and no flash-attn package were available to this work).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import weakref

import torch
import torch.nn.functional as F

from longfit.config import ConfigError
from longfit.data.packing import DocumentLayout, document_rows
from longfit.models.blockwise import Segment, block_attention, plan_blocks
from longfit.models.kept_attention import keeper_active
from longfit.models.kernels import (
    block_kernel_name,
    check_self_attention,
    has_window_kernel,
)

ATTENTION_NAME = "longfit"


def kernel_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype the attention kernels get for q, k, v: autocast's when it is on for their device (as SDPA
    would cast them), else the dtype all three promote to."""
    device_type = q.device.type
    if torch.amp.autocast_mode.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, L, D) -> (B, H, L, D); causal, GQA without copying K/V heads. Meta tensors (the
    planner's layer traces) stand for CPU tensors, as in the block kernels (kernels.py): SDPA's composite takes its
    math kernel on the meta device, holding the (L, L) scores, so they run the CPU's flash kernel by name where the
    CPU would choose it (`_cpu_chooses_flash`), with the same autograd node and saved tensors."""
    gqa = k.shape[1] != q.shape[1]
    if q.device.type == "meta" and _cpu_chooses_flash(q, k, v, gqa):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _cpu_chooses_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """Whether causal SDPA of CPU tensors like q, k, v runs the CPU's flash kernel: PyTorch's choice
    (`torch._fused_sdp_choice`) for one-token stand-ins of their batch, heads, head sizes and dtypes; the choice reads
    of the sequence only that it is not empty and of the layout only the last dimension's stride, checked here."""
    from torch.nn.attention import SDPBackend

    if any(t.shape[-2] == 0 or t.stride(-1) != 1 for t in (q, k, v)):
        return False
    stand_ins = [torch.empty((*t.shape[:-2], 1, t.shape[-1]), dtype=t.dtype, device="cpu") for t in (q, k, v)]
    return torch._fused_sdp_choice(*stand_ins, None, 0.0, True, enable_gqa=gqa) == SDPBackend.FLASH_ATTENTION.value


@functools.cache
def _flash_attn_varlen(capability: tuple[int, int], capped: bool = False):
    """(name, flash_attn_varlen_func) of the installed flash-attn package for a GPU of `capability`, or None.

    flash-attn 3 (module `flash_attn_interface`) runs on Hopper only; flash-attn 2 on Ampere and newer. `capped`: for
    softcapped scores, flash-attn 2 even where flash-attn 3 is installed (the one that caps, `capped_by_flash_attn`).
    """
    if not capped and capability[0] == 9 and importlib.util.find_spec("flash_attn_interface") is not None:
        return "flash-attn 3", importlib.import_module("flash_attn_interface").flash_attn_varlen_func
    if capability >= (8, 0) and importlib.util.find_spec("flash_attn") is not None:
        return "flash-attn 2", importlib.import_module("flash_attn").flash_attn_varlen_func
    return None


def _flash_varlen(q: torch.Tensor, capped: bool = False):
    """The flash-attn varlen kernel for q, when installed and q is a CUDA fp16/bf16 tensor; else None. `capped`: the
    one for softcapped scores (`_flash_attn_varlen`)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return _flash_attn_varlen(torch.cuda.get_device_capability(q.device), capped)


def _flash_varlen_attention(
    q, k, v, starts: torch.Tensor, max_len: int, scale: float | None, kernel, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-document causal attention of (B, H, L, D) q and (B, Hkv, L, D) k/v through a flash-attn varlen kernel;
    `starts` (n_docs + 1,) int32 on q's device. `window`: keys i - window < j <= i (flash-attn's window_size
    (window - 1, 0)); `softcap`: the kernel caps every score (c tanh(s / c), s already scaled)."""
    B, H, L, D = q.shape

    def flat(t: torch.Tensor) -> torch.Tensor:  # (B, h, L, D) -> (B*L, h, D)
        return t.transpose(1, 2).reshape(B * L, t.shape[1], D)

    # Passed only when set: flash-attn before 2.6 has no `softcap` argument, and both default to off.
    variant = ({"window_size": (window - 1, 0)} if window is not None else {}) | (
        {"softcap": softcap} if softcap is not None else {})
    out = kernel(flat(q), flat(k), flat(v), starts, starts, max_len, max_len, softmax_scale=scale, causal=True,
                 **variant)
    out = out[0] if isinstance(out, tuple) else out  # some flash-attn 3 releases also return the logsumexp
    return out.reshape(B, L, H, D).transpose(1, 2)


def _flash_path(q: torch.Tensor, documents: DocumentLayout | None, flash) -> bool:
    """Whether `local_attention` runs an uncapped call in flash-attn's varlen kernel (`flash`: `_flash_varlen(q)`)."""
    return flash is not None and (flash[0] == "flash-attn 3" or (documents is not None and not documents.one_per_row))


def needs_blocks(
    q: torch.Tensor, v: torch.Tensor, window: int | None, softcap: float | None, sinks: torch.Tensor | None
) -> bool:
    """Whether a call takes the blockwise path rather than one causal kernel: a sliding window, a cap on the
    scores, attention sinks (which need the logsumexp) or a value head size unlike the query's (which SDPA's
    fused kernels do not take); the block kernels serve each of them exactly."""
    return window is not None or softcap is not None or sinks is not None or q.shape[-1] != v.shape[-1]


# flash-attn 2.6.0 and 2.6.1 cap scores in the forward only (their backward ignores the cap: Dao-AILab/flash-attention
# #1065); 2.6.2 caps both. flash-attn 3 is never asked for capped scores (its backward has no cap): where both are
# installed, capped layers take flash-attn 2 (`_flash_varlen(q, capped=True)`).
SOFTCAP_BACKWARD = (2, 6, 2)


def flash_attn_release(flash) -> tuple[str, tuple[int, ...]] | None:
    """(name, version) of the package behind `_flash_varlen`'s answer `flash` (None: none); the version of flash-attn 2
    only (the one chosen for capped scores), () for flash-attn 3."""
    if flash is None:
        return None
    if flash[0] != "flash-attn 2":
        return flash[0], ()
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", importlib.import_module("flash_attn").__version__)
    return flash[0], tuple(int(x) for x in found.groups()) if found else ()


def capped_by_flash_attn(release, qk_width: int, value_width: int, sinks: bool) -> bool:
    """Whether a softcapped call on one device (one process, a Ulysses rank) runs in flash-attn's varlen kernel with its
    `softcap` argument. `release`: `flash_attn_release` for the call's device and dtype (None where flash-attn does not
    run: CPU, fp32, older GPUs, not installed). Chosen where flash-attn 2 caps forward and backward (SOFTCAP_BACKWARD),
    on query and value heads of one width up to 256 (its widest), without sinks (they need a logsumexp that flash-attn
    returns without a gradient); else longfit's capped block kernel, as always under the ring, whose blocks merge by
    logsumexp."""
    return (
        release is not None and release[0] == "flash-attn 2" and release[1] >= SOFTCAP_BACKWARD and not sinks
        and qk_width == value_width <= 256
    )


def batch_documents(
    cu_seq_lens_q: torch.Tensor | None, documents: DocumentLayout | None, batch: int
) -> DocumentLayout | None:
    """The document layout of a model call of `batch` rows: `documents` (`longfit_documents`) when given, else read
    from `cu_seq_lens_q` on the host (a device synchronisation on CUDA, at every call: callers that care pass the
    layout, as `CausalLMLoss` does); None: one document per row."""
    if documents is not None or cu_seq_lens_q is None:
        return documents
    return DocumentLayout.from_cu_seqlens(cu_seq_lens_q, batch)


_CALL_DOCUMENTS: dict[int, tuple[weakref.ref, DocumentLayout]] = {}
"""The document layout of a model call, by the id of its position_ids tensor (`remember_documents`): a tensor is no
dictionary key (its == compares elements), so the entry holds a weak reference to check it is that tensor, and goes
when the tensor does."""


def remember_documents(position_ids: torch.Tensor, documents: DocumentLayout | None) -> None:
    """Remember `documents` as the layout of the model call given `position_ids`, for attention modules that get the
    call's position_ids but not its `cu_seq_lens_q` / `longfit_documents`: StableLM's and Nemotron's decoder layers
    call their attention without the keyword arguments they were given, so those never reach the attention function,
    while position_ids, passed by name, do. Kept as long as the tensor lives: the step's recomputation (activation
    checkpointing) passes the same tensor again. None (one document per row) forgets what an earlier call given the
    same tensor remembered: this call's rows are whole documents."""
    key = id(position_ids)
    if documents is None:
        _CALL_DOCUMENTS.pop(key, None)
        return
    _CALL_DOCUMENTS[key] = (weakref.ref(position_ids), documents)
    weakref.finalize(position_ids, _CALL_DOCUMENTS.pop, key, None)


def call_documents(
    cu_seq_lens_q: torch.Tensor | None, documents: DocumentLayout | None, position_ids, batch: int
) -> DocumentLayout | None:
    """The document layout of an attention call of `batch` rows (`batch_documents`); where the call got neither
    keyword, the layout remembered for its `position_ids` (`remember_documents`); None: one document per row."""
    found = batch_documents(cu_seq_lens_q, documents, batch)
    if found is None and isinstance(position_ids, torch.Tensor):
        tensor, documents = _CALL_DOCUMENTS.get(id(position_ids), (None, None))
        return documents if tensor is not None and tensor() is position_ids else None
    return found


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentLayout, scale: float | None
) -> torch.Tensor:
    """Exact per-document causal attention over packed rows.

    q (B, H, L, D), k/v (B, Hkv, L, D); `documents` the rows' layout, every row boundary being a document
    boundary. Returns (B, H, L, D).
    """
    B, H, L, D = q.shape
    rows = document_rows(documents, B, L)
    flash = _flash_varlen(q)
    if flash is not None:
        return _flash_varlen_attention(q, k, v, documents.starts_on(q.device), documents.longest, scale, flash[1])
    pieces = [
        causal_attention(*(t[row : row + 1, :, start:end] for t in (q, k, v)), scale)
        for row, docs in enumerate(rows)
        for start, end in docs
    ]
    # The pieces tile the flattened B*L tokens in order: (1, H, B*L, D) -> (H, B, L, D) -> (B, H, L, D)
    return torch.cat(pieces, dim=2).view(H, B, L, D).transpose(0, 1)


def blockwise_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, documents: DocumentLayout | None,
    window: int | None, softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Exact causal attention of q (B, H, L, D) over k (B, Hkv, L, D), v (B, Hkv, L, Dv) from blockwise.py's
    blocks, per document: keys i - window < j <= i (window None: j <= i), scores capped at `softcap`, the
    attention `sinks` (H,) merged into the result (kernels.py)."""
    B, _, L, D = q.shape
    row = [Segment(0, L, 0)]
    prefixes, bidirectional = (documents.prefixes, documents.bidirectional) if documents is not None else (None, None)
    plan = plan_blocks(row, row, document_rows(documents, B, L, shared_prompts=True), window, prefixes, bidirectional)
    return block_attention(q, k, v, plan, D**-0.5 if scale is None else scale, softcap, sinks)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    documents: DocumentLayout | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of whole rows on one device: (B, H, L, D) q, (B, Hkv, L, D) k, (B, Hkv, L, Dv) v
    -> (B, H, L, Dv).

    `documents` packs documents (None: one per row); `window` is the layer's sliding window (None: global);
    `softcap` the attention-logit cap, `sinks` (H,) the attention sinks (kernels.py). Queries and keys are
    the same tokens: there is no key/value cache in training.
    """
    check_self_attention(q, k, v, "longfit")
    B, _, L, _ = q.shape
    document_rows(documents, B, L, shared_prompts=True)  # refuses a layout of other rows, whichever kernel runs
    if documents is not None and (documents.prefixes is not None or documents.bidirectional is not None):
        # answers sharing a prompt, Gemma 3's images attending both ways: blockwise.py's blocks
        return blockwise_attention(q, k, v, scale, documents, window, softcap, sinks)
    flash = _flash_varlen(q)
    if softcap is not None:
        capped = _flash_varlen(q, capped=True)
        if capped_by_flash_attn(flash_attn_release(capped), q.shape[-1], v.shape[-1], sinks is not None):
            layout = documents or DocumentLayout.one_document_per_row(B, L)
            return _flash_varlen_attention(q, k, v, layout.starts_on(q.device), layout.longest, scale, capped[1],
                                           window, softcap)
    if needs_blocks(q, v, window, softcap, sinks) or (keeper_active() and not _flash_path(q, documents, flash)):
        # A kept layer's attention (kept_attention.py) needs the logsumexp, which the block engine returns.
        return blockwise_attention(q, k, v, scale, documents, window, softcap, sinks)
    if documents is not None and not documents.one_per_row:
        return packed_attention(q, k, v, documents, scale)
    if flash is not None and flash[0] == "flash-attn 3":
        starts = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=q.device)
        return _flash_varlen_attention(q, k, v, starts, L, scale, flash[1])
    return causal_attention(q, k, v, scale)


# The operators of the attention kernels as the profiler names them, with the names `attention_kernel_name`
# uses: what a profile of a step says ran. flash-attn >= 2.6 registers its own operators; flash-attn 3's names
# are not known here, so a profile of it finds none (`longfit bench gpu` then shows the predicted name).
ATTENTION_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "SDPA cuDNN",
    "aten::_scaled_dot_product_flash_attention": "SDPA FlashAttention-2",
    "aten::_scaled_dot_product_efficient_attention": "SDPA memory-efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "SDPA CPU flash",
    "aten::_scaled_dot_product_attention_math": "SDPA math",
    "aten::_flash_attention_forward": "FlashAttention-2 window (aten)",
    "flash_attn::_flash_attn_varlen_forward": "flash-attn 2 varlen",
    "flash_attn::_flash_attn_forward": "flash-attn 2",
}


def kernels_in_profile(events) -> list[str]:
    """The attention kernels among profiled operator events (`torch.profiler.profile().events()`), each once, in order
    of first appearance. An operator called by another attention operator is that one's part, not a kernel of its
    own: on CUDA, SDPA's FlashAttention-2 calls `aten::_flash_attention_forward`, the window kernel's operator."""

    def inside_another(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in ATTENTION_OPS:
                return True
            parent = parent.cpu_parent
        return False

    ran = (ATTENTION_OPS[e.name] for e in events if e.name in ATTENTION_OPS and not inside_another(e))
    return list(dict.fromkeys(ran))


def _sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The backend `causal_attention` runs for tensors like q, k, v: PyTorch's own dispatch decision."""
    from torch.nn.attention import SDPBackend

    backend = SDPBackend(torch.ops.aten._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=k.shape[1] != q.shape[1]))
    if q.device.type == "cpu":
        return "SDPA CPU flash" if backend == SDPBackend.FLASH_ATTENTION else f"SDPA {backend.name.lower()} (CPU)"
    names = {SDPBackend.FLASH_ATTENTION: "FlashAttention-2", SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
             SDPBackend.CUDNN_ATTENTION: "cuDNN"}
    return f"SDPA {names.get(backend, backend.name.lower())}"


def _kernel_name(
    heads: int, kv_heads: int, widths: tuple[int, int], kinds: set[str], device: torch.device, dtype: torch.dtype,
    packed: bool, cp_method: str | None,
) -> str:
    """The kernel of layers of one head shape, (query/key, value) head `widths`, and of the layer `kinds` among them
    ("sliding", "chunked", "sinks")."""
    qk_width, value_width = widths
    # The block kernels take one head width: values narrower than queries are zero-padded to it (kernels.py).
    blocks = block_kernel_name(torch.empty(1, heads, 128, max(widths), dtype=dtype, device=device))
    notes = ("; sinks merged into the blocks' logsumexp" if "sinks" in kinds else "") + (
        f"; values zero-padded from {value_width} to {qk_width}" if value_width != qk_width else "")
    if cp_method == "ring":
        return f"ring over {blocks}{notes}"
    q, k = (torch.empty(1, 128, h, qk_width, dtype=dtype, device=device).transpose(1, 2) for h in (heads, kv_heads))
    flash = _flash_varlen(q)
    if "sinks" in kinds or value_width != qk_width:  # `needs_blocks`: every call of these layers
        name = f"blockwise over {blocks}"
        if "sliding" in kinds:
            window = "FlashAttention-2 window (aten)" if value_width == qk_width and has_window_kernel(q) else name
            name += f"; sliding-window layers: {window}"
        name += notes
    else:
        if flash is not None and (packed or flash[0] == "flash-attn 3"):
            name = f"{flash[0]} varlen"
        else:
            name = _sdpa_backend(q, k, k) + (", one call per document" if packed else "")
        if "chunked" in kinds:
            chunks = f"{flash[0]} varlen" if flash is not None else f"{_sdpa_backend(q, k, k)}, one call per chunk"
            name += f"; chunked-attention layers: {chunks}"
        if "sliding" in kinds:
            window = "FlashAttention-2 window (aten)" if has_window_kernel(q) else f"blockwise over {blocks}"
            name += f"; sliding-window layers: {window}"
    return f"ulysses over {name}" if cp_method == "ulysses" else name


def capped_kernel_name(release, widths: tuple[int, int], sinks: bool, cp_method: str | None) -> str:
    """The kernel of softcapped layers: flash-attn's varlen kernel with its cap where `capped_by_flash_attn` chooses it
    (`release`: `flash_attn_release` for the device and dtype; never under the ring), else longfit's capped block
    kernel."""
    if cp_method != "ring" and capped_by_flash_attn(release, *widths, sinks):
        name = f"{release[0]} varlen with softcap"
    else:
        name = "softcapped blocks (longfit's block kernel)"
    return f"{cp_method} over {name}" if cp_method else name


def layer_widths(layer_config, head_dim: int) -> tuple[int, int]:
    """(query/key, value) head widths of a layer: multi-head latent attention's (DeepSeek-V2/V3, Kimi: the query/key
    heads qk_nope_head_dim + qk_rope_head_dim wide, the value heads v_head_dim) where the config has them, else
    `head_dim` twice."""
    value = getattr(layer_config, "v_head_dim", None)
    nope, rope = (getattr(layer_config, name, None) for name in ("qk_nope_head_dim", "qk_rope_head_dim"))
    if value is None or nope is None or rope is None:
        return head_dim, head_dim
    return nope + rope, value


def attention_sink_layers(model: torch.nn.Module) -> frozenset[int]:
    """The indices of the decoder layers whose attention has sinks. No config key says so: every transformers model
    with sinks keeps them as its attention module's `sinks` parameter, which it passes as `s_aux`."""
    from longfit.models.structure import decoder_layers

    return frozenset(
        index for index, layer in enumerate(decoder_layers(model))
        if any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in layer.modules())
    )


def attention_kernel_name(
    config, device: torch.device | str, dtype: torch.dtype, packed: bool = False, cp_method: str | None = None,
    sink_layers: frozenset[int] = frozenset(),
) -> str:
    """The attention kernel longfit runs for a model of HF text `config` on `device` in `dtype`.

    `packed`: rows hold several documents; `cp_method`: "ring" or "ulysses" under context parallelism (None:
    none); `sink_layers`: the layers with attention sinks (`attention_sink_layers`). Decided by the same rules as the
    attention itself, on small probe tensors of each layer's head shape; a model whose layers differ in head shape
    (Gemma 4's wider global layers) gets one name per head size.
    """
    device = torch.device(device)
    types = getattr(config, "layer_types", None)
    shapes: dict[tuple[int, int, tuple[int, int]], set[str]] = {}  # (heads, kv_heads, widths) -> kinds of its layers
    for index, layer in enumerate(layer_configs(config)):
        heads, kv_heads, head_dim = layer_head_shape(layer)
        kinds = shapes.setdefault((heads, kv_heads, layer_widths(layer, head_dim)), set())
        if getattr(config, "sliding_window", None) and (types is None or types[index] == "sliding_attention"):
            kinds.add("sliding")
        if types is not None and types[index] == "chunked_attention":
            kinds.add("chunked")
        if index in sink_layers:
            kinds.add("sinks")
    capped = bool(getattr(config, "attn_logit_softcapping", None))

    def name_of(heads: int, kv_heads: int, widths: tuple[int, int], kinds: set[str]) -> str:
        if capped:
            flash = _flash_varlen(torch.empty(1, heads, 128, widths[0], dtype=dtype, device=device), capped=True)
            return capped_kernel_name(flash_attn_release(flash), widths, "sinks" in kinds, cp_method)
        return _kernel_name(heads, kv_heads, widths, kinds, device, dtype, packed, cp_method)

    names = {shape: name_of(*shape, kinds) for shape, kinds in shapes.items()}
    if len(names) == 1:
        return next(iter(names.values()))
    return "; ".join(f"layers of head size {widths[0]}: {name}" for (_, _, widths), name in names.items())


def longfit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    longfit_documents: DocumentLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface entry point: (B, H, L, D) inputs -> ((B, L, H, Dv) output, no weights).

    `softcap` caps the attention logits (Gemma 2), `s_aux` are the attention sinks (gpt-oss), both exact
    (kernels.py). `longfit_documents` is the host layout of `cu_seq_lens_q` (module docstring); with it the
    tensor is not read. A call with neither gets the layout remembered for its `position_ids` (`call_documents`).
    """
    if attention_mask is not None:
        raise ConfigError(
            "longfit attention takes no attention_mask: describe packed documents with position_ids and "
            "cu_seq_lens_q instead of padding masks"
        )
    if not getattr(module, "is_causal", True):
        raise ConfigError(
            f"{type(module).__name__} attends bidirectionally (e.g. use_bidirectional_attention=true); longfit trains "
            "causal language models only"
        )
    if dropout:
        raise ConfigError(f"attention dropout ({dropout}) is not supported (it draws random masks): train with "
                          "train.disable_dropout=true, the default, or the config's attention_dropout / attn_pdrop at 0")
    dtype = kernel_dtype(query, key, value)
    query, key, value = (t.to(dtype) for t in (query, key, value))  # (B, h, L, D), each in `dtype`
    documents = call_documents(cu_seq_lens_q, longfit_documents, kwargs.get("position_ids"), query.shape[0])
    context_parallel = getattr(module, "longfit_context_parallel", None)
    # Rows of the GLOBAL length: a context-parallel hook holds 1 / cp_size of them (a tiled layer passes its layout).
    length = documents.length if documents is not None else query.shape[2] * getattr(context_parallel, "cp_size", 1)
    check_temperature_tuning(module, documents, query.shape[2], length)
    documents = layer_documents(module, documents, query.shape[0], length)
    if context_parallel is not None:
        out = context_parallel(
            query, key, value, scale=scaling, documents=documents, window=sliding_window, softcap=softcap, sinks=s_aux
        )
    else:
        out = local_attention(query, key, value, scaling, documents, sliding_window, softcap, s_aux)
    return out.transpose(1, 2).contiguous(), None  # (B, L, H, D), contiguous as transformers' own (JetMoE views it)


def layer_kind(module: torch.nn.Module) -> str | None:
    """The attention module's layer type from its config (`layer_types[layer_idx]`), None where there is none."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    return kinds[index] if kinds is not None and index is not None and index < len(kinds) else None


def layer_configs(config) -> list:
    """Each decoder layer's view of HF text `config`: transformers' per-layer configs where the config varies by layer
    (a heterogeneous config, e.g. Gemma 4's global layers with their own head size, whose global `head_dim` raises),
    else `config` itself for every layer (transformers before the per-layer configs included)."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * config.num_hidden_layers


def layer_head_shape(layer_config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a layer of `layer_config` (a `layer_configs` entry)."""
    heads = layer_config.num_attention_heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads


def _layer_config(module: torch.nn.Module):
    """The attention module's layer view of its config (`layer_configs`)."""
    config, index = module.config, module.layer_idx
    return config.per_layer_config[index] if getattr(config, "is_heterogeneous", False) else config


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (`layer_types` says "chunked_attention": Llama 4's RoPE layers), None
    on other layers. transformers passes no chunk size to the attention function (it builds a mask instead), so it
    is read off the layer's config, `attention_chunk_size`."""
    if layer_kind(module) != "chunked_attention":
        return None
    return int(_layer_config(module).attention_chunk_size)


def layer_documents(
    module: torch.nn.Module, documents: DocumentLayout | None, batch: int, length: int
) -> DocumentLayout | None:
    """The spans a layer's attention keeps apart in `batch` rows of `length` (GLOBAL) tokens: the `documents` (None:
    one per row), each cut into its chunks on a chunked-attention layer.

    Chunked attention lets token i see key j iff both lie in the same chunk of `attention_chunk_size` positions and
    j <= i: causal attention inside each chunk, i.e. each chunk is a document of its own. Chunks count from each
    document's start, as they do for a document alone (its position_ids), so packed rows match their documents run
    one by one. Every attention path (the kernels per document, the ring's and the tiled layers' block plans,
    Ulysses' local attention) then keeps chunks apart the way it keeps documents apart: by blocks, never a mask.

    Bidirectional spans that hold on sliding-window layers only (Gemma 4's images, `DocumentLayout.global_layout`)
    are left out on the other layers, as transformers' Gemma 4 builds its global layers' mask causal.
    """
    if documents is not None and documents.global_layout is not None and layer_kind(module) != "sliding_attention":
        documents = documents.global_layout
    chunk = attention_chunk(module)
    if chunk is None:
        return documents
    return (documents or DocumentLayout.one_document_per_row(batch, length)).chunked(chunk)


def check_temperature_tuning(
    module: torch.nn.Module, documents: DocumentLayout | None, seen: int, length: int
) -> None:
    """Refuse Llama 4's attention temperature tuning where it is not exact.

    On its NoPE layers (`attn_temperature_tuning`, `use_rope` false) Llama4TextAttention scales each query by
    1 + attn_scale log(1 + floor((n + 1) / floor_scale)) with n the token's index among the `seen` tokens the layer
    was called with (a local arange), not its position (position_ids): the index and the position agree only on
    one process over whole rows (`seen == length`), and there only for the first document of a row. The scale is
    1 below floor_scale - 1, so the two agree wherever both stay below it: a later document [s, e) of a whole row
    is exact iff e < floor_scale (its last token has index e - 1 and position e - 1 - s), and a shard or a tile of
    rows of `length` tokens is exact when length < floor_scale.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    floor_scale = module.floor_scale
    if seen == length:
        rows = document_rows(documents, len(documents.rows), length) if documents is not None else ()
        if all(end < floor_scale for docs in rows for start, end in docs if start > 0):
            return
        where = "a packed document that is not first in its row ends"
    elif length < floor_scale:
        return
    else:
        where = "the layer is called on shards or tiles (context parallelism, tiled layers) of rows that reach"
    raise ConfigError(
        f"{type(module).__name__}'s attention temperature tuning scales queries by their index in the layer's input, "
        f"not their position, so it is exact only below floor_scale={floor_scale}, and {where} past it: set "
        "attn_temperature_tuning=false, or train one document per row on one process without tiled layers"
    )


def refuse_alibi(model: torch.nn.Module) -> None:
    """Refuse a model whose attention adds an ALiBi position bias (a slope per head times the query-key distance):
    longfit's kernels (the fused causal ones, the blocks of the ring and of tiled layers, flash-attn's varlen) add no
    bias. Read off the config where it says (`alibi`: Falcon-RW; `attn_config.alibi`: MPT); Bloom's config has no
    such key because Bloom always adds it: its attention modules take the bias as a required `alibi` argument."""
    config = model.config
    flags = [getattr(part, "alibi") for part in (config, getattr(config, "attn_config", None))
             if part is not None and isinstance(getattr(part, "alibi", None), bool)]
    if flags:
        uses = any(flags)
    else:
        uses = any(
            parameter.name == "alibi" and parameter.default is inspect.Parameter.empty
            for module in model.modules() for parameter in inspect.signature(type(module).forward).parameters.values()
        )
    if uses:
        raise ConfigError(f"the {config.model_type} model's attention adds an ALiBi position bias, which longfit's "
                          "attention kernels do not compute")


def register_attention() -> str:
    """Register "longfit" with transformers (idempotent) and return the name to use as attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, longfit_attention_forward)
    return ATTENTION_NAME
