"""Traced mode: one real training step of longfit's code path on fake tensors, counting live bytes.

The step is the trainer's (`longfit.train.loop`): the model built by `load_model` on the meta device
(fp32 master weights), peft adapters when LoRA is on, `CausalLMLoss`, `parallelize` (tensor and context
parallelism, the memory techniques, FSDP2 over dp_shard x cp ranks), the trainer's optimizer; then
forward to the summed loss (under bf16 autocast on one rank, as the trainer), backward, gradient
clipping, optimizer step, zero_grad. Everything runs under FakeTensorMode -- tensors carry shapes,
dtypes and storages but no data -- so an 8B model at 128K tokens "runs" on a laptop in seconds. The
process group is torch's fake backend with the run's world size (dp_shard x cp x tp): collectives return
tensors of the right shapes, and FSDP2 and tensor parallelism shard exactly as on the GPUs. `LiveBytes` counts the storages; the peak is this
rank's peak of `torch.cuda.memory_allocated`, and the activation offloader's copies count as host memory.

The trace plans a GPU run on a CPU, so it takes the GPU's decisions where the code would take the CPU's:
`auto` switches resolve as on CUDA (bf16, activation offload from 32K tokens), AdamW is the fused one
`build_optimizer` picks on CUDA. What it cannot reproduce is listed in `TraceResult.notes`: the
8-bit optimizers and QLoRA need CUDA libraries (not traced); Liger's fused loss, used on CUDA when
installed, is traced as longfit's own chunked loss; sliding-window layers run longfit's blockwise
window (models/blockwise.py), where CUDA FlashAttention-2 runs one windowed kernel call with a little
less transient memory.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field

import torch

from longfit.config import Config, ConfigError
from longfit.memory.switches import CheckpointPlacement
from longfit.plan.tracker import LiveBytes, UncompiledDispatchMode, count_as_host


class TraceUnsupported(ConfigError):
    """The configuration cannot be traced on this machine; the message says why and what to use instead."""


@dataclass
class TraceResult:
    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    seconds: float
    world_size: int
    local_tokens: int
    host_peak_bytes: int = 0
    disk_bytes: int = 0
    """Bytes the offload store wrote to its disk tier."""
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _untraceable_named(model):
    """A step of an architecture outside the preset families that fake tensors cannot run (an MoE's grouped matmul
    in fp32, data-dependent routing) is refused in one line; for the preset families such a failure is a bug and
    keeps its traceback."""
    from longfit.plan.shapes import FAMILIES

    model_type = model.config.get_text_config().model_type
    if model_type in FAMILIES:
        yield
        return
    logger = logging.getLogger("torch._subclasses.fake_tensor")  # logs the failure with its traceback, then raises
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise TraceUnsupported(
            f"{model_type}: its training step cannot be traced on fake tensors yet ({type(e).__name__}: "
            f"{lines[0] if lines else ''}); use the analytic plan, which counts its parameters exactly"
        ) from e
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """torch's fake backend for `world_size` ranks (this process is rank 0); nothing for one rank."""
    import torch.distributed as dist

    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise TraceUnsupported(
            "a process group is already initialised; trace from a fresh process (`longfit plan --trace`)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_fake_layouts()


def _forget_fake_layouts() -> None:
    """Empty the DTensor sharding caches the fake process group's work filled. Left behind, they made a later real
    tp step in this process, or in its forks, wrong: `longfit train`'s launcher plans memory before its check, whose
    forked tp ranks then computed o_proj's output wrong on rank 1 (tp=2, LoRA, tiled MLP: loss off by 3.2e-4, o_proj's
    lora_B gradient 5279x its bound, #54), where processes with empty caches compute it exactly."""
    from torch.distributed.tensor import DTensor, _redistribute

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # torch's C++ dispatch (2.10+)
    if clear_native is not None:
        clear_native()
    # the Python caches, which torch names differently across versions: every one of the propagator and redistribution
    propagator = DTensor._op_dispatcher.sharding_propagator
    held = [getattr(propagator, name, None) for name in dir(propagator)] + list(vars(_redistribute).values())
    for cache in held:
        if callable(getattr(cache, "cache_clear", None)):
            cache.cache_clear()


def gpu_config(cfg: Config, free_bytes: int | None = None) -> Config:
    """`cfg` with the `auto` memory switches decided as the trainer decides them on a CUDA device with
    `free_bytes` free at the start (None: unknown), the loss chunk included."""
    from longfit.memory.switches import resolve_memory_switches
    from longfit.plan.shapes import model_shape

    shape = model_shape(cfg.model)
    switches = resolve_memory_switches(cfg, "cuda", shape.vocab, free_bytes, untileable_mlp=shape.untileable_mlp,
                                       untileable_layers=shape.untileable_layers)
    resolved = copy.deepcopy(cfg)
    resolved.memory.offload_activations = switches.offload_activations
    resolved.memory.tiled_mlp = switches.tiled_mlp
    resolved.memory.tiled_layers = switches.tiled_layers
    resolved.memory.keep_attention = switches.keep_attention
    resolved.memory.loss_chunk = switches.loss_chunk or 0
    return resolved


def _optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    from longfit.memory.optim import build_optimizer

    if cfg.memory.optimizer == "adamw":  # build_optimizer's choice for CUDA parameters
        return torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=True)
    if cfg.memory.optimizer == "adamw8bit":
        raise TraceUnsupported(
            "memory.optimizer=adamw8bit runs torchao/bitsandbytes CUDA kernels, which cannot be traced here; use the analytic plan"
        )
    return build_optimizer(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, kind=cfg.memory.optimizer)


