"""`check_run`: does longfit compute this run's model exactly, under this run's techniques? Asked of a shrunken copy.

The copy (`longfit.check.shrink`) gets random weights on the CPU (std 0.1, rounded to bf16 values so that every
regime holds the same weights) and two rows of ROW tokens: one document per row, and packed documents (DOCS:
shorter than, about and longer than the windows). The reference is transformers' own model with
attn_implementation="eager" and the cross-entropy of its logits: on the rows as they are for one document per row;
for packed rows, each document run alone, its loss summed and its gradients accumulated (`eager_step`) -- the
semantics of packing for every family, whether or not its eager masks read the documents from the restarting
position_ids (gpt-oss's and Qwen3.5's do not: they attend across a packed row's documents). longfit's steps
(its linear-attention layers through longfit's kernels, as loading routes them), each compared with it on the
loss and every gradient:

1. one process, fp32, no memory technique, one document per row and packed: longfit's attention and objective;
2. one process, fp32, the run's memory techniques (activation checkpointing, offload of the layer inputs to the
   host or `memory.offload_dir`, tiled layers, tiled MLP, chunked loss; small tile and chunk counts so that every
   tile boundary is crossed), packed;
3. under `train.dtype=bf16` (or `auto` on a GPU): step 2 under bf16 autocast, as one rank trains;
4. under `parallel.cp > 1` or `parallel.tp > 1`: gloo ranks (`longfit.check.ranks`), two of each parallelism the run
   has (cp x tp), the run's ring or Ulysses attention, its tensor-parallel split, its techniques and dtype, FSDP2 (its
   bf16 mixed precision under bf16), packed;
5. under a preference objective (`train.objective` dpo, ipo, simpo, orpo; #56): one process, fp32, two pairs
   sharing their prompts in one row (longfit.data.preferences' layout, PreferenceLoss) against prompt + chosen and
   prompt + rejected run as separate sequences through transformers' model, the objective's mean loss over the pairs
   (`pair_steps`). The reference of dpo and ipo: the adapter off under LoRA, else the weights as they are, which a
   full fine-tune's stored log-probabilities hold at its first step.
6. under `train.indexer_loss` > 0 (#57): every step's objective adds the indexers' KL loss, and the reference is its
   dense formula on transformers' model (`indexer_loss_step`); the indexers' gradients, at the fp32 bound's
   floor on the copy, are held to that formula's float64 run (`indexer_gradients_judged`).
7. where the run trains rows with images (#54: `Rehearsal.images`), steps 1-4 again on a packed row of two image
   conversations through a shrunken copy of the wrapper, against the wrapper's own eager forward
   (`longfit.check.media`).
LoRA (`lora.enabled`) puts random adapters (peft, `init_lora_weights=False`, so that every adapter has a gradient)
on the run's target modules on every side, the reference's included; under bf16 longfit's frozen base is stored
in bf16, as the trainer stores it.

Bounds (the test suite's: tests/test_families.py, tests/test_bf16.py, tests/test_bf16_dist.py):
- fp32: every element |x - ref| <= 1e-5 (|ref| + max |ref|) + 1e-8 (FP32_RTOL, FP32_ATOL), for the loss and every
  gradient: relative to the tensor's own scale. The test suite's older bound, 1e-5 + 1e-5 |ref|, is blind to
  the query and key projections' gradients of such copies, whose entries are below 1e-5 (measured: 7e-6 at most
  for a Llama copy, so a 5% error in them passes it); measured errors of correct steps are <= 1.5e-6 of the
  tensor's largest entry (Llama, Qwen2, Mistral, Gemma 3, Qwen3-MoE copies, tiled layers and MLP included).
  The 1e-8 floor covers gradients that are zero in exact arithmetic (a key bias) and fp32 noise in practice.
  Deep copies round more: Gemma 3n's 35 layers (its copy keeps them all) put transformers' own fp32 gradients up to
  9x this bound away from the same model in float64, and longfit's as far (0.5-1.6x transformers' error, measured).
  So where a tensor is beyond the bound, the step is compared with the reference run in float64 too: the tensor
  passes when its largest error against float64 is at most FP32_FACTOR x the largest of transformers' own fp32 runs
  (eager, and SDPA where the model has it: on Gemma 3n's packed rows a ReLU cut at a per-token threshold turns
  rounding into gradients 22x eager's error from float64, in transformers' SDPA run as in longfit's, measured)
  (`compare_fp32`'s `exact`, `others`); an error of a wrong step (1e-4 of an attention output) is far beyond both;
- bf16: bf16 rounds in different places in every implementation, so each tensor's relative error against the
  fp32 reference, |x - ref| / |ref|, must be at most BF16_FACTOR x that of a correct bf16 implementation under
  the same regime (transformers' eager and SDPA attention) + a floor (BF16_GRAD_FLOOR, BF16_LOSS_FLOOR), their
  error counted at most up to the ceiling of a bf16-sized error (2^-4 under autocast, 2^-3 under FSDP2 whose
  residual stream is bf16 too); a tensor that every correct implementation gets wrong by more than the ceiling is
  bf16 noise in all of them, bounded by BF16_FACTOR x their absolute error (`compare_bf16`), more for a tensor of
  fewer than ten values, whose noises' norms scatter widely (`noise_factor`).
Where step 1 differs, the refusal names the first module of the copy whose inputs agree with the reference and
whose output does not (forward hooks on every module, both sides; the packed reference's documents laid back
into the rows, a tensor that is not per token left uncompared) -- e.g. layer 1's `self_attn` -- and the kind
of layer it stands for; where the forward agrees everywhere, the gradient of the highest layer that differs (a
backward error reaches the layers below it). Where a later step differs, it names the step's technique and the
tensor. Anything that raises on longfit's side (a refused attention feature, a parallelism rule) is the refusal,
with the innermost module that was running when it did (`failures_named`).

Not rehearsed: QLoRA's 4-bit base and `memory.checkpoint_dtype` (lossy by design, bounded in tests/test_bf16.py),
pipeline parallelism: the report says so.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from longfit.check.shrink import LayerKind, ModelFails, ShrunkConfig, causal_lm, every_expert, shrink_config
from longfit.check.steps import (  # noqa: F401 -- BF16_FACTOR, fp32_excess: the tests' bounds under parity's names
    AUTOCAST_CEILING, BF16, BF16_FACTOR, CHECK_CP, CHECK_TP, FP32_FACTOR, FSDP_CEILING, Comparison, Step,
    _at_least_fp32, _close, _grads, _in_bf16, _missing, compare_bf16, compare_fp32, cp_step, fp32_excess, rounding_excess)
from longfit.config import Config, ConfigError, load_config

ROW = 64
DOCS = [[10, 37, 17], [40, 24]]
PAIRS = [(14, 6, 9), (21, 5, 3)]  # (prompt, chosen, rejected) tokens: two pairs in a row of ROW, answers unequal
LOSS_CHUNK, TILES = 24, 3  # a loss chunk and tile counts that do not divide the 64-token rows
LORA_RANK = 4


NOT_EXACT = "is not computed exactly"
REFUSED = "is refused by longfit"
STEP_FAILS = "fails in longfit's step"


class NotExact(ConfigError):
    """longfit does not compute the checked model exactly; the message names the layer and part, or the step."""


class PartRefused(Exception):
    """A part of the model longfit's step cannot take (raised while building it, where the run's own config is not
    at fault: not a ConfigError, which `_steps` lets through)."""


@dataclass
class Setup:
    """What a step needs, picklable for the spawned ranks."""

    config_values: dict
    lora_targets: list[str]
    memory: list[str]
    """memory.* overrides of the run's techniques for the copy (empty: none)."""
    memory_techniques: bool
    """Any of them on."""
    dtype: torch.dtype
    cp_method: str
    seed: int
    offload_to_disk: bool = False
    """The run offloads layer inputs to disk (memory.offload_dir): the copy's go to `offload_dir`."""
    offload_dir: str | None = None
    disable_dropout: bool = True
    """train.disable_dropout: every dropout module of the copy at p=0 too (its config's dropout is 0 already)."""
    indexer_loss: float = 0.0
    """train.indexer_loss (#57): longfit's objective adds the indexers' KL loss, the reference its dense formula
    (`indexer_loss_step`)."""

    def config(self):
        from transformers import AutoConfig

        values = dict(self.config_values)
        return AutoConfig.for_model(values.pop("model_type"), **values)

    def check_config(self, cp: int = 1, tp: int = 1) -> Config:
        dtype = "bf16" if self.dtype == BF16 else "fp32"
        offload = [f"memory.offload_dir={self.offload_dir}"] if self.offload_dir else []
        return load_config(None, [f"seq_len={ROW}", f"parallel.cp={cp}", f"parallel.cp_method={self.cp_method}",
                                  f"parallel.tp={tp}",
                                  f"train.dtype={dtype}", f"train.seed={self.seed}",
                                  f"train.indexer_loss={self.indexer_loss}", *self.memory, *offload])

    def reference_step(self, model: torch.nn.Module, batch, autocast: bool = False, record: bool = False) -> "Step":
        """transformers' `model` on `batch` under the run's objective: `eager_step`, or under train.indexer_loss its
        dense formula (`indexer_loss_step`)."""
        if not self.indexer_loss:
            return eager_step(model, batch, autocast=BF16 if autocast else None, record=record)
        return indexer_loss_step(model, batch, self.indexer_loss, autocast=autocast, record=record)


