"""Sequence-tiled decoder layers: forward, recompute and backward of a decoder layer over token tiles, exactly.

Derivation. A decoder layer is token-wise except for attention: its norms, projections (LoRA adapters
included), rotary embedding, MLP and residual adds act on each token alone. So the layer's own forward
(`type(layer).forward`: transformers' code, peft's adapters) can run on the tokens [s, e) of its input,
with the same rows of the rotary tables, as long as the attention call is intercepted: longfit's
attention function hands the tile's rotated q (B, H, t, D) and k, v (B, Hkv, t, D) to the attention
module's hook (`longfit_context_parallel`, see longfit.models.attention), which a tile run sets to itself.
Causal attention of queries [s, e) needs the keys [0, e) only. With the K/V of every tile kept in
sequence-long buffers K, V (B, Hkv, L, D):

  forward (no grad; one pass, tiles in order): K/V[s:e] = k, v; out = attention of q over K/V[:e],
      computed in key blocks merged by their log-sum-exp (`kernels.merge_partial`, the ring's online
      softmax); the layer continues on the tile: y[s:e]. Saved for backward: the layer input x only,
      through `save_for_backward`, so the activation offloader moves it like any checkpointed input
      (the first layer saves nothing, below).
  backward (A) rebuild K, V: each tile's forward without grad, stopped by an exception as soon as the
      attention hook has stored the tile's k, v;
      (B) tiles in REVERSE order: recompute tile t with grad. Its attention (`_TileAttention`) returns
      dq and adds the tile's share of dK, dV into fp32 accumulators (B, Hkv, L, D): given the FINAL out
      and lse of a query row, `kernels.attention_backward` on one key block returns exactly that block's
      share of the gradient (FlashAttention-2's identity, the one the ring backward uses). Keys [s, e)
      are seen by queries [s, L) only, i.e. by tiles t..T-1, which are all done: dK/dV[s:e] is
      complete and is the gradient of the tile's own k, v. So ONE autograd.backward per tile yields
      dx[s:e] (residual, q path and k/v path together) and accumulates every trainable parameter's .grad.

Sliding-window layers (Gemma 3's local layers) pass their window with the attention call; the tile's
blocks then cover only the pairs within it (models/blockwise.py), keys [s, e) are still seen by queries
[s, L) only, and the schedule is unchanged. Per-token keyword inputs (Gemma 4's per-layer inputs) are cut into
the same tiles as the hidden states, and their gradient leaves the layer's node beside the input's (`_TokenWise`:
the per-layer embedding and projection train). A model whose layers attend to another layer's keys and values (Gemma 4's
num_kv_shared_layers) is refused: a tile run computes its own keys only. So do an attention-logit cap (each block's kernel caps its
scores) and attention sinks (merged into each tile's final out and lse; their gradient from a tile's
queries flows out of `_TileAttention` to the sinks parameter with the tile's other parameter gradients). Under tensor parallelism tiled layers are refused
(memory/switches.py says why).

The first layer keeps nothing: its input is the embedding of the token ids, which its backward looks up
again (`_EmbeddingLookup`: the embedding's last call, recorded by a forward hook; bit-exact, as the
lookup is a gather). So of n checkpointed tiled layers n - 1 store their input
(`switches.stored_input_count`), one sequence-long row fewer than checkpointing keeps. transformers'
model forward still holds the embedding output in a local until it returns, so the saving starts at the
loss and lasts through backward, where the peak of a tiled model is. A model that scales the embedding output
in its forward (Granite's `embedding_multiplier`, #52) gives its first layer a new tensor: the lookup multiplies
too, and is used where its product equals the layer's input bit for bit (the same gather and product under the
same autocast). A first layer whose input is neither (image rows, #54: the images' embeddings written over their
placeholders; inputs_embeds passed) saves its input on the device as a checkpointed layer does.

Alive at sequence length: x, y in forward; x, dy, K, V, dK, dV in backward, and dx, which in the one-pass
schedule takes the storage of x: once tile t is back-propagated, no later step reads x[s:e], and dx[s:e]
is written there. So the layer consumes its input. This is done only for an input produced by the
graph (the previous layer's output, or the first layer's looked-up input), never for a leaf tensor the caller made; an
autograd node that also saved the input would refuse to run on it (the version counter), and a
reference kept past backward outside autograd (e.g. transformers' output_hidden_states) reads the
gradient. Everything else exists for one tile at a time, so the layer's working set is that of a tile
(`switches.layer_tile_count` sizes the tiles to about one hidden row of the whole sequence, and to at most
8K tokens on long rows). The compute is that of a checkpointed layer (forward, recompute, backward) plus
phase A's q/k/v projections (a few percent of a layer), and the MLP runs per tile without the tiled MLP's extra recompute, so tiled layers replace both checkpointing and
the tiled MLP for the layers they cover.

The attention of one tile -- key blocks that never cross a packed document, merged by lse, and their
backward -- is longfit.parallel.tiled_attention's (it needs the kernels, and under context parallelism
the exchanges, which live in `parallel`): a tiled layer calls a backend with a small protocol
(documented on `LocalTileAttention` there), given by the caller for one rank and by the
context-parallel attention otherwise. This module owns the schedule.

Context parallelism (tiles inside the local shard). The attention hook that `parallelize` sets provides
`tile_attention(...)`: a backend whose keys are those of the whole sequence (Ulysses: all-to-all into a
head split; ring: the K/V shards passed around per tile). Then a local tile's queries also need keys of
other ranks' later tiles, and a tile's keys get gradient from other ranks' later queries, so the one-pass
argument above fails. The schedule becomes: forward A (every tile's k, v, then `share_keys`), forward B
(tiles in order, attending to the shared keys); backward A, B (dq; dK/dV accumulated where the backend
keeps them; a tile's own k, v get nothing yet), then C: `finish_gradients` brings the complete dK/dV to
the local shard, and each tile is recomputed up to attention with grad and back-propagated from its k,
v. All communication happens inside the backend, in the same order on every rank (equal tile counts),
and inside this layer's one autograd Function, so FSDP2 still reduce-scatters once per layer (its
pre-backward hook has gathered the parameters that `layer.parameters()` returns here).

A mixture-of-experts router loss (memory/router_loss.py) needs its routers' probability sums S_e with gradient,
which the forward's tile runs (no gradient) cannot give: while the loss collects them, the layer records its
routers' logits on every tile run, returns their S_e as a second output of its autograd node, and adds each tile's
S_e, recomputed with gradient, with that output's gradient to the tile's backward in (B) -- of either schedule.

Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next; models/linear_attention.py). Such a layer mixes
tokens with a short causal convolution and the gated delta rule, a recurrence along the sequence: tile t needs
the K-1 convolution inputs before it and the recurrent state S after the token before it, and leaves its own
for tile t+1 -- the spans of models/linear_attention.py ("Spans"), whose derivation the context-parallel
convolution halo uses across ranks, here in time. The tile run hands the mixer a `_TileLinearCall` as its kernels
(the attribute its forward pre-hook reads), which runs `span_causal_conv` and `span_gated_delta_rule` from the
carried (history, state) and keeps what leaves the tile. The schedule (`_LinearLayerRun`):
  forward (no grad): tiles in order, each from the previous tile's carry; saved: the layer input only.
  backward (A) the carry entering every tile again: tiles 0..T-2 without grad, each stopped as soon as its
      delta rule has produced the outgoing state (`_StateCarried`; the gated norm, out_proj and MLP are
      skipped) -- T small (B, C, K-1) + (B, Hv, Dk, Dv) tensors, alive during this layer's backward only
      (kept from forward instead, every tiled layer would hold them until its backward);
      (B) tiles in REVERSE order: tile t recomputed with grad from its carry made leaves, one autograd.backward
      from its output (dy) and its outgoing carry (the gradient tile t+1 gave its incoming carry: the state's
      gradient flowing back across the tile boundary), giving dx[s:e], the parameters' .grad and the gradient
      of its own incoming carry, passed on to tile t-1. Tile t's input rows are read by tile t alone after (A),
      so dx takes the input's storage as in the attention layers' one-pass schedule.
Under context parallelism the linear layers run head-split over the whole sequence (parallel/linear.py), which a
local tile cannot carry in sequence order: tiled layers on hybrid models are refused there (memory/switches.py).

Randomness (LoRA dropout) is replayed per tile: each tile draws from a stream of its own, seeded from the
global generator at its first run, so every recompute sees the forward's masks. The masks are drawn per
tile, not per sequence: a valid sample, and the exact gradient for it (as with the tiled MLP). Autocast is
recorded in forward and re-entered for the recomputes.

Only `.backward()` is supported: the layer accumulates its parameters' gradients into `.grad` inside its
own backward (as FSDP2 expects), so `torch.autograd.grad(..., params)` sees none, and its backward is not
differentiable (`once_differentiable`). It also runs once per forward: with a reused input, the first
backward wrote the input gradient into the saved input (retain_graph=True is refused; the first layer,
which looks its input up afresh, is the exception).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import once_differentiable

from longfit.config import ConfigError
from longfit.data.packing import DocumentLayout
from longfit.memory.router_loss import router_prob_sums, router_prob_sums_collector
from longfit.memory.switches import layer_tile_count
from longfit.memory.tiled_mlp import RecordedAutocast, caller_owned
from longfit.models.attention import batch_documents, layer_documents
from longfit.models.document_mixers import document_mixers
from longfit.models.linear_attention import linear_attention_layers, span_causal_conv, span_gated_delta_rule
from longfit.models.structure import decoder_layers

TILED_LAYER_ATTR = "longfit_tiled_layer"
ATTENTION_HOOK = "longfit_context_parallel"  # the attribute longfit's attention function routes calls to


# -- one tile run ---------------------------------------------------------------------------------------


class _KeysStored(Exception):
    """Raised by the attention hook when a run only needed the tile's keys and values: the rest of the layer is skipped."""