def _optimizer_with_state(loss_module, cfg: Config) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """The run's optimizer over `loss_module`'s trainable parameters (returned too), its state created by one step of
    zero gradients: the state exists from the second step on, which the traced step stands for."""
    trainable = [p for p in loss_module.parameters() if p.requires_grad]
    optimizer = _optimizer(trainable, cfg)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer, trainable


class _CountedDisk:
    """The offload store's disk tier on a trace: no file, no data; the bytes written are counted."""

    def __init__(self, directory: str, nbytes: int):
        self.nbytes = nbytes
        self.written = 0  # the end of the furthest write: the file's size in use

    @staticmethod
    def _done():
        import concurrent.futures

        future = concurrent.futures.Future()
        future.set_result(None)
        return future

    def write(self, source, offset: int, ready=None):
        self.written = max(self.written, offset + source.numel())
        return self._done()

    def read(self, target, offset: int, after=None):
        return self._done()

    def close(self) -> None:
        pass


def trace_step(
    cfg: Config,
    world_size: int = 1,
    fake: bool = True,
    free_bytes: int | None = None,
    placement: CheckpointPlacement | None = None,
    device_type: str = "cuda",
    replicated: bool = False,
) -> TraceResult:
    """Peak live tensor bytes of rank 0 over one training step of `cfg` on `world_size` ranks of `device_type`.

    fake=False runs the same step on real CPU tensors (one rank; small models only) -- the reference
    the fake trace is tested against. `free_bytes`: the GPU memory free when the run starts (sizes the
    loss chunk; None: unknown). `placement` is where the offload store keeps each stored layer
    input (the analytic plan's; None: every one in host memory, or on disk with memory.offload_dir). The dtype is
    the analytic plan's (`Setup.regime`: train.dtype=auto is bf16 on CUDA, fp32 on a CPU rank).
    `replicated`: every rank holds the whole model, as a Trainer under Accelerate's DDP (`Setup.replicated`): no
    FSDP2, fp32 weights under autocast, and the gradients allocated before the step as DDP's buckets are.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longfit.memory.apply import offloaders as offloaders_of
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import build_model
    from longfit.parallel.parallelize import autocast_dtype, parallelize
    from longfit.plan.setup import resolve

    if cfg.lora.quantize_base:
        raise TraceUnsupported(
            "lora.quantize_base (QLoRA) quantizes with bitsandbytes, which fake tensors cannot run; use the analytic plan"
        )
    if cfg.parallel.cpu_offload:
        raise TraceUnsupported(
            "parallel.cpu_offload keeps the model states in host memory, which a trace on the CPU cannot tell "
            "apart from device memory; use the analytic plan"
        )
    if not fake and world_size > 1:
        raise TraceUnsupported("a real (non-fake) trace runs one rank only: use world size 1")
    cfg = gpu_config(cfg, free_bytes)
    setup = resolve(cfg, world_size, device_type, replicated=replicated)
    dims = setup.dims
    if dims.pp > 1:
        raise TraceUnsupported(
            f"parallel.pp={dims.pp}: torch.distributed.pipelining's transfers between stages cannot run on fake "
            "tensors; the plan's stages are checked against real pipelined steps on CPU ranks (trace_pipeline_step)"
        )
    notes = []
    if cfg.memory.chunked_loss:
        notes.append(
            "on CUDA with liger-kernel installed the loss runs Liger's fused kernel; traced: longfit's chunked loss"
        )
    local_tokens = cfg.seq_len // dims.cp
    dtype = torch.float32 if setup.regime == "fp32" else torch.bfloat16
    result = TraceResult(0, {}, "", 0.0, world_size, local_tokens, notes=notes)
    started = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    values = _scalars_read_as_one() if fake else contextlib.nullcontext()
    with fake_process_group(dims.world_size if fake else 1), separate_sharding_propagation(), real_meshes(), values:
        mesh = dims.build_mesh("cpu")
        model = build_model(cfg, dtype, "meta" if fake else "cpu", setup.fsdp)
        if getattr(model.config.get_text_config(), "sliding_window", None):
            notes.append(
                "sliding-window layers traced with longfit's blockwise window; on CUDA one FlashAttention-2 call "
                "with a window argument, a little less transient memory"
            )
        with mode, (_GroupedMatmulInItsDtype() if fake else contextlib.nullcontext()):
            if fake:  # materialise whole on the fake device, then let FSDP2 shard it as real weights
                model.to_empty(device="cpu")
                base = model.get_base_model() if cfg.lora.enabled else model
                base.tie_weights()  # to_empty made new tensors for a shared embedding / lm_head weight
            loss_module = CausalLMLoss.from_config(model, cfg)
            loss_module = parallelize(
                loss_module, dims, cfg, mesh, param_dtype=dtype, device="cpu", checkpoint_placement=placement,
                shard=not replicated,
            )
            optimizer, trainable = _optimizer_with_state(loss_module, cfg)
            if replicated:  # DDP's gradient buckets, allocated with the model; the gradients are their views
                for param in trainable:
                    param.grad = torch.zeros_like(param)
            batch = _batch(cfg, setup, local_tokens, model.config.vocab_size, mode if fake else None)
            tracker = LiveBytes(mode if fake else None)
            offloaders = offloaders_of(loss_module)
            for offloader in offloaders:
                count_as_host(offloader, tracker)
                if fake:
                    offloader.store.disk_file = _CountedDisk
            autocast = setup.regime == "autocast" if replicated else autocast_dtype(dims, dtype) is not None
            with _untraceable_named(model):
                _traced_step(tracker, loss_module, optimizer, trainable, batch, cfg, autocast)
        del loss_module, optimizer, trainable, model
    result.peak_bytes, result.peak_phase = tracker.peak, tracker.peak_phase
    result.breakdown = dict(tracker.peak_by_tag)
    result.host_peak_bytes = tracker.host_peak
    result.disk_bytes = sum(o.store.disk.written for o in offloaders if o.store.disk is not None)
    result.seconds = time.perf_counter() - started
    return result


def trace_pipeline_step(cfg: Config, seed: int = 0, placement: CheckpointPlacement | None = None) -> TraceResult:
    """Peak live tensor bytes of this rank over one real training step of `cfg` under parallel.pp, on this process
    group's CPU ranks (gloo; the world size is the run's): the trainer's step (`parallelize` cuts this rank's stage and
    shards it with FSDP2, `Pipeline.step` runs the step's micro-batches through every stage, gradient clipping, the
    optimizer step, zero_grad) on real tensors, the `auto` switches and the optimizer as `trace_step` takes them on
    CUDA. What `longfit plan`'s per-stage rows (`PlanResult.stages`) are tested against: a trace on fake tensors cannot
    run torch.distributed.pipelining's point-to-point transfers. Text rows: one document per row, random token ids.
    Image rows (`Setup.images`, #54): the step's micro-batches as the trainer's loader makes them of the data on this
    rank's dp coordinate, with the vision side (`train.vision` unfrozen) that the first stage keeps and runs
    (parallel/pipeline.py), every micro-batch's images on every stage as the trainer moves them. `placement`: where this
    rank's offload store keeps its stage's checkpointed inputs (the plan's stage's, `PlanResult.stages`; None: every one
    in host memory, or on disk with memory.offload_dir), its arena counted as host memory (`host_peak_bytes`) and its
    disk tier counted, not written (`disk_bytes`), as `trace_step` counts
    them."""
    import itertools

    import torch.distributed as dist

    from longfit.data.packing import PackedBatch, build_dataloader
    from longfit.memory.apply import offloaders as offloaders_of
    from longfit.memory.loss import CausalLMLoss, positioned
    from longfit.models.build import build_model
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import build_media_encoder, media_reader, trainable_parts
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.parallelize import parallelize
    from longfit.parallel.pipeline import Pipeline, holds_first_stage
    from longfit.plan.setup import resolve

    cfg = gpu_config(cfg)
    world_size = dist.get_world_size()
    setup = resolve(cfg, world_size, "cuda")
    dims = setup.dims
    if dims.pp == 1:
        raise TraceUnsupported("trace_pipeline_step traces a run under parallel.pp > 1; use trace_step")
    local_tokens = cfg.seq_len // dims.cp
    dtype = torch.float32 if setup.regime == "fp32" else torch.bfloat16
    result = TraceResult(0, {}, "", 0.0, world_size, local_tokens)
    started = time.perf_counter()
    mesh = dims.build_mesh("cpu")
    model = build_model(cfg, dtype, "meta", dims.fsdp_enabled)
    loss_module = CausalLMLoss.from_config(model, cfg)
    if setup.images is not None and holds_first_stage(mesh.pp_rank, dims, cfg.parallel.pp_schedule):  # as the trainer
        loss_module.media_encoder = build_media_encoder(cfg.model, "cpu")
        trainable_parts(loss_module.media_encoder, cfg.train.vision, cfg.lora, cfg.train.seed)
    loss_module = parallelize(loss_module, dims, cfg, mesh, param_dtype=dtype, device="cpu",
                              checkpoint_placement=placement)
    pipeline = Pipeline(loss_module, cfg, mesh, torch.device("cpu"), dtype)
    optimizer, trainable = _optimizer_with_state(loss_module, cfg)
    if setup.images is None:
        generator = torch.Generator().manual_seed(seed + mesh.dp_rank)  # the same rows on every stage
        rows, vocab = cfg.train.micro_batch, model.config.get_text_config().vocab_size
        micro_batches = [
            PackedBatch(torch.randint(0, vocab, (rows, local_tokens), generator=generator),
                        torch.randint(0, vocab, (rows, local_tokens), generator=generator),
                        torch.arange(local_tokens).repeat(rows, 1), None, rows * local_tokens)
            for _ in range(cfg.train.grad_accum)
        ]
    else:  # the trainer's step: its family's positions on the whole rows (the first stage's tower), then cp's shard
        loader = build_dataloader(cfg, load_tokenizer(cfg.model), mesh.dp_rank, dims.dp_size,
                                  media=media_reader(cfg.model))
        micro_batches = [shard_batch(positioned(loss_module, rows), mesh.cp_rank, dims.cp,
                                     cp_layout(cfg.parallel.cp_method))
                         for rows in itertools.islice(loader, cfg.train.grad_accum)]
    valid = global_valid_tokens([b.labels for b in micro_batches], mesh.world_group)
    tracker = LiveBytes()
    offloaders = offloaders_of(loss_module)
    for offloader in offloaders:
        count_as_host(offloader, tracker)
        offloader.store.disk_file = _CountedDisk
    batch = [t for b in micro_batches for t in (b.input_ids, b.labels, b.position_ids)]
    batch += [t for b in micro_batches if b.media is not None for t in (
        b.media.pixel_values, b.media.grid_thw, b.media.token_types, b.media.embedding_index, b.media.positions)]
    with _counted_step(tracker, loss_module, optimizer, trainable, batch, cfg), tracker.region("pipeline step"):
        pipeline.step(micro_batches, valid)
    result.peak_bytes, result.peak_phase = tracker.peak, tracker.peak_phase
    result.breakdown = dict(tracker.peak_by_tag)
    result.host_peak_bytes = tracker.host_peak
    result.disk_bytes = sum(o.store.disk.written for o in offloaders if o.store.disk is not None)
    for offloader in offloaders:
        offloader.store.close()
    result.seconds = time.perf_counter() - started
    return result


def trace_image_step(cfg: Config, placement: CheckpointPlacement | None = None) -> TraceResult:
    """Peak live tensor bytes of this rank over one real training step of `cfg`'s first batch of image rows (or of
    text rows: no tower then), on this
    process group's CPU ranks (gloo; one rank without a group): the trainer's step (the wrapper's language model
    and vision side, `train.vision` unfrozen, `parallelize`: cp with the images dealt over its ranks, the memory
    techniques, FSDP2; forward, backward, gradient clipping, the optimizer step) counted by `LiveBytes`, the `auto`
    switches and the optimizer as `trace_step` takes them on CUDA. What the plan's vision terms
    are tested against (tests/test_plan_media.py)."""
    import torch.distributed as dist

    from longfit.data.packing import build_dataloader
    from longfit.memory.apply import offloaders as offloaders_of
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum, positioned
    from longfit.models.build import build_model
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import build_media_encoder, media_reader, trainable_parts
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.parallelize import autocast_dtype, parallelize
    from longfit.plan.setup import resolve

    cfg = gpu_config(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    setup = resolve(cfg, world, "cuda")
    dims = setup.dims
    dtype = torch.float32 if setup.regime == "fp32" else torch.bfloat16
    started = time.perf_counter()
    mesh = dims.build_mesh("cpu")
    batch = next(build_dataloader(cfg, load_tokenizer(cfg.model), epochs=1, media=media_reader(cfg.model)))
    model = build_model(cfg, dtype, "cpu", setup.fsdp)
    encoder = None if batch.media is None else build_media_encoder(cfg.model, "cpu")  # text rows: no tower runs
    if encoder is not None:
        trainable_parts(encoder, cfg.train.vision, cfg.lora)
    loss_module = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=cfg.memory.loss_chunk,
                               media_encoder=encoder)
    loss_module = parallelize(loss_module, dims, cfg, mesh, param_dtype=dtype, device="cpu",
                              checkpoint_placement=placement)
    optimizer, trainable = _optimizer_with_state(loss_module, cfg)
    shard = shard_batch(positioned(loss_module, batch), mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method))
    valid = global_valid_tokens(shard.labels, mesh.world_group)
    autocast = autocast_dtype(dims, dtype) is not None
    tracker = LiveBytes()
    offloaders = offloaders_of(loss_module)
    for offloader in offloaders:
        count_as_host(offloader, tracker)
    media = shard.media
    batch = [shard.input_ids, shard.labels, shard.position_ids] + ([] if media is None else [
        media.pixel_values, media.grid_thw, media.token_types, media.embedding_index, media.positions])
    with _counted_step(tracker, loss_module, optimizer, trainable, batch, cfg):
        with tracker.region("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = batch_loss_sum(loss_module, shard)
        with tracker.region("backward"):
            (loss / valid).backward()
        del loss
    result = TraceResult(tracker.peak, dict(tracker.peak_by_tag), tracker.peak_phase, time.perf_counter() - started,
                         world, shard.input_ids.shape[1], host_peak_bytes=tracker.host_peak)
    for offloader in offloaders:
        offloader.store.close()
    return result


class _GroupedMatmulInItsDtype(UncompiledDispatchMode):
    """aten._grouped_mm on fake tensors in any floating dtype, its output in its operands' dtype.

    The real kernels take fp32 operands (CPU's composite kernel; CUDA's falls back to per-group matmuls
    for anything but bf16), and nothing casts them: grouped_mm has no autocast rule, and transformers' grouped-mm
    experts cast the input to the weight's dtype, fp32 in the fp32 and autocast regimes. The meta kernel mirrors
    only CUDA's bf16 fast path and refuses them ("Expected inputs of BF16 type"): here the shape comes from the
    meta kernel on bf16 stand-ins and the output is a fresh tensor of that shape in the real kernel's dtype.
    Pushed between the FakeTensorMode and the byte tracker, so the tracker counts that output only."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _grouped_mm_in_its_dtype(func, args, kwargs)
        return func(*args, **kwargs) if out is None else out