@dataclass
class CheckReport:
    model: str
    shrunk: ShrunkConfig
    parameters: int
    techniques: list[str]
    notes: list[str]
    comparisons: list[Comparison] = field(default_factory=list)
    refusal: str | None = None
    refused: bool = False
    """The refusal is longfit's own (a part it does not compute: ConfigError), not a difference or a failure."""

    @property
    def exact(self) -> bool:
        return self.refusal is None

    def lines(self) -> list[str]:
        """What `longfit check` prints: the copy, the techniques, one line per comparison, then "exact" (or nothing:
        `raise_if_not_exact` says what differs)."""
        from longfit.models.attention import layer_configs, layer_head_shape

        c = self.shrunk.config
        kinds = "; ".join(f"layer {k.index}: {k.describe()}" for k in self.shrunk.kinds)
        heads = "no attention heads"
        if getattr(c, "num_attention_heads", None):  # key/value heads per layer: Gemma 4's global layers have fewer
            kv_heads = sorted({layer_head_shape(layer)[1] for layer in layer_configs(c)}, reverse=True)
            heads = f"{c.num_attention_heads} query heads / {' or '.join(map(str, kv_heads))} key-value heads"
        out = [f"longfit check: {self.model} as a shrunken copy of {len(self.shrunk.kinds)} of its "
               f"{self.shrunk.full_layers} layers ({kinds})",
               f"  hidden {getattr(c, 'hidden_size', 'in sub-configs')}, {heads}, vocabulary {c.vocab_size}: "
               f"{self.parameters / 1e6:.2f}M parameters, "
               f"random weights, on the CPU",
               f"  rows of {ROW} tokens, one document per row and packed {DOCS}; against transformers' eager attention"
               " (packed: each document alone)",
               f"  techniques: {', '.join(self.techniques) or 'none'}"]
        out += [f"  note: {note}" for note in [*self.shrunk.notes, *self.notes]]
        out += [comparison.line() for comparison in self.comparisons]
        if self.exact:
            out.append("exact")
        return out

    def raise_if_not_exact(self) -> None:
        if self.refusal is not None:
            raise NotExact(f"{self.model} {REFUSED if self.refused else NOT_EXACT}: {self.refusal}")


# -- models and batches ---------------------------------------------------------------------------------

class _ScopedMemo:
    """What a function made, by its key, remembered inside `scope()` only (#52: one check's repeated work made
    once); nested scopes share the outermost one's, and it is dropped when that one ends."""

    def __init__(self) -> None:
        self.made: dict[str, object] | None = None

    @contextlib.contextmanager
    def scope(self):
        outer, self.made = self.made, {} if self.made is None else self.made
        try:
            yield
        finally:
            self.made = outer

    @property
    def active(self) -> bool:
        return self.made is not None

    def get(self, key: str, make):
        """Inside a scope: what the first `make()` for `key` made."""
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]


_BUILT = _ScopedMemo()
"""Inside `reused_builds`: each copy `build` made, before its weights are drawn, by what decides it."""


def reused_builds():
    """`build` deep-copies a copy it made before for the same config, attention, LoRA targets and dropout switch,
    rather than making it again (#52: peft's injection into each layer of a deep copy, Gemma 4's 35, costs a second
    a build); the weights are drawn afresh either way, so the model is the same. One check's builds: the copies
    are dropped after it."""
    return _BUILT.scope()


def build(setup: Setup, attn: str) -> torch.nn.Module:
    """The copy with `attn` attention, seeded random weights (std 0.1, bf16 values), LoRA adapters when asked."""
    if not _BUILT.active:
        model = _made(setup, attn)
    else:
        key = json.dumps([setup.config_values, attn, setup.lora_targets, setup.disable_dropout], sort_keys=True,
                         default=repr)
        # callers change theirs (bf16 storage, gradients): the original stays
        model = copy.deepcopy(_BUILT.get(key, lambda: _made(setup, attn)))
    generator = torch.Generator().manual_seed(setup.seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_((torch.randn(param.shape, generator=generator) * 0.1).to(BF16).float())
    return model


def _made(setup: Setup, attn: str) -> torch.nn.Module:
    """`build`'s copy before its weights are drawn."""
    try:
        model = causal_lm(setup.config(), attn_implementation=attn, dtype=torch.float32)
    except KeyError as error:
        if error.args != (attn,):
            raise
        raise PartRefused(f"the {setup.config_values['model_type']} model picks its attention class by name (a "
                          f"KeyError for {attn!r}) from classes that compute attention themselves, not through "
                          "transformers' AttentionInterface, so longfit's attention cannot replace it") from error
    model.config.use_cache = False
    if setup.disable_dropout:  # before peft: LoRA's dropout is lora.dropout's, checked as 0
        from longfit.models.dropout import disable_dropout_modules

        disable_dropout_modules(model)
    if attn not in ("eager", "sdpa"):  # longfit's attention: its linear-attention kernels too, as loading routes them
        from longfit.models.linear_attention import prepare_linear_attention
        from longfit.models.sparse_attention import prepare_sparse_attention

        prepare_sparse_attention(model)
        try:
            prepare_linear_attention(model)
        except ConfigError as error:  # a layer longfit cannot compute: the model's, not the run's config's fault
            raise PartRefused(str(error)) from error
    if setup.lora_targets:
        from longfit.models.build import peft_quietly

        with peft_quietly(unquantized=True):
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, init_lora_weights=False,
                                                     target_modules=setup.lora_targets))
    return model


