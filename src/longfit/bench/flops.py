"""The GPUs' peak rates a step's FLOPs are divided by (the FLOPs themselves: longfit.plan.flops).

MFU = model FLOPs / step time / peak, hardware MFU the same with hardware FLOPs. Peaks are dense bf16
tensor-core rates from the vendors' data sheets, by device name; an unknown device gets no MFU.
"""

from __future__ import annotations

# Dense bf16 TFLOP/s by a substring of torch.cuda.get_device_name; the first match wins (PCIe before SXM).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.4),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name, None when it is not in PEAK_BF16_TFLOPS."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in device_name), None)