def _grouped_mm_in_its_dtype(func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`_GroupedMatmulInItsDtype`'s output of `func`, None where `func` is not an aten._grouped_mm the meta kernel
    refuses. Run below the mode that calls it (the tensors' own fake mode or the meta device)."""
    if func is not torch.ops.aten._grouped_mm.default:
        return None
    a, b = args[0], args[1]
    out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None)
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16):
        return None
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    shape = func(a.to(torch.bfloat16), b.to(torch.bfloat16), offs).shape
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


@contextlib.contextmanager
def separate_sharding_propagation():
    """Make DTensor's shape propagation use a fake mode of its own (as torch < 2.10 always did).

    Newer DTensor reuses the active fake mode to run each operator once on GLOBAL shapes; in that mode
    those tensors would look like allocations of this rank. In a mode of their own, `LiveBytes` skips them.
    """
    from torch.distributed.tensor import _sharding_prop

    if not hasattr(_sharding_prop, "detect_fake_mode"):
        yield
        return
    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def real_meshes():
    """Build DeviceMeshes from real tensors even inside the fake mode.

    FSDP2 over tensor-parallel parameters joins the dp_shard x cp and tp meshes into one when it shards them
    (inside `parallelize`, in the fake mode); finding this rank's coordinates in that mesh (`nonzero`) has no
    fake implementation. The rank layout is known on the host anyway: nothing about it is fake.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def _scalars_read_as_one():
    """`.item()` of a fake scalar returns 1 (fake tensors hold no values; none of these sizes depend on them).

    The step reads a few scalars into Python -- the loss scale in the chunked loss's backward, the step
    count of the bf16-state AdamW -- only to multiply by them.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.Tensor.item

    def item(tensor):
        if isinstance(tensor, FakeTensor) and tensor.constant is None:
            return False if tensor.dtype == torch.bool else (1 if not tensor.dtype.is_floating_point else 1.0)
        return original(tensor)

    torch.Tensor.item = item
    try:
        yield
    finally:
        torch.Tensor.item = original