def rows(doc_lengths: list[list[int]], seed: int, vocab: int):
    """Rows of ROW random tokens drawn from `seed`, row b packing documents of doc_lengths[b] tokens."""
    from longfit.data.packing import PackedBatch

    input_ids = torch.randint(0, vocab, (len(doc_lengths), ROW), generator=torch.Generator().manual_seed(seed))
    return PackedBatch.of_documents(input_ids, doc_lengths)


def batches(vocab: int, seed: int) -> dict[str, object]:
    from longfit.data.packing import PackedBatch

    one = rows([[ROW], [ROW]], seed + 1, vocab)
    return {"one document per row": PackedBatch(one.input_ids, one.labels, one.position_ids, None,
                                                one.num_label_tokens),
            "packed": rows(DOCS, seed + 1, vocab)}


@contextlib.contextmanager
def recording(model: torch.nn.Module, into: dict):
    """Forward hooks on every module of `model`: the first call's floating-point tensor inputs and output."""

    def first_tensor(value):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
        return None

    def hook(name):
        def record(module, args, kwargs, output):
            out = first_tensor(output)
            if name in into or out is None or not out.is_floating_point():
                return
            inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            into[name] = ([t.detach().float().clone() for t in inputs], out.detach().float().clone())
        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in model.named_modules() if n]
    try:
        yield into
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def attention_calls(model: torch.nn.Module, into: set):
    """The names of the modules of `model` that call longfit's attention function while inside, added to `into`."""
    from transformers import AttentionInterface

    from longfit.models.attention import ATTENTION_NAME, longfit_attention_forward

    names = {module: name for name, module in model.named_modules()}

    def counted(module, *args, **kwargs):
        into.add(names.get(module, ""))
        return longfit_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, counted)
    try:
        yield into
    finally:
        AttentionInterface.register(ATTENTION_NAME, longfit_attention_forward)


class StepFailed(Exception):
    """A step raised inside a module of the copy: `module` names the innermost one that was running."""

    def __init__(self, module: str, error: Exception):
        super().__init__(str(error))
        self.module, self.error = module, error


@contextlib.contextmanager
def failures_named(model: torch.nn.Module):
    """Re-raise an exception of the forward as StepFailed naming the innermost module running when it came."""
    running: list[str] = []

    def enter(name):
        return lambda module, args: running.append(name)

    def leave(module, args, output):
        running.pop()

    handles = [h for n, m in model.named_modules() if n
               for h in (m.register_forward_pre_hook(enter(n)), m.register_forward_hook(leave))]
    try:
        yield
    except Exception as error:
        if not running:
            raise
        raise StepFailed(running[-1], error) from error
    finally:
        for handle in handles:
            handle.remove()


def eager_step(model: torch.nn.Module, batch, autocast: torch.dtype | None = None, record: bool = False) -> Step:
    """transformers' forward, cross-entropy of fp32 logits. One document per row (cu_seqlens None): the rows as they
    are. Packed rows: each document run alone (`documents`), its loss summed into the batch's and its gradients
    accumulated -- the semantics of packing, whatever masks a family's eager attention builds from restarting
    position_ids (gpt-oss's and Qwen3.5's attend across the documents of a packed row); each module's recorded
    input and output laid back into the packed rows (`_laid_out`)."""
    with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
        if batch.cu_seqlens is None:
            modules: dict = {}
            with recording(model, modules) if record else contextlib.nullcontext():
                logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
                loss = F.cross_entropy(_at_least_fp32(logits).flatten(0, 1), batch.labels.flatten(),
                                       reduction="sum") / batch.num_label_tokens
            loss.backward()
            return Step(loss.detach().float(), _grads(model), modules)
        loss, pieces = torch.zeros((), dtype=torch.float64), []
        for row, start, end in documents(batch):
            modules = {}
            with recording(model, modules) if record else contextlib.nullcontext():
                logits = model(input_ids=batch.input_ids[row : row + 1, start:end],
                               position_ids=batch.position_ids[row : row + 1, start:end], use_cache=False).logits
                part = F.cross_entropy(_at_least_fp32(logits[0]), batch.labels[row, start:end],
                                       reduction="sum") / batch.num_label_tokens
            part.backward()
            loss += part.detach().double()
            pieces.append(modules)
    return Step(loss.float(), _grads(model), _laid_out(pieces, documents(batch), batch.input_ids.shape) if record else {})


def random_module(setup: Setup, batch) -> str | None:
    """The first module (in the order their calls end) whose inputs agree and whose output differs between two forwards of transformers' model of the copy
    on the same rows under different seeds: one that draws random numbers in training (PhiMoE's sparsemixer router,
    attention dropout), which no implementation but transformers' own can match draw for draw; None if none."""
    model = build(setup, "eager")
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        modules: dict = {}
        with torch.no_grad(), recording(model, modules):
            model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        runs.append(modules)
    for name, (inputs, out) in runs[0].items():
        other_inputs, other_out = runs[1].get(name, (None, None))
        if (other_out is not None and len(inputs) == len(other_inputs)
                and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(inputs, other_inputs))
                and not torch.equal(out, other_out)):
            return name
    return None


