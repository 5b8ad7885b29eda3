"""``layers.conv.conv1d_nwc``: ``F.conv1d`` over time-major activations on a oneDNN pre-packed
weight (CPU float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistep.layers import linear as linear_module
from omnistep.layers.conv import IM2COL_MAX_STEPS, conv1d_nwc


def _want(x, weight, bias, dilation, groups):
    return F.conv1d(x.transpose(1, 2), weight, bias, 1, 0, dilation, groups).transpose(1, 2)


@pytest.mark.parametrize(
    "c_in, c_out, kernel, dilation, groups, batch, steps, tag",
    [
        (32, 48, 7, 1, 1, 4, 40, "conv-im2col"),  # 4 x 40 <= IM2COL_MAX_STEPS output steps
        (32, 48, 7, 2, 1, 4, 300, ("conv1d", 2, 1)),  # more: the channels-last conv
        (24, 24, 5, 1, 24, 2, 50, ("conv1d", 1, 24)),  # depthwise: always the conv
        (8, 16, 1, 1, 1, 3, 200, "conv1x1"),  # kernel 1: a GEMM over the rows
    ],
)
def test_packed_paths_equal_f_conv1d(c_in, c_out, kernel, dilation, groups, batch, steps, tag):
    """Each path within float32 rounding of ``F.conv1d`` for other batch sizes on the same
    packed copy; the copy kept while the weight is unchanged, made again after an in-place
    change, dropped with the weight; autograd and inference tensors take ``F.conv1d``."""
    torch.manual_seed(0)
    weight = torch.randn(c_out, c_in // groups, kernel) * 0.1
    bias = torch.randn(c_out)
    slot = (id(weight), tag)
    t_in = steps + dilation * (kernel - 1)
    with torch.no_grad():
        x = torch.randn(batch, t_in, c_in)
        got = conv1d_nwc(x, weight, bias, dilation, groups)
        assert got.shape == (batch, steps, c_out) and got.is_contiguous()
        torch.testing.assert_close(
            got, _want(x, weight, bias, dilation, groups), rtol=1e-5, atol=1e-5
        )
        packed = linear_module._COPIES[slot][2]
        x1 = torch.randn(1, t_in, c_in)
        got = conv1d_nwc(x1, weight, None, dilation, groups)
        torch.testing.assert_close(
            got, _want(x1, weight, None, dilation, groups), rtol=1e-5, atol=1e-5
        )
        assert linear_module._COPIES[slot][2] is packed
        weight.mul_(-2.0)
        got = conv1d_nwc(x, weight, bias, dilation, groups)
        torch.testing.assert_close(
            got, _want(x, weight, bias, dilation, groups), rtol=1e-5, atol=1e-5
        )
        assert linear_module._COPIES[slot][2] is not packed
    w = weight.clone().requires_grad_()
    conv1d_nwc(x, w, bias, dilation, groups).sum().backward()
    assert w.grad is not None and (id(w), tag) not in linear_module._COPIES
    with torch.inference_mode():
        frozen = weight.clone()  # an inference tensor: no version counter to follow
        conv1d_nwc(x, frozen, bias, dilation, groups)
        assert (id(frozen), tag) not in linear_module._COPIES
    del weight
    assert slot not in linear_module._COPIES


def test_im2col_threshold_counts_output_steps_of_the_call():
    """The GEMM over unfolded taps serves calls of at most ``IM2COL_MAX_STEPS`` output steps
    (batch x steps), the channels-last conv larger ones; both equal ``F.conv1d``."""
    torch.manual_seed(1)
    weight = torch.randn(16, 16, 3)
    for batch, steps, tag in (
        (2, IM2COL_MAX_STEPS // 2, "conv-im2col"),
        (2, IM2COL_MAX_STEPS // 2 + 1, ("conv1d", 1, 1)),
    ):
        w = weight.clone()
        x = torch.randn(batch, steps + 2, 16)
        with torch.no_grad():
            torch.testing.assert_close(
                conv1d_nwc(x, w), _want(x, w, None, 1, 1), rtol=1e-5, atol=1e-5
            )
        assert set(k[1] for k in linear_module._COPIES if k[0] == id(w)) == {tag}