def _batch(cfg: Config, setup, local_tokens: int, vocab: int, mode) -> dict:
    """Rank 0's shard: B rows of L/cp tokens, one document per row (cu_seqlens None): the single fused
    attention call that flash-attn's varlen kernel makes on GPUs, and no data-dependent document plan. A model
    with linear-attention layers runs the plan's most padded row instead (plan/padding.py: its scans' padding
    depends on the documents), every row of the batch that row's documents, made on the host and handed to the
    fake `mode` (None: real tensors)."""
    from longfit.data.packing import PackedBatch
    from longfit.parallel.batch import cp_layout, shard_batch
    from longfit.plan.padding import row_padding

    B = cfg.train.micro_batch
    documents = row_padding(cfg, setup.shape.scan_chunk, setup.dims.dp_size).documents
    if len(documents) == 1:
        return {
            "input_ids": torch.randint(0, vocab, (B, local_tokens)),
            "labels": torch.randint(0, vocab, (B, local_tokens)),
            "position_ids": torch.arange(local_tokens).repeat(B, 1),
            "cu_seqlens": None,
            "documents": None,
        }
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        rows = PackedBatch.of_documents(torch.randint(0, vocab, (B, cfg.seq_len)), [list(documents)] * B)
        shard = shard_batch(rows, 0, setup.dims.cp, cp_layout(cfg.parallel.cp_method))
    fake = mode.from_tensor if mode is not None else (lambda t: t)
    return {"input_ids": fake(shard.input_ids), "labels": fake(shard.labels), "position_ids": fake(shard.position_ids),
            "cu_seqlens": fake(shard.cu_seqlens), "documents": shard.documents}