def documents(batch) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of the packed rows, in order (cu_seqlens: starts over the flattened rows)."""
    width = batch.input_ids.shape[1]
    starts = batch.cu_seqlens.tolist()
    return [(first // width, first % width, first % width + stop - first) for first, stop in zip(starts, starts[1:])]


def _laid_out(pieces: list[dict], docs: list[tuple[int, int, int]], shape: torch.Size) -> dict:
    """Per module, the documents' recorded tensors as the packed rows' (B, W): a tensor whose dimension 1 is every
    document's length (batch first: hidden states, projections) goes to [row, start:end]; dimension 0 (tokens
    flattened: a router's logits, an experts' block) is concatenated in the rows' order; dimension 2 with a batch
    of 1 (heads first) goes to [row, :, start:end]. A tensor that is not per token (a document's own mask) is
    recorded as an empty one, which no module's tensor matches in shape: not compared, the others keep their
    places. A module some document did not call is left out."""
    B, W = shape
    lengths = [end - start for _, start, end in docs]

    def lay(tensors: list[torch.Tensor]) -> torch.Tensor:
        rest = {t.shape[:1] + t.shape[2:] for t in tensors}
        if len(rest) == 1 and all(t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == n for t, n in zip(tensors, lengths)):
            out = tensors[0].new_zeros((B, W, *tensors[0].shape[2:]))
            for t, (row, start, end) in zip(tensors, docs):
                out[row, start:end] = t[0]
            return out
        if len({t.shape[1:] for t in tensors}) == 1 and all(t.dim() >= 1 and t.shape[0] == n
                                                             for t, n in zip(tensors, lengths)):
            return torch.cat(tensors)
        rest = {t.shape[:2] + t.shape[3:] for t in tensors}
        if len(rest) == 1 and all(t.dim() >= 3 and t.shape[0] == 1 and t.shape[2] == n for t, n in zip(tensors, lengths)):
            out = tensors[0].new_zeros((B, tensors[0].shape[1], W, *tensors[0].shape[3:]))
            for t, (row, start, end) in zip(tensors, docs):
                out[row, :, start:end] = t[0]
            return out
        return torch.empty(0)

    laid: dict = {}
    for name in pieces[0]:
        if not all(name in piece for piece in pieces):
            continue
        inputs = [piece[name][0] for piece in pieces]
        if len({len(i) for i in inputs}) != 1:
            continue
        laid[name] = ([lay([i[k] for i in inputs]) for k in range(len(inputs[0]))],
                      lay([piece[name][1] for piece in pieces]))
    return laid


def longfit_step(setup: Setup, batch, techniques: bool, autocast: bool = False, record: bool = False) -> Step:
    """One process: the trainer's objective (CausalLMLoss) with longfit attention; the run's memory techniques when
    `techniques`, under bf16 autocast when `autocast` (LoRA: its frozen base stored in bf16, as the trainer does)."""
    from longfit.memory.apply import apply_memory_techniques, offloaders, release_offload_stores
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.attention import register_attention
    from longfit.models.build import use_lora_storage
    from longfit.parallel.tiled_attention import LocalTileAttention

    model = build(setup, register_attention())
    if autocast and setup.lora_targets:
        use_lora_storage(model, BF16)
    cfg = setup.check_config()
    if techniques:
        apply_memory_techniques(model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence)
        for offloader in offloaders(model):
            offloader.min_offload_bytes = 1024  # the copy's layer inputs are below the 1 MiB default
        loss_module = CausalLMLoss.from_config(model, cfg)
    else:
        loss_module = CausalLMLoss(model, indexer_loss=setup.indexer_loss)
    modules: dict = {}
    called: set[str] = set()
    with recording(model, modules) if record else contextlib.nullcontext(), failures_named(model):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast), attention_calls(model, called):
            loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    loss.backward()
    offloaded = sum(o.stats.offloaded_bytes for o in offloaders(model))
    release_offload_stores(model)
    return Step(loss.detach().float(), _grads(model), modules, offloaded, called)


def trl_router_loss(net: torch.nn.Module, pairs) -> torch.Tensor | float:
    """TRL's DPOTrainer's term with a MoE router loss: router_aux_loss_coef x transformers' own aux_loss of `net`'s
    forward over the pairs' 2 P separate sequences in one batch, right-padded under an attention mask (0 without
    output_router_logits)."""
    import numpy as np

    text_config = net.config.get_text_config()
    if not getattr(text_config, "output_router_logits", False):
        return 0.0
    sequences = [np.concatenate([pair.prompt, answer]) for pair in pairs for answer in (pair.chosen, pair.rejected)]
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = torch.from_numpy(sequence), 1
    return text_config.router_aux_loss_coef * net(input_ids=ids, attention_mask=mask, use_cache=False).aux_loss


def pair_steps(setup: Setup, name: str) -> tuple[Step, Step]:
    """(transformers' eager model on each pair's prompt + chosen and prompt + rejected as separate sequences, longfit's
    PreferenceLoss on the pairs sharing their prompts in one row): the mean over PAIRS of objective `name`'s loss
    (beta 0.5), with a MoE router loss TRL's term, and every gradient (module docstring, step 5)."""
    import numpy as np

    from longfit.data.preferences import Pair, PairLoader
    from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
    from longfit.models.attention import register_attention

    objective = PreferenceObjective(name, beta=0.5)
    generator = torch.Generator().manual_seed(setup.seed + 2)
    vocab = setup.config().get_text_config().vocab_size
    pairs = [Pair(*(torch.randint(0, vocab, (n,), generator=generator).numpy() for n in shape)) for shape in PAIRS]
    lengths = torch.tensor([[len(pair.chosen), len(pair.rejected)] for pair in pairs])

    def answer_sums(net) -> torch.Tensor:  # (P, 2)
        sums = []
        for pair in pairs:
            for answer in (pair.chosen, pair.rejected):
                ids = torch.from_numpy(np.concatenate([pair.prompt, answer])).unsqueeze(0)
                logits = _at_least_fp32(net(input_ids=ids, use_cache=False).logits[0, len(pair.prompt) - 1 : -1])
                sums.append(-F.cross_entropy(logits, ids[0, len(pair.prompt):], reduction="sum"))
        return torch.stack(sums).view(-1, 2)

    model = build(setup, "eager")
    policy, reference = answer_sums(model), None
    if objective.needs_reference:
        with torch.no_grad(), model.disable_adapter() if setup.lora_targets else contextlib.nullcontext():
            reference = answer_sums(model)
    nll_scale = len(pairs) / int(lengths[:, 0].sum())
    loss = objective.pair_losses(policy, reference, lengths, nll_scale)[0].mean() + trl_router_loss(model, pairs)
    loss.backward()
    truth = Step(loss.detach().float(), _grads(model))

    model = build(setup, register_attention())
    loss_module = PreferenceLoss(model, objective)
    batch = next(PairLoader(pairs, "the check's pairs", ROW, 1, pad_id=0, epochs=1))
    if objective.needs_reference and not setup.lora_targets:
        loss_module.stored_reference = torch.zeros(len(pairs), 2)
        loss_module.stored_reference[batch.pair_ids] = loss_module.reference_sums(batch)
    step = StepPairs(batch.pairs, int(lengths[:, 0].sum()))
    with failures_named(model):
        value, _ = pair_loss_sum(loss_module, batch, step)
    (value / step.pairs).backward()
    return truth, Step(value.detach().float() / step.pairs, _grads(model))


def cp_worker(rank: int, world_size: int, setup: Setup, cp: int, tp: int) -> Step:
    """One rank of the context- and tensor-parallel step of the copy `setup` describes, on its packed rows
    (`cp_step`)."""
    from longfit.models.attention import register_attention
    from longfit.models.build import use_lora_storage

    model = build(setup, register_attention())
    if setup.dtype == BF16 and setup.lora_targets:
        use_lora_storage(model, BF16)
    batch = batches(model.config.vocab_size, setup.seed)["packed"]
    return cp_step(world_size, model, setup.check_config(cp=cp, tp=tp), batch, setup.dtype)


# -- the reference of train.indexer_loss (#57) ----------------------------------------------------------------------
# The plain reference of `train.indexer_loss` (#57) that `longfit check` and tests/test_sparse_attention.py compare
# longfit's step with: DeepSeek-V3.2's sparse-stage objective (its report, section 2.1) written out densely on
# transformers' eager model, L x L, one document at a time.
#
#     loss = (cross-entropy + weight x sum over indexed layers and queries t of KL(p[t, S_t] || softmax(I[t, S_t])))
#            / the label tokens,
#
# I the index scores computed from the indexer's weights on its detached inputs, S_t transformers' top-k of query t
# (its future keys masked), p transformers' eager attention weights of the layer (detached) summed over heads,
# restricted to S_t and L1-normalised. Nothing of longfit's runs here: the selection is transformers' indexer's
# output, the target its attention's weights, the scores its indexer's modules applied in the formula's order.
#
# The indexers' weights get their gradient from this loss alone, and on a checked copy (weights of std 0.1, near-uniform
# index scores and attention) it is small: entries of about 1e-8, at the floor of the fp32 bound, which would pass
# any of them, a wrong one included. So `indexer_gradients_judged` holds each of them to the float64 run instead, as
# the check's rounding rule does (within FP32_FACTOR x transformers' own fp32 error against float64: the fp32
# reference's is 2e-5 to 2e-4 of the tensor's largest entry, measured; longfit's 0.2 to 0.6 x the allowance).


