"""``layers.conv.conv1d``: ``F.conv1d`` on a oneDNN pre-packed weight (CPU float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistep.layers import linear as linear_module
from omnistep.layers.conv import conv1d


@pytest.mark.parametrize(
    "c_in, c_out, kernel, stride, padding, dilation, groups",
    [
        (32, 48, 7, 1, 0, 1, 1),
        (32, 48, 7, 2, 3, 1, 1),
        (24, 24, 5, 1, 4, 2, 24),
        (8, 16, 1, 1, 0, 1, 1),
    ],
)
def test_packed_conv1d_equals_f_conv1d(c_in, c_out, kernel, stride, padding, dilation, groups):
    """Within float32 rounding for every batch size on one packed copy (packed for the first
    call's shape), kept while the weight is unchanged, made again after an in-place change;
    autograd and inference tensors take ``F.conv1d``."""
    torch.manual_seed(0)
    weight = torch.randn(c_out, c_in // groups, kernel) * 0.1
    bias = torch.randn(c_out)
    args = (stride, padding, dilation, groups)
    slot = (id(weight), ("conv1d", *args))
    with torch.no_grad():
        for batch, steps in ((4, 40), (1, 9), (7, 64)):
            x = torch.randn(batch, c_in, steps)
            torch.testing.assert_close(
                conv1d(x, weight, bias, *args),
                F.conv1d(x, weight, bias, *args),
                rtol=1e-5,
                atol=1e-5,
            )
        packed = linear_module._COPIES[slot][2]
        conv1d(x, weight, None, *args)
        assert linear_module._COPIES[slot][2] is packed
        weight.mul_(-2.0)
        torch.testing.assert_close(
            conv1d(x, weight, None, *args), F.conv1d(x, weight, None, *args), rtol=1e-5, atol=1e-5
        )
        assert linear_module._COPIES[slot][2] is not packed
    w = weight.clone().requires_grad_()
    conv1d(x, w, bias, *args).sum().backward()
    assert w.grad is not None and (id(w), ("conv1d", *args)) not in linear_module._COPIES
    with torch.inference_mode():
        frozen = weight.clone()  # an inference tensor: no version counter to follow
        conv1d(x, frozen, bias, *args)
        assert (id(frozen), ("conv1d", *args)) not in linear_module._COPIES
    del weight
    assert slot not in linear_module._COPIES