@contextlib.contextmanager
def _counted_step(tracker: LiveBytes, loss_module, optimizer, trainable, batch, cfg: Config):
    """`tracker` counting one training step whose forwards and backwards the body runs: the weights, optimizer state,
    `batch` tensors and any gradients already allocated (DDP's buckets, replicated) adopted and the peak reset before
    it; each gradient counted as one once accumulated, then the trainer's gradient clipping (clip_and_measure, minus
    reading the norm's value) and optimizer step."""
    with tracker:
        tracker.adopt(loss_module.parameters(), "weights")
        tracker.adopt(loss_module.buffers(), "weights")
        tracker.adopt((t for state in optimizer.state.values() for t in state.values()), "optimizer state")
        tracker.adopt((t for t in batch if t is not None), "batch")
        tracker.adopt((p.grad for p in trainable if p.grad is not None), "gradients")
        hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.retag([p.grad], "gradients")) for p in trainable]
        tracker.reset_peak()
        yield
        tracker.retag((p.grad for p in trainable if p.grad is not None), "gradients")
        with tracker.region("optimizer step"):
            if cfg.train.max_grad_norm > 0:
                # one foreach norm per mesh, as clip_and_measure takes them (under tp a trained tower's gradients
                # are on the dp_shard x cp mesh, the language model's on ("dp_shard_cp", "tp")): the same bytes
                by_mesh: dict[object, list[torch.Tensor]] = {}
                for param in trainable:
                    by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
                for group in by_mesh.values():
                    torch.nn.utils.clip_grad_norm_(group, cfg.train.max_grad_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for hook in hooks:
            hook.remove()


def _traced_step(tracker: LiveBytes, loss_module, optimizer, trainable, batch, cfg: Config, autocast: bool) -> None:
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    with _counted_step(tracker, loss_module, optimizer, trainable, tensors, cfg):
        for _ in range(cfg.train.grad_accum):
            with tracker.region("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_module(batch["input_ids"], batch["labels"], batch["position_ids"], batch["cu_seqlens"],
                                   batch["documents"])
            with tracker.region("backward"):
                (loss / batch["labels"].numel()).backward()
            del loss