def _index_scores(indexer: torch.nn.Module, hidden, q_latent, cos, sin) -> torch.Tensor:
    """(S, S) index scores of one document, every query against every key, in the reference's precision (float64 in
    a float64 model, else fp32)."""
    from longfit.models.sparse_attention import INDEXED_ATTENTION

    rotate = getattr(sys.modules[type(indexer).__module__], INDEXED_ATTENTION[indexer.config.model_type])
    S, rope, Di, Hi = hidden.shape[1], indexer.qk_rope_head_dim, indexer.head_dim, indexer.n_heads
    q = indexer.wq_b(q_latent).view(1, S, Hi, Di)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = rotate(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    wide = torch.promote_types(q.dtype, torch.float32)
    q, k = torch.cat([q_rot, q[..., rope:]], -1).to(wide), torch.cat([k_rot, k[..., rope:]], -1)[:, :, 0].to(wide)
    relu = F.relu(torch.einsum("bshd,btd->bsht", q, k) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).to(wide) * Hi**-0.5
    return torch.einsum("bsh,bsht->bst", weights, relu)[0]


def _kl(indexer: torch.nn.Module, call: dict) -> torch.Tensor:
    """The layer's sum over its queries of KL(p[t, S_t] || softmax(I[t, S_t]))."""
    scores = _index_scores(indexer, *call["inputs"])
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, call["picked"], True) & call["causal"]
    target = call["weights"].sum(0) * chosen
    target = target.to(torch.promote_types(target.dtype, torch.float32))
    target = target / target.sum(-1, keepdim=True)
    log_probs = scores.masked_fill(~chosen, float("-inf")).log_softmax(-1).masked_fill(~chosen, 0.0)
    return (torch.xlogy(target, target) - target * log_probs).sum()


def indexer_loss_step(model: torch.nn.Module, batch, weight: float, autocast: bool = False,
                      record: bool = False) -> Step:
    """transformers' `model` (eager or SDPA attention) on `batch`, each document alone (the semantics of packing), its
    loss the module docstring's; under bf16 autocast when `autocast`. SDPA returns no weights: p is then transformers'
    eager attention on the same inputs. `record`: each module's first inputs and output, laid back into the rows."""
    spans = documents(batch) if batch.cu_seqlens is not None else [(b, 0, ROW) for b in range(len(batch.input_ids))]
    attentions = [m for m in model.modules() if getattr(m, "indexer", None) is not None and hasattr(m, "kv_b_proj")]
    total, pieces = torch.zeros((), dtype=torch.float64), []
    for row, start, end in spans:
        calls: dict[torch.nn.Module, dict] = {}

        def indexer_call(indexer, args, kwargs, output):
            hidden, q_latent, (cos, sin), mask = args[:4]
            causal = mask[0] if mask.dtype == torch.bool else mask[0] == 0  # (S, S) the keys each query may see
            calls.setdefault(indexer, {}).update(inputs=(hidden.detach(), q_latent.detach(), cos, sin),
                                                 picked=output[0].long(), causal=causal)

        def attention_call(attention, args, kwargs, output):
            weights = output[1]
            if weights is None:  # SDPA's: the weights of transformers' eager attention on the same inputs
                implementation, attention.config._attn_implementation = attention.config._attn_implementation, "eager"
                with torch.no_grad():
                    weights = type(attention).forward(attention, *args, **kwargs)[1]
                attention.config._attn_implementation = implementation
            calls.setdefault(attention.indexer, {})["weights"] = weights.detach()[0]  # (H, S, S)

        handles = [a.indexer.register_forward_hook(indexer_call, with_kwargs=True) for a in attentions]
        handles += [a.register_forward_hook(attention_call, with_kwargs=True) for a in attentions]
        modules: dict = {}
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                    recording(model, modules) if record else contextlib.nullcontext():
                logits = model(input_ids=batch.input_ids[row : row + 1, start:end],
                               position_ids=batch.position_ids[row : row + 1, start:end], use_cache=False).logits
                loss = F.cross_entropy(_at_least_fp32(logits[0]), batch.labels[row, start:end], reduction="sum")
                if len(calls) != len(attentions) or not all("weights" in call for call in calls.values()):
                    raise RuntimeError("transformers' indexed attention was not called as the reference expects")
                for indexer, call in calls.items():
                    loss = loss + weight * _kl(indexer, call)
        finally:
            for handle in handles:
                handle.remove()
        (loss / batch.num_label_tokens).backward()
        total += loss.detach().double() / batch.num_label_tokens
        pieces.append(modules)
    return Step(total.float(), _grads(model), _laid_out(pieces, spans, batch.input_ids.shape) if record else {})


def indexer_gradients_judged(comparison: Comparison, got: Step, truth: Step, exact: Step) -> Comparison:
    """`comparison` (`compare_fp32` of `got` against `truth`) with every indexer weight's gradient judged against the
    float64 run `exact` alone: within FP32_FACTOR x the fp32 reference's own error against it (module docstring)."""
    excess = {n: rounding_excess(got.grads[n], [ref], exact.grads[n]) for n, ref in truth.grads.items()
              if ".indexer." in n and ref is not None and got.grads.get(n) is not None}
    return replace(comparison, worst=max([comparison.worst, *excess.items()], key=lambda item: item[1]),
                   bound=f"{comparison.bound}; the indexers' gradients within {FP32_FACTOR:g}x transformers' own fp32 "
                         "error against float64")


# -- comparisons ----------------------------------------------------------------------------------------


def float64_step(setup: Setup, batch) -> Step:
    """transformers' eager model of the copy run in float64 (`Setup.reference_step`): what the fp32 runs round. Its experts
    run transformers' eager loop (torch's grouped matmul takes no float64)."""
    model = build(setup, "eager").double()
    if hasattr(model, "set_experts_implementation") and getattr(model.config, "_experts_implementation", None):
        model.set_experts_implementation("eager")
    return setup.reference_step(model, batch)


def rounding_references(setup: Setup, batch) -> tuple[Step, list[Step]]:
    """`compare_fp32`'s `exact` and `others` for `batch`: the float64 run and transformers' SDPA run where the model
    has one."""
    return float64_step(setup, batch), [eager_step(build(setup, "sdpa"), batch)
                                        for attn in bf16_references(setup) if attn == "sdpa"]


LAYER_INDEX = re.compile(r"\.(\d+)\.")
"""A decoder layer's index in a module's name: its first numbered entry (`model.layers.1.`, GPT-2's `transformer.h.1.`;
experts come after it)."""


def _layer_of(name: str) -> int | None:
    match = LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def _part(name: str) -> str:
    """`base_model.model.model.layers.1.self_attn.q_proj.weight` -> `self_attn.q_proj.weight`."""
    return LAYER_INDEX.split(name, maxsplit=1)[-1]