@dataclass
class _TileCall:
    """The attention hook of one tile run; `mode` says what the run is for (see the module docstring)."""

    mode: str  # "keys" (store k, v and stop) | "attend" | "grad" | "key_grad" (keep k, v with grad and stop)
    start: int
    end: int
    backend: object
    used: bool = False
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    window: int | None = None
    """The layer's sliding window (None: a global layer), as the attention function passes it."""
    softcap: float | None = None
    """The layer's attention-logit cap (None: none), as the attention function passes it."""
    router_logits: list[torch.Tensor] = field(default_factory=list)
    """The layer's routers' logits on this tile (router loss: memory/router_loss.py)."""

    def __call__(self, q, k, v, scale=None, documents=None, window=None, softcap=None, sinks=None):
        self.used, self.window, self.softcap = True, window, softcap
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.mode in ("keys", "key_grad"):
            if self.mode == "keys":
                self.backend.store(k, v, self.start, self.end)
            else:
                self.keys = (k, v)
            raise _KeysStored
        if self.mode == "attend":
            if self.backend.one_pass:
                self.backend.store(k, v, self.start, self.end)
            return self.backend.attend(q, self.start, self.end, scale, window, softcap, sinks)[0]
        return _TileAttention.apply(q, k, v, sinks, self, scale)


