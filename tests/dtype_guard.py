"""A dispatch-level guard: every attention kernel call gets q, k, v (and out, dout in backward) of one dtype.

    from dtype_guard import AttentionDtypeGuard
    with AttentionDtypeGuard() as guard:
        loss = loss_module(...); loss.backward()
    assert guard.dtypes() == {torch.bfloat16}

It sits below autograd and autocast (a TorchDispatchMode), so it sees the aten kernels exactly as they are
called -- by SDPA after autocast's casts, and by longfit's block, ring, Ulysses and tiled-layer paths, which
call the kernels directly -- in forward, in recomputation and in backward. The operands that must agree are
the 4-D floating tensors of the call: q, k, v, out and dout are (B, h, L, D) (or (B, L, h, D)); the
log-sum-exp is 3-D and fp32 by design. A mixed call fails at once, naming the operator and the dtypes: the
CUDA memory-efficient kernel would read v's buffer in q's type, and the CPU kernel raises "expected scalar
type Float but found BFloat16" (issue 24).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ATTENTION_KERNEL_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def is_attention_kernel(op_name: str) -> bool:
    """Whether an aten operator name (`func.name()`) is an attention kernel, forward or backward."""
    return any(word in op_name for word in ATTENTION_KERNEL_WORDS)


class MixedDtypeAttention(AssertionError):
    pass


class AttentionDtypeGuard(TorchDispatchMode):
    """Fails any attention kernel call whose q, k, v (out, dout) differ in dtype; counts the calls by (op, dtype)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[tuple[str, torch.dtype]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if is_attention_kernel(name):
            operands = [
                t for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 4
            ]
            dtypes = {t.dtype for t in operands}
            if len(dtypes) != 1:
                raise MixedDtypeAttention(
                    f"{name} called with operands of mixed dtypes: {[str(t.dtype) for t in operands]}"
                )
            self.calls[(name, dtypes.pop())] += 1
        return func(*args, **kwargs)

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes the attention kernels ran in."""
        return {dtype for _, dtype in self.calls}