ATTENTION_PART = re.compile(r"^(?!linear_)([a-z]+_)?(attn|attention)$")
"""The name of transformers' softmax attention modules (`self_attn`, `attention`, `self_attention`, XLNet's
`rel_attn`; not the linear-attention layers' `linear_attn`, which longfit's linear kernels compute, nor a norm
`layernorm_before_attention`)."""


def bypasses_attention(got: Step, name: str) -> bool:
    """Whether the module `name`, by its name a softmax attention module of a decoder layer, ran in a layer where
    longfit's attention function was never called: its scores are its own code (TrOCR, GPT-NeoX-Japanese, CPM-Ant), not
    transformers' AttentionInterface, so longfit's kernels, documents and context parallelism never reach it."""
    layer = _layer_of(name + ".")
    if layer is None or not ATTENTION_PART.search(name.rsplit(".", 1)[-1]):
        return False
    return not any(_layer_of(called + ".") == layer for called in got.attention_calls)


def _bypassing(name: str, kinds: list[LayerKind]) -> tuple[str, bool]:
    return _where(name, kinds, "{part} computes its attention itself, not through transformers' AttentionInterface "
                  "(longfit's attention is never called in this layer), so longfit's kernels, document boundaries and "
                  "context parallelism cannot replace it"), True


def locate(got: Step, truth: Step, kinds: list[LayerKind], what: str) -> tuple[str, bool]:
    """The first module whose inputs agree with the reference and whose output does not; else the highest layer
    whose gradients differ (module docstring). And whether that is longfit's refusal rather than a difference: an
    attention module that does not call longfit's attention (`bypasses_attention`), the one that differs or, where
    no module's output can be compared (CPM-Ant's prepended prompt tokens), any."""
    for name, (inputs, out) in got.modules.items():
        if name not in truth.modules:
            continue
        ref_inputs, ref_out = truth.modules[name]
        shared = [(x, r) for x, r in zip(inputs, ref_inputs) if x.shape == r.shape]
        if out.shape == ref_out.shape and all(_close(x, r) for x, r in shared) and not _close(out, ref_out):
            if bypasses_attention(got, name):
                return _bypassing(name, kinds)
            error = float((out.double() - ref_out.double()).abs().max())
            return _where(name, kinds, f"the output of {{part}} differs by {error:.1e} {what}"), False
    bypassing = [name for name in got.modules if bypasses_attention(got, name)]
    if bypassing:
        return _bypassing(bypassing[0], kinds)
    if not _close(got.loss, truth.loss):
        error = float((got.loss - truth.loss).abs())
        return (f"every module's output agrees and the loss differs by {error:.1e} {what}: what the causal LM does "
                "between its last hidden states and the logits outside any module (e.g. a logit scale) is not what "
                "longfit's loss computes"), False
    differing = [n for n, ref in truth.grads.items()
                 if ref is not None and got.grads.get(n) is not None and not _close(got.grads[n], ref)]
    if not differing:
        return f"the loss differs {what}", False
    layered = [n for n in differing if _layer_of(n) is not None]
    name = max(layered, key=_layer_of) if layered else differing[0]
    error = float((got.grads[name].double() - truth.grads[name].double()).abs().max())
    return _where(name, kinds, f"the forward agrees, the gradient of {{part}} differs by {error:.1e} {what}"), False


def _where(name: str, kinds: list[LayerKind], text: str) -> str:
    layer = _layer_of(name + ".")
    if layer is None:
        return text.format(part=name)
    return f"layer {layer}, {kinds[layer].describe()}: " + text.format(part=_part(name))


# -- the run --------------------------------------------------------------------------------------------

def _setup(cfg: Config, device_type: str, shrunk: ShrunkConfig, meta: torch.nn.Module, vocab_size: int,
           notes: list[str], techniques: list[str]) -> Setup:
    """The run's techniques as the copy's settings: every `auto` decided for the run's device and sequence. `meta`:
    the copy's model on the meta device, read, not changed."""
    from longfit.memory.switches import resolve_memory_switches
    from longfit.memory.tiled_mlp import untileable_mlp
    from longfit.models.linear_attention import untileable_layers
    from longfit.models.loading import compute_dtype

    dtype = compute_dtype(cfg.train.dtype, torch.device(device_type))
    if device_type == "cuda" and cfg.train.dtype == "auto":
        dtype = BF16  # the GPUs longfit trains on support bf16
    linear_attention = any(kind.name == "linear_attention" for kind in shrunk.kinds)  # decides tiled layers under cp
    switches = resolve_memory_switches(cfg, device_type, vocab_size, linear_attention=linear_attention,
                                       untileable_mlp=untileable_mlp(meta), untileable_layers=untileable_layers(meta))
    memory = [f"memory.activation_checkpointing={str(switches.activation_checkpointing).lower()}",
              f"memory.checkpoint_fraction={switches.checkpoint_fraction}",
              f"memory.offload_activations={str(switches.offload_activations).lower()}",
              f"memory.tiled_layers={str(switches.tiled_layers).lower()}", f"memory.layer_tiles={TILES}",
              f"memory.tiled_mlp={str(switches.tiled_mlp).lower()}", f"memory.mlp_tiles={TILES}",
              f"memory.chunked_loss={str(switches.chunked_loss).lower()}", f"memory.loss_chunk={LOSS_CHUNK}"]
    named = [("activation checkpointing", switches.activation_checkpointing and not switches.tiled_layers),
             ("offload of the layer inputs" + (" to disk" if switches.offload_dir else ""), switches.offload_activations),
             ("tiled layers", switches.tiled_layers), ("tiled MLP", switches.tiled_mlp),
             ("chunked loss", switches.chunked_loss)]
    techniques += [name for name, on in named if on]
    if switches.checkpoint_dtype:
        notes.append(f"memory.checkpoint_dtype={switches.checkpoint_dtype} stores layer inputs lossily by design: "
                     "checked storing them as they are")
    lora_targets: list[str] = []
    if cfg.lora.enabled:
        present = {name.rsplit(".", 1)[-1] for name, _ in meta.named_modules()}
        lora_targets = [t for t in cfg.lora.target_modules if t in present]
        if not lora_targets:
            raise ConfigError(f"lora.target_modules={cfg.lora.target_modules}: none of them is a module of "
                              f"{cfg.model}; name some of its projections")
        techniques.append(f"LoRA on {', '.join(lora_targets)}")
        if cfg.lora.quantize_base:
            notes.append("lora.quantize_base: the 4-bit NF4 base is lossy by design: checked with a bf16 base")
        if cfg.lora.dropout:
            notes.append(f"lora.dropout={cfg.lora.dropout} checked as 0 (dropout draws random masks)")
    if dtype == BF16:
        techniques.insert(0, "train.dtype=bf16")
    if cfg.parallel.cp > 1:
        techniques.append(f"parallel.cp={cfg.parallel.cp} {cfg.parallel.cp_method}"
                          + (f" (checked on {CHECK_CP} gloo ranks)" if cfg.parallel.cp != CHECK_CP else " (gloo ranks)"))
    if cfg.parallel.tp > 1:
        checked = f" (checked on {CHECK_TP} gloo ranks)" if cfg.parallel.tp != CHECK_TP else " (gloo ranks)"
        techniques.append(f"parallel.tp={cfg.parallel.tp}{checked}")
    if cfg.parallel.pp > 1:  # the stage cut's exactness: tests/test_parallel_pipeline.py, per proven family
        notes.append(f"parallel.pp={cfg.parallel.pp} is not rehearsed by longfit check")
    values = shrunk.config.to_dict()
    return Setup(values, lora_targets, memory, any(on for _, on in named), dtype, cfg.parallel.cp_method, cfg.train.seed,
                 offload_to_disk=bool(switches.offload_dir), disable_dropout=cfg.train.disable_dropout,
                 indexer_loss=cfg.train.indexer_loss)