class _TileAttention(torch.autograd.Function):
    """A tile's attention in backward's recompute; with one pass its own k, v get their complete gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: _TileCall, scale: float):
        out, saved = call.backend.attend(q, call.start, call.end, scale, call.window, call.softcap, sinks)
        ctx.save_for_backward(sinks, *saved)
        ctx.call, ctx.scale = call, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        call = ctx.call
        sinks, *saved = ctx.saved_tensors
        dq, dsinks = call.backend.attend_backward(
            dout, saved, call.start, call.end, ctx.scale, call.window, call.softcap, sinks
        )
        if call.backend.one_pass:
            dk, dv = call.backend.key_gradients(call.start, call.end)
            return dq, dk, dv, dsinks, None, None
        return dq, None, None, dsinks, None, None


class TileRandomness:
    """Each tile's own random stream: a seed drawn from the global generator at the tile's first run, and every
    run of the tile (the first included) inside a fork of the generators seeded with it.

    A tile may be run first only partly (context parallelism's key pass stops after q, k, v), so replaying a
    recorded global state would hand the rest of that tile the draws of the next tile: one seed per tile keeps
    the tiles' masks independent and each tile's replay exact.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seeds: dict[int, int] = {}

    @contextlib.contextmanager
    def replay(self, tile: int):
        if tile not in self.seeds:
            self.seeds[tile] = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        on_cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if on_cuda else []):
            torch.default_generator.manual_seed(self.seeds[tile])
            if on_cuda:
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(self.seeds[tile])
            yield


def _draws_random_numbers(layer: nn.Module) -> bool:
    return layer.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in layer.modules())


