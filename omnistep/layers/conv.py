"""``conv1d``: ``F.conv1d`` whose CPU inference runs on a oneDNN pre-packed weight.

Imports torch only. On CPU, ``F.conv1d`` hands every call to oneDNN with the weight in its
stored ``[C_out, C_in, kernel]`` layout, and oneDNN reorders it into the blocked layout its
kernels read on every call (and, for a batch of 1 with few input elements, PyTorch takes its
slower native kernel instead). PyTorch's Inductor, when it freezes a CPU graph, reorders the
weight once (``torch._C._nn.mkldnn_reorder_conv2d_weight``) and calls
``torch.ops.mkldnn._convolution_pointwise``; ``conv1d`` does the same for eager code, keeping the
packed weight as a ``derived_copy`` of the weight tensor (made again when it changes in place).

Measured on this project's 2-core AVX-512 box (float32, 2 threads; ms per call, plain conv ->
packed): the Qwen3-TTS codec's 1024 -> 1536 kernel-7 conv over 8 x 4 steps 23 -> 8.8 (1 x 4:
6.5 -> 1.6: the 44 MB weight is reordered, and page-faulted in, on every plain call); its
96-channel 1x1 conv over 8 x 3840 steps 17 -> 3.8; kernel-7 convs at 96 / 768 channels 10 -> 6.3
/ 11 -> 8; compute-bound ones (384 channels over 8 x 160 steps) about equal. Results equal
``F.conv1d`` within float32 rounding (the sums run in another order; 1e-6 relative here).

The weight is packed for the input shape of the call that packs it; other shapes still run on
it. Every other case (CUDA, other dtypes, autograd, oneDNN missing) is ``F.conv1d``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistep.layers.linear import derived_copy, packs_on_cpu

_AVAILABLE = hasattr(torch._C._nn, "mkldnn_reorder_conv2d_weight") and hasattr(
    getattr(torch.ops, "mkldnn", None), "_convolution_pointwise"
)
_FAILED: list[bool] = []  # set once packing raised here: every later call is plain


def conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, stride, padding, dilation, groups)`` (zero padding),
    pre-packed on CPU float32 without autograd (module docstring).

    Args:
        x: ``[B, C_in, T]``.
        weight: ``[C_out, C_in / groups, kernel]``, a long-lived tensor (a module's weight:
            its packed copy is kept while it lives).
        bias: ``[C_out]`` or None.

    Returns:
        ``[B, C_out, (T + 2 padding - dilation (kernel - 1) - 1) // stride + 1]``.
    """
    plain = (
        not _AVAILABLE
        or _FAILED
        or x.dim() != 3
        or not packs_on_cpu(x, weight)
        or (bias is not None and bias.dtype != torch.float32)
        or (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (x, weight, bias))
        )
    )
    if plain:
        return F.conv1d(x, weight, bias, stride, padding, dilation, groups)
    x = x.contiguous()
    hint = [x.shape[0], x.shape[1], 1, x.shape[2]]

    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_reorder_conv2d_weight(
            w.unsqueeze(2).contiguous().to_mkldnn(),
            [0, padding],
            [1, stride],
            [1, dilation],
            groups,
            hint,
        )

    try:
        packed = derived_copy(weight, ("conv1d", stride, padding, dilation, groups), pack)
    except RuntimeError:  # a CPU or build without these kernels
        _FAILED.append(True)
        return F.conv1d(x, weight, bias, stride, padding, dilation, groups)
    y = torch.ops.mkldnn._convolution_pointwise(
        x.unsqueeze(2),
        packed,
        None if bias is None else bias.detach(),
        [0, padding],
        [1, stride],
        [1, dilation],
        groups,
        "none",
        [],
        "",
    )
    return y.squeeze(2)