def _meta_model(shrunk: ShrunkConfig):
    with torch.device("meta"):
        return causal_lm(shrunk.config, attn_implementation="eager")


def _refusal(error: Exception, kinds: list[LayerKind]) -> tuple[str, bool]:
    """One line: where longfit's step refused or failed (the module, when known) and the error's own first line (a
    spawned rank's: the last line of its traceback); and whether it is longfit's refusal (a ConfigError naming a
    part it does not compute) rather than a failure."""
    cause = error.error if isinstance(error, StepFailed) else error
    refused = isinstance(cause, (ConfigError, PartRefused)) or "longfit.config.ConfigError" in str(error)
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = (lines[-1] if "Traceback" in str(error) else lines[0]) if lines else type(error).__name__
    if not refused:
        text = f"{type(cause).__name__}: {text}" if "Traceback" not in str(error) else text
    if isinstance(error, StepFailed):
        return _where(error.module, kinds, f"{{part}}: {text}" if refused else f"{{part}} {STEP_FAILS}: {text}"), refused
    return (text if refused else f"the copy {STEP_FAILS}: {text}"), refused


@dataclass
class Rehearsal:
    """What `check_run` rehearses of a run, before any step: the run's model config, its copy and the techniques."""

    config: object
    """The run's text config (`resolve_model_config`: its RoPE, its dropout under train.disable_dropout)."""
    shrunk: ShrunkConfig
    setup: Setup
    """The run's techniques resolved for its device and sequence, as the copy runs them."""
    checked_cp: int
    """The context-parallel degree the check runs: 1, or CHECK_CP ranks for any parallel.cp > 1."""
    checked_tp: int
    """The tensor-parallel degree the check runs: 1, or CHECK_TP ranks for any parallel.tp > 1."""
    notes: list[str]
    techniques: list[str]
    images: str | None = None
    """train.vision where the run trains rows with images (`longfit.models.media.trains_media`): the check then
    proves the image path too (`longfit.check.media`); None: text rows."""


_REHEARSED = _ScopedMemo()
"""Inside `reused_rehearsals`: each rehearsal made, by the run's config and device type."""


def reused_rehearsals():
    """`rehearsal` answers a second time for the same config and device type from the first time (#52: the gate
    keys its verdict by the rehearsal, then the check makes it again: the model's config read, the copy shrunk,
    meta-device models built)."""
    return _REHEARSED.scope()


def rehearsal(cfg: Config, device_type: str) -> Rehearsal:
    """The copy of `cfg.model` and `cfg`'s techniques as `check_run` checks them on `device_type`; NotExact for a
    model refused before any step (state-space layers, sparse attention, a copy that cannot be built), ConfigError
    for a run's config that is wrong for the model."""
    if not _REHEARSED.active:
        return _rehearsed(cfg, device_type)
    key = json.dumps([cfg.to_dict(), device_type], sort_keys=True, default=repr)
    made = _REHEARSED.get(key, lambda: _rehearsed(cfg, device_type))
    return replace(made, notes=list(made.notes), techniques=list(made.techniques))  # the check adds notes to its own


def _rehearsed(cfg: Config, device_type: str) -> Rehearsal:
    """`rehearsal`, made."""
    from longfit.models.loading import resolve_model_config

    from longfit.models.attention import refuse_alibi
    from longfit.models.document_mixers import refuse_context_parallel
    from longfit.models.linear_attention import prepare_linear_attention
    from longfit.models.sparse_attention import refuse_sparse_attention

    try:
        config = resolve_model_config(cfg.model, cfg)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- reading the config builds the model's class (its tied embeddings)
        raise NotExact(f"{cfg.model}: {ModelFails(e)}") from e
    try:
        refuse_sparse_attention(config)
        shrunk = shrink_config(config, ROW)
        meta = _meta_model(shrunk)
        refuse_alibi(meta)
        if cfg.parallel.cp > 1:  # before any step: a mixer that runs per document runs on one rank
            routed = _meta_model(shrunk)  # the linear-attention kernels put in place: a model of its own
            prepare_linear_attention(routed)
            refuse_context_parallel(routed)
    except ConfigError as e:
        raise NotExact(f"{cfg.model} {REFUSED}: {e}") from e
    except ValueError as e:
        raise NotExact(f"{cfg.model}: {e}") from e
    notes: list[str] = []
    techniques: list[str] = []
    setup = _setup(cfg, device_type, shrunk, meta, config.vocab_size, notes, techniques)
    return Rehearsal(config, shrunk, setup, CHECK_CP if cfg.parallel.cp > 1 else 1,
                     CHECK_TP if cfg.parallel.tp > 1 else 1, notes, techniques, checked_images(cfg))


def checked_images(cfg: Config) -> str | None:
    """`Rehearsal.images` of `cfg`'s run: its train.vision where it trains or evaluates image rows, else None."""
    from longfit.check.media import checks_media

    return cfg.train.vision if checks_media(cfg) else None


def check_run(cfg: Config, device_type: str = "cuda") -> CheckReport:
    """Check that longfit computes `cfg.model` exactly under `cfg`'s techniques, as the run will train on
    `device_type` ("cuda" or "cpu": which `auto` techniques and dtype it gets), on a shrunken copy (module docstring).

    Returns the report; `report.raise_if_not_exact()` raises `NotExact` naming the layer and part that differs.
    """
    planned = rehearsal(cfg, device_type)
    setup = planned.setup
    if setup.offload_to_disk:
        setup = replace(setup, offload_dir=tempfile.mkdtemp(prefix="longfit-check-"))
    try:
        with reused_builds():
            report = _steps(cfg, setup, planned.shrunk, planned.notes, planned.techniques, planned.checked_cp,
                            planned.checked_tp)
            if report.exact and planned.images is not None:
                from longfit.check.media import check_images

                check_images(cfg, setup, planned.shrunk.config, report)
        # a check that ended before its ranks' steps (a refusal, a difference) did not rehearse tp
        if cfg.parallel.tp > 1 and not any(f"tp={CHECK_TP}" in c.name for c in report.comparisons):
            report.notes.append(f"parallel.tp={cfg.parallel.tp} is not rehearsed by longfit check")
        return report
    finally:
        if setup.offload_dir:
            shutil.rmtree(setup.offload_dir, ignore_errors=True)