@dataclass(frozen=True)
class _RouterTaps:
    """A layer's routers whose logits the router loss of the forward running now needs (memory/router_loss.py): read
    on a tile's run, to be summed into S_e (router_prob_sums). Empty when no router loss collects them."""

    routers: tuple[nn.Module, ...] = ()
    logits_index: int = 0
    """Where the router's output tuple holds its logits."""

    @classmethod
    def of(cls, layer: nn.Module) -> _RouterTaps:
        collector = router_prob_sums_collector()
        if collector is None:
            return cls()
        return cls(tuple(m for m in layer.modules() if isinstance(m, collector.router_class)), collector.logits_index)

    @contextlib.contextmanager
    def recording(self, into: list[torch.Tensor]):
        def record(module, args, output):
            into.append(output[self.logits_index] if isinstance(output, tuple) else output)

        hooks = [router.register_forward_hook(record) for router in self.routers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    @staticmethod
    def tile_sums(logits: list[torch.Tensor], grad_prob_sums: torch.Tensor | None) -> tuple[list, list]:
        """(outputs, gradients) to add to a tile's backward: its routers' S_e with grad and the layer's S_e gradient.
        Call it with grad enabled (a backward runs without)."""
        if grad_prob_sums is None:
            return [], []
        sums = [tile_sums for tile_sums in map(router_prob_sums, logits) if tile_sums.requires_grad]
        return sums, [grad_prob_sums] * len(sums)


def _summed_prob_sums(total: torch.Tensor | None, logits: list[torch.Tensor]) -> torch.Tensor | None:
    for tile_logits in logits:
        total = router_prob_sums(tile_logits) if total is None else total + router_prob_sums(tile_logits)
    return total


class _TokenWise:
    """A layer call's (B, L, ...) keyword inputs used token by token (Gemma 3n/4's per-layer inputs), cut into the
    tiles as the hidden states. They come from the model's own modules (Gemma 4's per-layer embedding and projection),
    so their gradient leaves the layer's autograd node: in backward each tile's rows of those that need one are leaves
    of the tile's graph (`leaves`), whose gradients are gathered into whole-row ones (`gather`, `grads`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.grads: dict[str, torch.Tensor | None] = dict.fromkeys(tensors)
        self._leaves: dict[str, torch.Tensor] = {}

    def tile(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """The tile's rows of each input: its leaves during a backward's tile run."""
        return {key: self._leaves.get(key, value[:, start:end]) for key, value in self.tensors.items()}

    def leaves(self, start: int, end: int) -> list[torch.Tensor]:
        """Leaves of the tile's rows of the inputs that need a gradient, which the next tile run takes."""
        self._leaves = {key: value[:, start:end].detach().requires_grad_()
                        for key, value in self.tensors.items() if value.requires_grad}
        return list(self._leaves.values())

    def gather(self, start: int, end: int) -> None:
        """Add the tile's leaves' gradients into the whole rows' and let the leaves go."""
        for key, leaf in self._leaves.items():
            if leaf.grad is not None:
                if self.grads[key] is None:
                    self.grads[key] = torch.zeros_like(self.tensors[key])
                self.grads[key][:, start:end] += leaf.grad
        self._leaves = {}


def _layer_on_tile(run, index: int, x: torch.Tensor, mixer: nn.Module, call, stopped: type[Exception],
                   recording: bool) -> torch.Tensor | None:
    """`run.layer` (either tile schedule's) on tile `index`, x its input rows: `call` is the token mixer's kernels
    for the run (the attribute its hook reads; whatever was there before is put back), the tile's random numbers
    replayed under the forward's autocast, its routers' logits recorded into `call` where `recording`. None where
    `call` stopped the run early (raising `stopped`)."""
    start, end = run.tiles[index]
    outer = mixer.__dict__.get(ATTENTION_HOOK)
    randomness = run.randomness.replay(index) if run.randomness is not None else contextlib.nullcontext()
    routers = run.taps.recording(call.router_logits) if recording else contextlib.nullcontext()
    setattr(mixer, ATTENTION_HOOK, call)
    try:
        with randomness, run.autocast(), routers:
            out = type(run.layer).forward(run.layer, x, **run._sliced(start, end))
    except stopped:
        return None
    finally:
        if outer is None:
            delattr(mixer, ATTENTION_HOOK)
        else:
            setattr(mixer, ATTENTION_HOOK, outer)
    return out[0] if isinstance(out, tuple) else out


def _run_tiles(count: int, hidden: torch.Tensor, one_pass: bool) -> list[int]:
    """The tiles a layer's passes run: all of them, or on tensors without values (the planner's traces on meta or fake
    tensors) of the one-pass schedule, the first two and the last two. The other tiles hold what these hold: every
    tile's tensors are allocated anew and freed within its run, into buffers allocated whole before the first (the
    output, K/V, dK/dV, the input gradient) or by the first (the parameters' gradients, which later tiles add to);
    a tile's only difference from another is its attention's key blocks (models/blockwise.py), the keys before it in
    pieces of at most `max_keys` and its own as one diagonal block, so a later tile runs the blocks of an earlier
    one and more of the same sizes, one at a time. The last tile runs the most (in backward the first, creating the
    gradients), the one before it the most of those adding to them, the first two the fewest (the forward's first
    allocates the output). Tiled samples of the traces (plan/layer_trace.py) run up to 16 tiles
    (`test_a_tiled_layer_traced_in_four_tiles_holds_what_all_its_tiles_hold`)."""
    if one_pass and (hidden.device.type == "meta" or isinstance(hidden, FakeTensor)):
        return traced_tiles(count)
    return list(range(count))


def traced_tiles(count: int) -> list[int]:
    """The tiles of `count` a one-pass layer runs on tensors without values (`_run_tiles`)."""
    return [0, 1, count - 2, count - 1] if count > 4 else list(range(count))


class _LayerRun:
    """One call of a tiled layer: its inputs' sequence-shaped keywords, tiles, backend, RNG and autocast state."""

    first = False  # the model's first tiled layer (`_tiled_layer_call` says)

    def __init__(self, layer: nn.Module, hidden: torch.Tensor, tile_count: int, local_attention, position_embeddings,
                 position_ids, documents, other_kwargs: dict, token_wise: dict, taps: _RouterTaps):
        B, L, _ = hidden.shape
        self.layer = layer
        self.taps = taps
        self.position_embeddings = position_embeddings
        self.position_ids = position_ids
        self.other_kwargs = other_kwargs
        self.token_wise = _TokenWise(token_wise)  # (B, L, ...) keyword inputs, cut into tiles
        self.attention = layer.self_attn
        # Context parallelism put its attention on the module (parallelize); its tile backend sees the whole
        # sequence. Without it, the one-rank backend the caller provided.
        outer_hook = self.attention.__dict__.get(ATTENTION_HOOK)
        make = local_attention if outer_hook is None else getattr(outer_hook, "tile_attention", None)
        if make is None:
            raise TypeError(
                f"{type(outer_hook).__name__} on the attention module has no tile_attention(): tiled decoder "
                "layers cannot run with it; set memory.tiled_layers=false"
            )
        self._new_backend = lambda: make(batch=B, local_length=L, documents=documents)
        self.tile_count = tile_count
        backend = self._new_backend()
        self.tiles = backend.tiles(tile_count)
        self.run_tiles = _run_tiles(len(self.tiles), hidden, backend.one_pass)
        self.backend = None  # one per pass: its sequence-long buffers live for that pass only
        self.consumed_input = False  # backward wrote the input gradient over the saved input
        self.randomness = TileRandomness(hidden.device) if _draws_random_numbers(layer) else None
        self.autocast = RecordedAutocast.now(hidden.device.type)

    def _start_pass(self) -> None:
        self.backend = self._new_backend()
        self.backend.tiles(self.tile_count)

    def _sliced(self, start: int, end: int) -> dict:
        tables = self.position_embeddings  # (cos, sin), each (B, L, D); Llama 4: one complex (B, L, D / 2) tensor
        if isinstance(tables, torch.Tensor):
            tiled_tables = tables[:, start:end]
        else:
            tiled_tables = tuple(table[:, start:end] for table in tables)
        kwargs = dict(self.other_kwargs, position_embeddings=tiled_tables)
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids[:, start:end]
        kwargs.update(self.token_wise.tile(start, end))
        return kwargs

    def run(self, index: int, x: torch.Tensor, mode: str) -> tuple[torch.Tensor | None, _TileCall]:
        """The layer on tile `index` (x its input rows); None as output when the hook stopped it after k, v."""
        start, end = self.tiles[index]
        call = _TileCall(mode, start, end, self.backend)
        # The other runs stop at attention, before any router.
        out = _layer_on_tile(self, index, x, self.attention, call, _KeysStored, recording=mode in ("attend", "grad"))
        if not call.used:
            raise RuntimeError(
                f"{type(self.layer).__name__}'s attention did not reach longfit's attention function: tiled decoder "
                "layers need the model loaded with longfit attention (longfit.load_model); set memory.tiled_layers=false"
            )
        return out, call

    def _store_all_keys(self, hidden: torch.Tensor) -> None:
        for index in self.run_tiles:
            start, end = self.tiles[index]
            self.run(index, hidden[:, start:end], "keys")
        self.backend.share_keys()

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and, with routers to record, their S_e over every tile (router_prob_sums)."""
        self._start_pass()
        if not self.backend.one_pass:
            self._store_all_keys(hidden)
        output = prob_sums = None
        for index in self.run_tiles:
            start, end = self.tiles[index]
            out, call = self.run(index, hidden[:, start:end], "attend")
            if output is None:
                output = out.new_empty((*hidden.shape[:2], out.shape[-1]))
            output[:, start:end] = out
            prob_sums = _summed_prob_sums(prob_sums, call.router_logits)
        self.backend = None
        return output, prob_sums

    def backward(
        self, hidden: torch.Tensor, grad_out: torch.Tensor, input_needs_grad: bool, reuse_input: bool,
        grad_prob_sums: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The input gradient (None when the input needs none) and every trainable parameter's .grad.

        `reuse_input`: the saved input's storage may take the input gradient (module docstring).
        `grad_prob_sums`: the gradient of the routers' S_e that forward returned, added through each tile's."""
        hidden = hidden.detach()
        params = [p for p in self.layer.parameters() if p.requires_grad]  # under FSDP2: the gathered ones
        self._start_pass()
        with torch.no_grad():
            self._store_all_keys(hidden)  # (A)
        self.backend.start_gradients()
        # One pass: once tile t is back-propagated no later step reads its input rows, so its input gradient
        # can go into them, and the layer needs no sequence-long buffer of its own for it.
        grad_in = None
        if input_needs_grad:
            grad_in = hidden if self.backend.one_pass and reuse_input else torch.empty_like(hidden)
        self.consumed_input = grad_in is hidden
        for index in reversed(self.run_tiles):  # (B)
            start, end = self.tiles[index]
            x = hidden[:, start:end].requires_grad_(input_needs_grad)  # a leaf: `hidden` is detached
            leaves = self.token_wise.leaves(start, end)
            with torch.enable_grad():
                y, call = self.run(index, x, "grad")
                sums, sum_grads = self.taps.tile_sums(call.router_logits, grad_prob_sums)
            torch.autograd.backward([y, *sums], [grad_out[:, start:end], *sum_grads],
                                    inputs=([x] if input_needs_grad else []) + leaves + params)
            self.token_wise.gather(start, end)
            if input_needs_grad:
                grad_in[:, start:end] = x.grad
        if self.backend.one_pass:
            self.backend = None
            return grad_in
        self.backend.finish_gradients()
        for index in self.run_tiles:  # (C)
            start, end = self.tiles[index]
            x = hidden[:, start:end].requires_grad_(input_needs_grad)
            leaves = self.token_wise.leaves(start, end)
            with torch.enable_grad():
                _, call = self.run(index, x, "key_grad")
            # Frozen k_proj on a gradient-free input (LoRA, first layer): that output has no graph.
            pairs = [(t, g) for t, g in zip(call.keys, self.backend.key_gradients(start, end)) if t.requires_grad]
            if pairs:
                torch.autograd.backward(
                    [t for t, _ in pairs], [g for _, g in pairs],
                    inputs=([x] if input_needs_grad else []) + leaves + params,
                )
            self.token_wise.gather(start, end)
            if input_needs_grad and x.grad is not None:
                grad_in[:, start:end] += x.grad
        self.backend = None
        return grad_in


# -- linear-attention layers (module docstring) -------------------------------------------------------


class _StateCarried(Exception):
    """Raised by a tile's linear kernels when the run only needed the carry leaving the tile: the rest is skipped."""


@dataclass
class _TileLinearCall:
    """The linear-attention kernels of one tile run (the mixer's `longfit_context_parallel` during the run): the
    tokens [start, end) of rows of `length`, from the carry the earlier tiles left (None: the first tile)."""

    mode: str  # "forward" | "grad" | "state" (keep the carry leaving the tile and stop)
    start: int
    end: int
    length: int
    history: torch.Tensor | None
    """(B, C, K-1): the convolution's inputs before the tile."""
    state: torch.Tensor | None
    """(B, Hv, Dk, Dv) fp32: the recurrent state after the token before the tile."""
    carried: tuple[torch.Tensor, torch.Tensor] | None = None
    """The (history, state) leaving the tile, once its delta rule has run."""
    _history_out: torch.Tensor | None = None
    router_logits: list[torch.Tensor] = field(default_factory=list)
    """The layer's routers' logits on this tile (router loss: memory/router_loss.py)."""

    def conv(self, x, weight, bias, activation, documents: DocumentLayout | None) -> torch.Tensor:
        out, self._history_out = span_causal_conv(x, weight, bias, activation, documents, self.length, self.start,
                                                  self.history)
        return out

    def delta_rule(self, q, k, v, g, beta, documents: DocumentLayout | None, use_qk_l2norm: bool) -> torch.Tensor:
        out, state = span_gated_delta_rule(q, k, v, g, beta, documents, self.length, self.start, use_qk_l2norm,
                                           self.state)
        self.carried = (self._history_out, state)
        if self.mode == "state":
            raise _StateCarried
        return out


class _LinearLayerRun:
    """One call of a tiled linear-attention layer: the carry-passing schedule of the module docstring."""

    first = False  # as `_LayerRun.first`

    _sliced = _LayerRun._sliced  # the tile's rows of the rotary tables, position_ids and per-token inputs

    def __init__(self, layer: nn.Module, mixer: nn.Module, hidden: torch.Tensor, tiles: list[tuple[int, int]],
                 position_embeddings, position_ids, other_kwargs: dict, token_wise: dict, taps: _RouterTaps):
        self.layer, self.mixer, self.taps = layer, mixer, taps
        self.length = hidden.shape[1]
        self.tiles = tiles
        self.position_embeddings, self.position_ids = position_embeddings, position_ids
        self.other_kwargs, self.token_wise = other_kwargs, _TokenWise(token_wise)
        self.consumed_input = False
        self.randomness = TileRandomness(hidden.device) if _draws_random_numbers(layer) else None
        self.autocast = RecordedAutocast.now(hidden.device.type)

    def run(self, index: int, x: torch.Tensor, carry: tuple, mode: str) -> tuple[torch.Tensor | None, _TileLinearCall]:
        """The layer on tile `index` from `carry` (history, state); None as output when stopped after the state."""
        start, end = self.tiles[index]
        call = _TileLinearCall(mode, start, end, self.length, *carry)
        # A "state" run stops in the mixer, before any router.
        out = _layer_on_tile(self, index, x, self.mixer, call, _StateCarried, recording=mode != "state")
        if call.carried is None:
            raise RuntimeError(
                f"{type(self.layer).__name__}'s linear-attention layer did not reach longfit's kernels: tiled decoder "
                "layers need the model loaded by longfit (longfit.load_model); set memory.tiled_layers=false"
            )
        return out, call

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and, with routers to record, their S_e over every tile (router_prob_sums)."""
        output, prob_sums, carry = None, None, (None, None)
        for index, (start, end) in enumerate(self.tiles):
            out, call = self.run(index, hidden[:, start:end], carry, "forward")
            if output is None:
                output = out.new_empty((*hidden.shape[:2], out.shape[-1]))
            output[:, start:end] = out
            prob_sums = _summed_prob_sums(prob_sums, call.router_logits)
            carry = call.carried
        return output, prob_sums

    def backward(
        self, hidden: torch.Tensor, grad_out: torch.Tensor, input_needs_grad: bool, reuse_input: bool,
        grad_prob_sums: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """As `_LayerRun.backward`."""
        hidden = hidden.detach()
        params = [p for p in self.layer.parameters() if p.requires_grad]  # under FSDP2: the gathered ones
        carries = [(None, None)]
        with torch.no_grad():  # (A)
            for index, (start, end) in enumerate(self.tiles[:-1]):
                carries.append(self.run(index, hidden[:, start:end], carries[-1], "state")[1].carried)
        grad_in = None
        if input_needs_grad:
            grad_in = hidden if reuse_input else torch.empty_like(hidden)
        self.consumed_input = grad_in is hidden
        carry_grads = None  # the gradient of the carry leaving the tile (None: the last tile's leaves nothing)
        for index in reversed(range(len(self.tiles))):  # (B): every tile, each passes its carry on
            start, end = self.tiles[index]
            x = hidden[:, start:end].requires_grad_(input_needs_grad)  # a leaf: `hidden` is detached
            carry = tuple(None if t is None else t.detach().requires_grad_() for t in carries[index])
            token_leaves = self.token_wise.leaves(start, end)
            with torch.enable_grad():
                y, call = self.run(index, x, carry, "grad")
                sums, sum_grads = self.taps.tile_sums(call.router_logits, grad_prob_sums)
            outputs, grads = [y, *sums], [grad_out[:, start:end], *sum_grads]
            if carry_grads is not None:
                # A frozen in_proj on a gradient-free input (LoRA, first layer) leaves a history without graph.
                pairs = [(t, g) for t, g in zip(call.carried, carry_grads) if t.requires_grad]
                outputs += [t for t, _ in pairs]
                grads += [g for _, g in pairs]
            leaves = [t for t in carry if t is not None]
            torch.autograd.backward(outputs, grads,
                                    inputs=([x] if input_needs_grad else []) + leaves + token_leaves + params)
            self.token_wise.gather(start, end)
            carry_grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]
            if input_needs_grad:
                grad_in[:, start:end] = x.grad
        return grad_in


class _Lookup:
    """One call's token ids and the embedding that looks them up: the first tiled layer's input, made again
    under the forward's autocast (peft's adapted embedding multiplies in it), times the model's embedding
    multiplier (Granite's, applied by its model forward after the embedding: 1 for other families)."""

    def __init__(self, embedding: nn.Module, ids: torch.Tensor, multiplier: float = 1.0):
        self.embedding, self.ids, self.multiplier = embedding, ids, multiplier
        self.autocast = RecordedAutocast.now(ids.device.type)

    def __call__(self) -> torch.Tensor:
        with torch.no_grad(), self.autocast():
            embeds = self.embedding(self.ids)
            return embeds if self.multiplier == 1.0 else embeds * self.multiplier


class _EmbeddingLookup:
    """Records the input embedding's last call (a forward hook) for the first tiled layer (module docstring)."""

    def __init__(self, embedding: nn.Module, multiplier: float):
        self.embedding, self.multiplier = embedding, multiplier
        self._ids: torch.Tensor | None = None
        self._output = lambda: None
        embedding.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        if torch.is_grad_enabled():  # not the lookups themselves, nor evaluation
            self._ids, self._output = args[0], weakref.ref(output)

    def of(self, hidden: torch.Tensor) -> _Lookup | None:
        """The lookup that gives `hidden` back: the last embedding output (or a whole view of it), or, where the model
        scales it (`embedding_multiplier`), its product, made again and found equal. None otherwise (image rows,
        whose embeddings hold the images'; inputs_embeds passed): the layer saves its input instead."""
        output, ids = self._output(), self._ids
        self._ids, self._output = None, lambda: None  # one call's ids are that call's lookup's alone
        if ids is None:
            return None
        if output is not None and _whole_view(hidden, output):
            return _Lookup(self.embedding, ids)
        if self.multiplier == 1.0 or ids.shape != hidden.shape[:-1]:
            return None
        # The scaled embeddings are a new tensor, the embedding output already freed: compare values (a gather and a
        # product of one row, once a step, at the forward where the tiled model's peak is not).
        lookup = _Lookup(self.embedding, ids, self.multiplier)
        return lookup if torch.equal(lookup(), hidden) else None


def embedding_multiplier(config) -> float:
    """The factor the model's forward multiplies its input embeddings by, outside the embedding module: Granite's
    `embedding_multiplier` (1: none)."""
    return float(getattr(config, "embedding_multiplier", None) or 1.0)


def _whole_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` is `b` or a view of all of it (FSDP2's pre-forward hook passes a layer's input on as a view)."""
    base = (a._base if a._base is not None else a) is (b._base if b._base is not None else b)
    return base and a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


class _TiledLayerFunction(torch.autograd.Function):
    """The whole tiled layer as one autograd node whose only saved tensor is the layer input (the first layer: none).
    Its other inputs: the run's token-wise inputs (`_TokenWise`), whose gradients it returns, then the parameters."""

    @staticmethod
    def forward(ctx, hidden, run: _LayerRun, lookup: _Lookup | None, *inputs):
        # The trainable parameters are inputs only so that backward runs even when `hidden` needs no
        # gradient (the first layer under LoRA); their gradients are accumulated into .grad in backward.
        ctx.run, ctx.lookup = run, lookup
        if lookup is None:
            # Gemma 3n/4's model forward also projects the first layer's input into the per-layer inputs (token-wise
            # here), whose backward reads it: its storage cannot take the input gradient.
            ctx.input_reusable = not caller_owned(hidden) and not (run.first and run.token_wise.tensors)
            ctx.save_for_backward(hidden)
        output, prob_sums = run.forward(hidden)
        # With routers: their S_e as a second output, for the router loss (memory/router_loss.py)
        return output if prob_sums is None else (output, prob_sums)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_prob_sums=None):
        if ctx.lookup is not None:  # the first layer: its input again, fresh, so its storage can take dx
            hidden, reuse_input = ctx.lookup(), True
        else:
            if ctx.run is None or ctx.run.consumed_input:
                # Without saved-tensor hooks autograd's version counter refuses this; the offloader's hooks
                # hand the same tensor back unchecked, so the layer refuses it itself (a first backward also
                # released its run, below).
                raise RuntimeError(
                    "a tiled decoder layer's backward ran a second time, but its first backward wrote the input "
                    "gradient into the saved input: retain_graph=True is not supported with memory.tiled_layers=true"
                )
            (hidden,) = ctx.saved_tensors
            reuse_input = ctx.input_reusable
        grad_in = ctx.run.backward(hidden, grad_out, ctx.needs_input_grad[0], reuse_input=reuse_input,
                                   grad_prob_sums=grad_prob_sums)
        token_grads = tuple(ctx.run.token_wise.grads.values())
        # The node outlives its backward until the whole graph goes (the vision tower's backward, the step's last, is
        # still to run on image rows): the run's keywords hold what its tiles' recompute wrote into them (Gemma 4's
        # keys and values of the last layer of each kind, `shared_kv_states`), and its token-wise inputs and their
        # gradients. Released here, they go with the layers' backward, where the planner frees them.
        ctx.run = ctx.lookup = None
        return (grad_in, None, None, *token_grads) + (None,) * (len(ctx.needs_input_grad) - 3 - len(token_grads))


# -- applying it ----------------------------------------------------------------------------------------

_SEQUENCE_FREE_KWARGS = ("cu_seq_lens_k", "max_length_q", "max_length_k")  # varlen companions of cu_seq_lens_q
# (B, L, ...) inputs a layer uses token by token, cut like its hidden states: Gemma 3n/4's per-layer inputs, which
# the layer multiplies into each token's gated hidden state.
_TOKEN_WISE_KWARGS = ("per_layer_input",)


@dataclass
class _LayerTiling:
    index: int
    tiles: int | None
    """Fixed tile count, or None: `layer_tile_count` of the tokens each call sees."""
    hidden: int
    intermediate: int
    local_attention: object
    """`(batch=, local_length=, documents=) -> backend` for a layer without context parallelism."""
    offloader: object | None = None
    """An ActivationOffloader whose layer_scope(index - 1) receives the input of layer index >= 1 (None: it stays
    in place); the first layer's is looked up again instead."""
    embedding: _EmbeddingLookup | None = None
    """The first layer's: where its input comes from, to be looked up again in backward."""
    tile_counts: list[int] = field(default_factory=list)
    """Tiles of each call so far (for logs and tests)."""
    linear_mixer: nn.Module | None = None
    """A linear-attention layer's token mixer (its state carried from tile to tile); None: an attention layer."""


@functools.cache
def _forward_signature(layer_class: type) -> tuple[inspect.Signature, str | None]:
    """The signature of a decoder layer class's own forward and the name of its `**kwargs` (None: none)."""
    signature = inspect.signature(layer_class.forward)
    var_keyword = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    return signature, var_keyword[0] if var_keyword else None


def _tiled_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    # The layer's other positional inputs by their names (Gemma 4 passes its per-layer input second).
    signature, var_keyword = _forward_signature(type(layer))
    named = dict(signature.bind(layer, hidden_states, *args, **kwargs).arguments)
    del named[next(iter(signature.parameters))], named[list(signature.parameters)[1]]  # self, the hidden states
    named.update(named.pop(var_keyword, {}) if var_keyword else {})
    return _tiled_layer_call(layer, hidden_states, **named)


def _tiled_layer_call(layer: nn.Module, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                      past_key_values=None, cache=None, use_cache=False, position_embeddings=None, cu_seq_lens_q=None,
                      longfit_documents=None, **kwargs):
    spec: _LayerTiling = getattr(layer, TILED_LAYER_ATTR)
    if attention_mask is not None or past_key_values is not None or cache is not None or use_cache:
        raise ValueError(
            "tiled decoder layers train without attention masks or KV caches: pass position_ids / cu_seq_lens_q "
            "and use_cache=False (longfit's CausalLMLoss does)"
        )
    if position_embeddings is None:
        raise ValueError(f"{type(layer).__name__} got no position_embeddings: tiled layers need the rotary tables")
    others, token_wise = {}, {}
    for key, value in kwargs.items():
        if key in _TOKEN_WISE_KWARGS and value is not None:
            token_wise[key] = value
        elif isinstance(value, torch.Tensor) and key not in _SEQUENCE_FREE_KWARGS:
            raise TypeError(f"tiled decoder layers do not know how to cut the keyword tensor {key!r} into tiles")
        elif key not in _SEQUENCE_FREE_KWARGS:
            others[key] = value
    # None: the first layer's input is not the token ids' embedding (image rows), saved as the other layers' are
    lookup = spec.embedding.of(hidden_states) if spec.embedding is not None and torch.is_grad_enabled() else None
    B, L, _ = hidden_states.shape
    count = spec.tiles or layer_tile_count(B * L, spec.hidden, spec.intermediate)
    taps = _RouterTaps.of(layer)
    if spec.linear_mixer is not None:
        documents = batch_documents(cu_seq_lens_q, longfit_documents, B) or DocumentLayout.one_document_per_row(B, L)
        others["longfit_documents"] = documents
        tiles = spec.local_attention(batch=B, local_length=L, documents=documents).tiles(count)  # the same tiles
        run = _LinearLayerRun(layer, spec.linear_mixer, hidden_states, tiles, position_embeddings, position_ids, others,
                              token_wise, taps)
    else:
        run = _attention_layer_run(layer, spec, hidden_states, count, position_embeddings, position_ids,
                                   cu_seq_lens_q, longfit_documents, others, token_wise, taps)
    spec.tile_counts.append(len(run.tiles))
    run.first = spec.index == 0
    params = [p for p in layer.parameters() if p.requires_grad]
    # The first layer stores nothing (module docstring); the others are the store's layers 0, 1, ...
    scope = spec.offloader.layer_scope(spec.index - 1) if spec.offloader is not None and spec.index else contextlib.nullcontext()
    with scope:
        result = _TiledLayerFunction.apply(hidden_states, run, lookup, *token_wise.values(), *params)
    if not taps.routers:
        return result
    output, prob_sums = result
    router_prob_sums_collector().sums.append(prob_sums)
    return output


def _attention_layer_run(layer: nn.Module, spec: _LayerTiling, hidden_states: torch.Tensor, count: int,
                         position_embeddings, position_ids, cu_seq_lens_q, longfit_documents, others: dict,
                         token_wise: dict, taps: _RouterTaps) -> _LayerRun:
    B, L, _ = hidden_states.shape
    # The backend, made here, holds the layer's documents (a chunked layer's chunks, over GLOBAL rows); the tile runs
    # pass them on for the attention function's checks, which the tile hook does not repeat.
    outer_hook = layer.self_attn.__dict__.get(ATTENTION_HOOK)
    length = L * getattr(outer_hook, "cp_size", 1)
    documents = batch_documents(cu_seq_lens_q, longfit_documents, B) or DocumentLayout.one_document_per_row(B, length)
    documents = layer_documents(layer.self_attn, documents, B, length)
    others["longfit_documents"] = documents
    return _LayerRun(layer, hidden_states, count, spec.local_attention, position_embeddings, position_ids,
                     documents, others, token_wise, taps)


@dataclass
class TiledLayers:
    """What `apply_tiled_layers` did."""

    layer_indices: list[int]
    """The tiled decoder layers (the first ones)."""
    tiles: int | None
    """Fixed tile count, or None: derived per call from the tokens it sees (`layer_tile_count`)."""


def apply_tiled_layers(
    model: nn.Module, local_attention, count: int | None = None, tiles: int | None = None, offloader=None
) -> TiledLayers:
    """Tile the first `count` (None: all) decoder layers in place; `tiles` None or 0 derives the tile count per call.

    `local_attention` builds the tile attention of a layer without context parallelism
    (longfit.parallel.tiled_attention.LocalTileAttention.for_sequence; `parallelize` passes it). A tiled
    layer is its own checkpoint: apply it instead of activation checkpointing and the tiled MLP for
    those layers (longfit.memory.apply does). `offloader` (an ActivationOffloader) moves each tiled
    layer's saved input out of device memory; the first layer saves none, it looks its input up again
    through a forward hook on the input embedding (the model must be called with input_ids). Apply after
    context parallelism and before FSDP2.
    """
    from longfit.models.structure import unwrap_peft

    assert tiles is None or tiles >= 0, f"tile count {tiles} < 0 (config.validate)"
    config = unwrap_peft(model).config.get_text_config()
    layers = decoder_layers(model)
    count = len(layers) if count is None else count
    if count and getattr(config, "num_kv_shared_layers", 0):
        raise ConfigError(
            f"memory.tiled_layers=true cannot tile a model whose last {config.num_kv_shared_layers} layers attend to "
            "the keys and values of an earlier layer (num_kv_shared_layers): a tile computes only its own keys; set "
            "memory.tiled_layers=false (activation checkpointing is exact for it)"
        )
    linear_mixers = linear_attention_layers(model) if count else {}
    for index, mixer in (document_mixers(model) if count else {}).items():
        if index < count:
            raise ConfigError(
                f"memory.tiled_layers=true cannot tile decoder layer {index}: its {type(mixer).__name__} runs per "
                "document (models/document_mixers.py) and a sequence tile cuts documents; set memory.tiled_layers=false "
                "(activation checkpointing is exact for it)"
            )
    for index in range(count):
        layer = layers[index]
        if hasattr(layer, TILED_LAYER_ATTR):
            raise RuntimeError(f"decoder layer {index} is already tiled: apply tiled layers once")
        if getattr(layer, "gradient_checkpointing", False):
            raise RuntimeError(
                "transformers' own gradient checkpointing is enabled on this model: call "
                "model.gradient_checkpointing_disable(); a tiled layer is its own checkpoint"
            )
        if index in linear_mixers and ATTENTION_HOOK in linear_mixers[index].__dict__:
            raise RuntimeError(
                f"decoder layer {index}'s linear-attention layer runs under context parallelism (head-split over the "
                "whole sequence), which tiled layers do not carry: memory.resolve_memory_switches refuses "
                "memory.tiled_layers=true with parallel.cp > 1 on hybrid models"
            )
        if index not in linear_mixers and not isinstance(getattr(layer, "self_attn", None), nn.Module):
            raise ValueError(
                f"decoder layer {index} ({type(layer).__name__}) has no `self_attn` module: set memory.tiled_layers=false"
            )
    # A pipeline stage after the first holds no input embedding: its first layer saves its input (the hidden states
    # the previous stage sent) like the others.
    input_embedding = unwrap_peft(model).get_input_embeddings()
    found = count and input_embedding is not None
    embedding = _EmbeddingLookup(input_embedding, embedding_multiplier(config)) if found else None
    for index in range(count):
        layer = layers[index]
        intermediate = getattr(getattr(layer, "mlp", None), "intermediate_size", None) or config.intermediate_size
        spec = _LayerTiling(index, tiles or None, config.hidden_size, intermediate, local_attention, offloader,
                            embedding if index == 0 else None, linear_mixer=linear_mixers.get(index))
        setattr(layer, TILED_LAYER_ATTR, spec)
        layer.forward = types.MethodType(_tiled_forward, layer)
    return TiledLayers(list(range(count)), tiles or None)
