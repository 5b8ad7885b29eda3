"""``conv1d_nwc``: a 1-D convolution over time-major activations ``[B, T, C]`` whose CPU
inference runs on a oneDNN pre-packed weight.

Imports torch only. On CPU, ``F.conv1d`` hands every call to oneDNN with the weight in its
stored ``[C_out, C_in, kernel]`` layout and the activations in ``[B, C, T]``, and oneDNN
reorders the weight into its blocked layout on every call (and, for a batch of 1 with few input
elements, PyTorch takes its slower native kernel instead). PyTorch's Inductor, when it freezes
a CPU graph, reorders the weight once (``torch._C._nn.mkldnn_reorder_conv2d_weight``) and calls
``torch.ops.mkldnn._convolution_pointwise``, which runs channels-last: it copies a ``[B, C, T]``
input to channels-last and returns a channels-last output. A ``[B, T, C]`` tensor seen as
``[B, C, 1, T]`` already is channels-last, so a conv stack kept time-major pays neither the
weight reorder nor the activation copies, and its kernel-1 convs are plain GEMMs over the
``B T`` rows (``torch.ops.mkldnn._linear_pointwise`` on a packed ``[C_out, C_in]`` weight).
Packed weights are ``derived_copy`` s of the weight tensor (made again when it changes in
place).

Measured on this project's 2-core AVX-512 box (float32, 2 threads), the Qwen3-TTS codec's
three residual units (SnakeBeta, kernel-7 conv, SnakeBeta, 1x1 conv) at 96 channels over 8 x 1920
steps: 43.5 ms with ``[B, C, T]`` activations and a packed kernel-7 conv, 30.6 ms time-major
(192 channels over 8 x 640 steps: 46 -> 30; 1 x 1920: 7.6 -> 5.8); its 1024 -> 1536 kernel-7
conv over 1 x 4 steps 6.5 ms plain, 1.6 packed, 1.3 as a GEMM over its unfolded taps (calls of
few output steps: ``IM2COL_MAX_STEPS``). Results equal ``F.conv1d`` within float32 rounding
(the sums run in another order; 1e-6 relative).

The weight is packed for the input shape of the call that packs it; other shapes still run on
it. Every other case (CUDA, other dtypes, autograd, oneDNN missing) is ``F.conv1d`` on the
transposed input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistep.layers.linear import PACK_ROWS, derived_copy, packs_on_cpu

_AVAILABLE = hasattr(torch._C._nn, "mkldnn_reorder_conv2d_weight") and hasattr(
    getattr(torch.ops, "mkldnn", None), "_convolution_pointwise"
)
_FAILED: list[bool] = []  # set once packing raised here: every later call is plain
IM2COL_MAX_STEPS = 256
"""Output steps of a call (``B T``) up to which a conv runs as one GEMM over its unfolded
taps (``[B T, kernel C_in]`` by a packed ``[C_out, kernel C_in]``): oneDNN's direct conv
blocks poorly over so few steps (the 1024 -> 1536 kernel-7 conv over 8 x 4 steps: 6.6 ms
direct, 2.5 as a GEMM; 768 channels over 8 x 32: 5.5 -> 5.0; over 8 x 160 at 384 channels
the direct conv is the faster, 5.6 against 6.2)."""


def conv1d_nwc(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    dilation: int = 1,
    groups: int = 1,
) -> torch.Tensor:
    """``F.conv1d`` at stride 1 without padding, on time-major activations, pre-packed on
    CPU float32 without autograd (module docstring).

    Args:
        x: ``[B, T_in, C_in]`` (made contiguous).
        weight: ``[C_out, C_in / groups, kernel]`` (``nn.Conv1d``'s), a long-lived tensor: its
            packed copy is kept while it lives.
        bias: ``[C_out]`` or None.
        dilation, groups: as ``F.conv1d``'s.

    Returns:
        ``[B, T_in - dilation (kernel - 1), C_out]``, contiguous on the packed path.
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
        return F.conv1d(x.transpose(1, 2), weight, bias, 1, 0, dilation, groups).transpose(1, 2)
    x = x.contiguous()
    bias = None if bias is None else bias.detach()
    kernel = weight.shape[2]
    try:
        if kernel == 1 and groups == 1:
            packed = derived_copy(
                weight,
                "conv1x1",
                lambda w: torch.ops.mkldnn._reorder_linear_weight(
                    w[:, :, 0].contiguous(), PACK_ROWS
                ),
            )
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        steps = x.shape[1] - dilation * (kernel - 1)
        if groups == 1 and x.shape[0] * steps <= IM2COL_MAX_STEPS:
            packed = derived_copy(
                weight,
                "conv-im2col",
                lambda w: torch.ops.mkldnn._reorder_linear_weight(
                    w.permute(0, 2, 1).reshape(w.shape[0], -1).contiguous(), PACK_ROWS
                ),
            )
            cols = x.unfold(1, dilation * (kernel - 1) + 1, 1)[..., ::dilation]  # [B, T, C, k]
            cols = cols.transpose(2, 3).reshape(x.shape[0], steps, -1)  # tap-major rows
            return torch.ops.mkldnn._linear_pointwise(cols, packed, bias, "none", [], "")
        hint = [x.shape[0], x.shape[2], 1, x.shape[1]]
        packed = derived_copy(
            weight,
            ("conv1d", dilation, groups),
            lambda w: torch._C._nn.mkldnn_reorder_conv2d_weight(
                w.unsqueeze(2).contiguous().to_mkldnn(), [0, 0], [1, 1], [1, dilation], groups, hint
            ),
        )
    except RuntimeError:  # a CPU or build without these kernels
        _FAILED.append(True)
        return F.conv1d(x.transpose(1, 2), weight, bias, 1, 0, dilation, groups).transpose(1, 2)
    # [B, T, C] seen as [B, C, 1, T] is channels-last: oneDNN reads it as it is
    y = torch.ops.mkldnn._convolution_pointwise(
        x.transpose(1, 2).unsqueeze(2),
        packed,
        bias,
        [0, 0],
        [1, 1],
        [1, dilation],
        groups,
        "none",
        [],
        "",
    )
    return y.squeeze(2).transpose(1, 2)