def _steps(cfg: Config, setup: Setup, shrunk: ShrunkConfig, notes: list[str], techniques: list[str], cp: int,
           tp: int) -> CheckReport:
    """The steps of `check_run` in order, each compared as it comes; the first that differs ends the check."""
    data = batches(shrunk.config.vocab_size, setup.seed)
    eager_models = [build(setup, "eager") for _ in data]  # one fresh model per batch; the first counted
    report = CheckReport(cfg.model, shrunk, sum(p.numel() for p in eager_models[0].parameters()), techniques, notes)
    try:
        truth = {name: setup.reference_step(model, batch, record=True)
                 for model, (name, batch) in zip(eager_models, data.items())}
    except Exception as error:  # transformers' own model of this config does not run: nothing to compare with
        lines = [line for line in str(error).splitlines() if line.strip()]
        raise NotExact(f"{cfg.model}: transformers' eager reference of the shrunken copy fails "
                       f"({type(error).__name__}: {lines[0] if lines else ''}), so longfit check cannot answer") from error

    # Randomness other than dropout is asked before any comparison, not after one fails: a step drawing random numbers
    # (PhiMoE's router jitter) agrees with transformers' only when the two happen to draw alike, so a verdict reached
    # by comparing would depend on the random state the check starts from (a run alone, or after other checks).
    # Dropout left on differs at every draw: the comparison finds it, and `compared` names the switch.
    random_part = random_module(replace(setup, disable_dropout=True), data["one document per row"])
    if random_part is not None:
        report.refused = True
        report.refusal = _where(random_part, shrunk.kinds, "the output of {part} is random in training (two runs of "
                                "transformers' model on the same rows differ), so no step can be compared with it")
        return report

    rounding: dict[str, tuple[Step, list[Step]] | None] = {}
    float64: dict[str, Step] = {}

    def compare(name: str, got: Step, batch_name: str) -> Comparison:
        """`compare_fp32` against transformers' fp32 run of the batch; where a tensor is beyond the fixed bound, with
        the batch's float64 and SDPA runs (made once: two steps). Under train.indexer_loss the indexers' gradients
        are judged against the float64 run alone (`indexer_gradients_judged`: the fixed bound's floor is above them)."""
        comparison = compare_fp32(name, got, truth[batch_name])
        if setup.indexer_loss:
            if batch_name not in float64:
                float64[batch_name] = float64_step(setup, data[batch_name])
            return indexer_gradients_judged(comparison, got, truth[batch_name], float64[batch_name])
        if comparison.ok:
            return comparison
        if batch_name not in rounding:
            try:
                rounding[batch_name] = rounding_references(setup, data[batch_name])
            except Exception:  # noqa: BLE001 -- transformers' model cannot run in float64 (XGLM's mask fill)
                rounding[batch_name] = None
        if rounding[batch_name] is None:
            return comparison
        return compare_fp32(name, got, truth[batch_name], *rounding[batch_name])

    def compared(comparison: Comparison, got: Step, locate_in: Step | None, what: str) -> bool:
        comparison.offloaded_bytes = got.offloaded_bytes
        report.comparisons.append(comparison)
        missing = _missing(got, locate_in or truth["packed"])
        if missing:
            report.refusal = f"{missing} {what}"
        elif not comparison.ok:
            # The copy without dropout draws nothing (asked before the comparisons): randomness now is dropout.
            random_part = None if setup.disable_dropout else random_module(setup, data["one document per row"])
            if random_part is not None:
                report.refused = True
                report.refusal = _where(random_part, shrunk.kinds, "the output of {part} is random in training (two "
                                        "runs of transformers' model on the same rows differ), so no step can be "
                                        "compared with it; it is the model's dropout, which "
                                        "train.disable_dropout=true (the default) turns off")
            elif locate_in is not None:
                report.refusal, report.refused = locate(got, locate_in, shrunk.kinds, what)
            else:
                tensor, excess = comparison.worst
                report.refusal = (f"{_where(tensor, shrunk.kinds, '{part}')} differs {what}, {excess:.1f}x its bound; "
                                  "without the technique it is exact")
        return report.refusal is None

    try:
        for name, batch in data.items():
            what = f"(one process, fp32, {name})"
            got = longfit_step(setup, batch, techniques=False, record=True)
            if not compared(compare(f"one process, fp32, {name}", got, name), got, truth[name], what):
                return report
        if cfg.train.objective != "causal_lm":
            name = f"one process, fp32, {cfg.train.objective} pairs sharing their prompt"
            pair_truth, got = pair_steps(setup, cfg.train.objective)
            if not compared(compare_fp32(name, got, pair_truth), got, None, f"({name})"):
                return report
        packed = data["packed"]
        if setup.memory_techniques:
            what = "(one process, fp32, packed, with the run's memory techniques)"
            got = longfit_step(setup, packed, techniques=True)
            if not compared(compare("one process, fp32, techniques, packed", got, "packed"), got, None, what):
                return report
        bf16_setup, bf16_truth = setup, truth["packed"]
        if setup.dtype == BF16:
            routed = every_expert(shrunk.config)
            if routed is not None:  # the same routing on every side: a top-k flip near a tie is no wrong gradient
                bf16_setup = replace(setup, config_values=routed)
                bf16_truth = bf16_setup.reference_step(build(bf16_setup, "eager"), packed)
                notes.append("under bf16 the mixture of experts is compared with every expert chosen (the routing of "
                             "each token then cannot flip between two experts whose scores bf16 rounds alike)")
            attentions = bf16_references(bf16_setup)
            references = [bf16_setup.reference_step(_as_reference(bf16_setup, attn), packed, autocast=True)
                          for attn in attentions]
            got = longfit_step(bf16_setup, packed, techniques=True, autocast=True)
            what = "(one process, bf16 autocast, techniques, packed)"
            if not compared(compare_bf16("one process, bf16 autocast, techniques, packed", got, references,
                                         bf16_truth, AUTOCAST_CEILING), got, None, what):
                return report
        if cp * tp > 1:  # the run's context and tensor parallelism on cp x tp gloo ranks
            from longfit.check.ranks import run_on_ranks

            ranks = " x ".join([cfg.parallel.cp_method] * (cp > 1) + [f"tp={tp}"] * (tp > 1))
            what = f"({cp * tp} ranks, {ranks}, {'bf16' if setup.dtype == BF16 else 'fp32'}, packed)"
            results = run_on_ranks(cp_worker, cp * tp, bf16_setup, cp, tp)
            if setup.dtype == BF16:
                references = [bf16_setup.reference_step(_in_bf16(build(bf16_setup, attn)), packed) for attn in attentions]
            for rank, got in enumerate(results):
                name = f"rank {rank} of {cp * tp}, {ranks}, techniques, packed"
                comparison = (compare_bf16(name, got, references, bf16_truth, FSDP_CEILING) if setup.dtype == BF16
                              else compare(name, got, "packed"))
                if not compared(comparison, got, None, what):
                    return report
    except ConfigError:
        raise
    except Exception as error:  # longfit refused or failed on this architecture: that is the answer
        report.refusal, report.refused = _refusal(error, shrunk.kinds)
    return report


def bf16_references(setup: Setup) -> list[str]:
    """The attention implementations of transformers whose bf16 error sets the bound: eager, and SDPA where the
    model has it (Gemma 2 and gpt-oss have none: their softcap and sinks)."""
    with torch.device("meta"):
        model = causal_lm(setup.config(), attn_implementation="eager")
    return ["eager", "sdpa"] if getattr(model, "_supports_sdpa", False) else ["eager"]


def _as_reference(setup: Setup, attn: str) -> torch.nn.Module:
    """transformers' model with `attn` under the run's autocast (LoRA: its base stored in bf16, as longfit's)."""
    from longfit.models.build import use_lora_storage

    model = build(setup, attn)
    return use_lora_storage(model, BF16) if setup.lora_targets else model


