"""Live tensor bytes of a region of code, on fake tensors or real ones, without a GPU.

`LiveBytes` is a TorchDispatchMode: every tensor an operator returns is looked up by its storage; a
storage seen for the first time is counted (its nbytes) and gets a weakref whose callback subtracts it
when the storage dies, so the count is exactly the bytes of live tensor storages -- what the CUDA
caching allocator's `memory_allocated` reports, minus its 512-byte rounding. Views share storages and
are never counted twice. FSDP2 frees and re-allocates unsharded parameters with
`UntypedStorage.resize_`, which no dispatch mode sees, so `resize_` is wrapped while the mode is active.

Storages are tagged with the phase that allocated them ("forward", "backward", ...) so that the peak
can be broken down; `adopt` counts tensors that existed before the mode started (weights, optimizer
state) under a tag of their own. DTensor's sharding propagation runs operators on meta tensors (or fake
tensors of another fake mode) to learn output shapes; those are not memory and are skipped: only
non-meta tensors of the fake mode the step runs in (`fake_mode`, None for real tensors) are counted, or, `on_meta`,
the meta tensors of a step run on the meta device without DTensor (plan/layer_trace.py's traces). Storages allocated inside `region(HOST)` are host memory (the
activation offloader's copies): counted in `host_live` / `host_peak`, never in the device peak.
`ActivationBytes` (the one-layer traces of plan/layer_trace.py) also follows the bytes of activations alone.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


@dataclass
class _Storage:
    nbytes: int
    tag: str
    ref: weakref.ref = field(repr=False)


HOST = "host"
WEIGHT_LIKE = "weight-like"  # ActivationBytes' tag of parameters and tensors shaped like one
RELOADED = "reloaded"  # ActivationBytes' tag of a layer input brought back for its recompute (plan/layer_trace.py)


class UncompiledDispatchMode(TorchDispatchMode):
    """A dispatch mode whose `__torch_dispatch__` runs as written. Recent torch (2.13 here) wraps a mode's
    `__torch_dispatch__` in `torch._dynamo.disable` unless `_should_skip_dynamo` says no, a wrapper for each class
    that defines it, which sets and restores dynamo's frame callback on each call: 3 us an operator, three deep in
    LiveBytes' subclasses, about 0.45 s of a cold plan's layer traces (Qwen3-Coder-Next at 128K, #52). Nothing that
    runs under these modes is compiled."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class LiveBytes(UncompiledDispatchMode):
    """Counts live tensor storage bytes; `peak` and `peak_by_tag` hold the high-water mark."""

    def __init__(self, fake_mode=None, on_meta: bool = False, meta_results: MetaResults | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.on_meta = on_meta
        self.meta_results = meta_results
        """On meta tensors, a memo of operators' outputs by the metadata of their inputs (`MetaResults`), or None."""
        self.phase = "other"
        self.live = 0
        self.peak = 0
        self.host_live = 0
        self.host_peak = 0
        self.peak_phase = ""
        self.by_tag: dict[str, int] = defaultdict(int)
        self.peak_by_tag: dict[str, int] = {}
        self._storages: dict[int, _Storage] = {}
        self._original_resize = None

    # -- counting -------------------------------------------------------------------------------------
    def _storage_of(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor  # not to_local(): that would dispatch, and count, a view
        try:
            return tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse or otherwise storage-less tensors
            return None

    def _count(self, tensor: torch.Tensor, tag: str) -> None:
        storage = self._storage_of(tensor)
        if storage is not None and self._entry(storage) is None:
            self._register(storage, storage.nbytes(), tag)

    def _entry(self, storage: torch.UntypedStorage) -> _Storage | None:
        entry = self._storages.get(id(storage))
        return entry if entry is not None and entry.ref() is storage else None

    def _register(self, storage: torch.UntypedStorage, nbytes: int, tag: str) -> _Storage:
        key = id(storage)

        def release(ref: weakref.ref) -> None:
            entry = self._storages.get(key)
            if entry is not None and entry.ref is ref:
                del self._storages[key]
                self._add(-entry.nbytes, entry.tag)

        entry = self._storages[key] = _Storage(nbytes, tag, weakref.ref(storage, release))
        self._add(nbytes, tag)
        return entry

    def _add(self, nbytes: int, tag: str) -> None:
        if tag == HOST:
            self.host_live += nbytes
            self.host_peak = max(self.host_peak, self.host_live)
            return
        self.live += nbytes
        self.by_tag[tag] += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_phase = self.phase
            self.peak_by_tag = {k: v for k, v in self.by_tag.items() if v}

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._entry(storage) or self._register(storage, 0, self.phase)
        delta = storage.nbytes() - entry.nbytes
        entry.nbytes += delta
        self._add(delta, entry.tag)

    # -- public ---------------------------------------------------------------------------------------
    def adopt(self, tensors: Iterable[torch.Tensor], tag: str) -> None:
        """Count tensors that exist already (parameters, gradients, optimizer state) under `tag`."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor, tag)

    def retag(self, tensors: Iterable[torch.Tensor], tag: str) -> None:
        """Move already counted tensors (e.g. gradients made in backward) to `tag`."""
        for tensor in tensors:
            storage = self._storage_of(tensor) if isinstance(tensor, torch.Tensor) else None
            entry = self._entry(storage) if storage is not None else None
            if entry is None:
                continue
            self._add(-entry.nbytes, entry.tag)
            entry.tag = tag
            self._add(entry.nbytes, tag)

    @contextlib.contextmanager
    def region(self, phase: str) -> Iterator[None]:
        """Tag what is allocated inside with `phase`."""
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def reset_peak(self) -> None:
        self.peak = self.live
        self.peak_phase = self.phase
        self.peak_by_tag = {k: v for k, v in self.by_tag.items() if v}

    def __enter__(self):
        self._original_resize = original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which this mode then sees
        kwargs = kwargs or {}
        out = self.meta_results.run(func, args, kwargs) if self.meta_results is not None else func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # most operators: one tensor, or a tuple of them, without the pytree walk
            self._count_output(out)
        elif isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
            for t in out:
                self._count_output(t)
        else:
            tree_map_only(torch.Tensor, self._count_output, out)
        return out

    def _count_output(self, tensor: torch.Tensor) -> None:
        if getattr(tensor, "fake_mode", None) is self.fake_mode and (tensor.device.type == "meta") == self.on_meta:
            self._count(tensor, self.phase)


class MetaResults:
    """Operators' outputs on meta tensors, remembered by the metadata of their inputs: a meta tensor's operator computes
    its outputs' shapes, strides and dtypes from its inputs' alone (there are no values to read), most of them in
    Python (torch._refs, torch._meta_registrations: 50-100 us an elementwise operator, against a few for an empty
    tensor), and a layer trace runs the same operators on the same shapes again and again: every tile, the
    recompute, every layer kind's norms and projections (#52). An operator is remembered where its outputs are
    fresh storages, as empty_strided makes them: it writes no input and returns no view (its schema), and the first
    run's outputs share no storage with its inputs or each other (`aten._unsafe_view` returns its input's storage
    without saying so), start at offset 0 and hold the bytes their strides span. Its outputs are then made as
    empty_strided of the same metadata: the same bytes to the tracker. One memo serves one set of modes below the
    tracker (plan/layer_trace.py's trace: what those modes change is part of the remembered outputs)."""

    def __init__(self) -> None:
        self._results: dict[tuple, tuple | None] = {}

    def run(self, func, args: tuple, kwargs: dict):
        key = _metadata_key(func, args, kwargs) if _functional(func) else None
        recipe = self._results.get(key, False) if key is not None else None
        if recipe:
            container, outputs = recipe
            made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in outputs]
            return made[0] if container is None else container(made)
        out = func(*args, **kwargs)
        if recipe is False:
            self._results[key] = _recipe(args, kwargs, out)
        return out


@functools.cache
def _functional(func) -> bool:
    """Whether the operator's schema says it writes no input and returns no view of one."""
    schema = getattr(func, "_schema", None)
    return schema is not None and all(a.alias_info is None for a in (*schema.arguments, *schema.returns))


def _metadata_key(func, args: tuple, kwargs: dict) -> tuple | None:
    """(operator, its arguments with each tensor as its shape, strides, dtype and sign and conjugate bits) or None: an
    argument that is not a meta tensor, a number, a string, a torch constant (dtype, device, layout, memory format),
    None or a list or tuple of them, or no tensor. Walked by hand: the pytree's walk cost as much as a meta kernel."""
    tensors = 0

    def described(value):
        nonlocal tensors
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor or value.device.type != "meta":
                raise _NotRemembered
            tensors += 1
            return value.shape, value.stride(), value.dtype, value.is_neg(), value.is_conj()
        if isinstance(value, (list, tuple)):
            return type(value), tuple(described(v) for v in value)
        if value is None or isinstance(value, _CONSTANTS):
            return type(value), value
        raise _NotRemembered

    try:
        key = (func, described(args), tuple((name, described(value)) for name, value in kwargs.items()))
    except _NotRemembered:
        return None
    return key if tensors else None


class _NotRemembered(Exception):
    pass


_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _recipe(args: tuple, kwargs: dict, out) -> tuple | None:
    """(the outputs' container: None for one tensor, [(shape, strides, dtype)] of the outputs) where the outputs of
    an operator `_functional` calls functional can be made again by empty_strided (`MetaResults`), else None."""
    from torch.utils._pytree import tree_leaves

    outputs = [out] if isinstance(out, torch.Tensor) else list(out) if type(out) in (tuple, list) else None
    if not outputs or not all(type(t) is torch.Tensor and t.device.type == "meta" for t in outputs):
        return None
    inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    storages = [t.untyped_storage() for t in outputs]
    if len({s._cdata for s in storages} | inputs) != len(inputs) + len(outputs):
        return None
    for t, storage in zip(outputs, storages):
        if t.storage_offset() or t.is_neg() or t.is_conj() or storage.nbytes() != torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes():
            return None
    return None if isinstance(out, torch.Tensor) else type(out), [(tuple(t.shape), t.stride(), t.dtype) for t in outputs]


_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"})


class ActivationBytes(LiveBytes):
    """LiveBytes that also follows the activation bytes alone: every tensor not shaped like a parameter (or its
    transpose; `weight_shapes`), so that a layer's casts and gathers of its weights and its weight gradients are not
    read as activations. A parameter's shape is not enough where the tokens are one of the model's widths, which the
    plan's own tokens of a small model can be (#52: a tiny Mistral at tp=2, 2 rows of 96 tokens, whose (192, 64)
    activations had the shape of its embedding's vocabulary half: 11% of its step missing from the plan). So a
    tensor shaped like a parameter is an activation where the operator that made it read an activation and it is no
    weight gradient: it also read a weight (x @ W, the gradient's g @ W, a norm's x * w), or it neither multiplies
    matrices nor reduces (the weight gradients: x^T g, a norm's sum of g * x over the tokens).
    `resident_peak` is their peak without what is allocated in `region(RELOADED)`: the copy of a layer input
    brought back for its recompute, which a layer whose input stays on the device reads in place."""

    def __init__(self, fake_mode, weight_shapes: set[tuple[int, ...]], on_meta: bool = False,
                 meta_results: MetaResults | None = None):
        super().__init__(fake_mode, on_meta, meta_results)
        self.weight_shapes = weight_shapes
        self.activations = 0
        self.activation_peak = 0
        self.resident_peak = 0
        self._call: tuple | None = None  # the operator running and its arguments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._call = func, args, kwargs
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._call = None

    def _count_output(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) in self.weight_shapes and self._weight_like(tensor):
            with self.region(WEIGHT_LIKE):
                super()._count_output(tensor)
        else:
            super()._count_output(tensor)

    def _weight_like(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`, shaped like a parameter, was made from weights alone or is a weight gradient (class
        docstring). An operator not seen here (a subclass's own) is judged by the shape alone."""
        if self._call is None:
            return True
        from torch.utils._pytree import tree_leaves

        func, args, kwargs = self._call
        inputs = [entry for entry in (self._entry(storage) for storage in (
            self._storage_of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            if storage is not None) if entry is not None and entry.tag != HOST]
        read = [entry.tag == WEIGHT_LIKE for entry in inputs]
        if all(read):
            return True
        if any(read):
            return False
        largest = max(entry.nbytes for entry in inputs)
        return func.overloadpacket.__name__ in _MATMULS or tensor.numel() * tensor.element_size() < largest

    def _add(self, nbytes: int, tag: str) -> None:
        super()._add(nbytes, tag)
        if tag not in (WEIGHT_LIKE, HOST):
            self.activations += nbytes
            self.activation_peak = max(self.activation_peak, self.activations)
            self.resident_peak = max(self.resident_peak, self.activations - self.by_tag[RELOADED])


def count_as_host(offloader, tracker: LiveBytes) -> None:
    """The offload store's host memory (its arena, and any unplanned buffer) is allocated in the tracker's host region."""
    store = offloader.store
    for name in ("_plan", "_unplanned_buffer"):
        allocate = getattr(store, name)

        def in_host_region(*args, allocate=allocate, **kwargs):
            with tracker.region(HOST):
                return allocate(*args, **kwargs)

        setattr(store, name, in_host_region)
