"""``PackedLinear``: oneDNN pre-packed CPU inference that stays an ``nn.Linear``."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.linear import PackedLinear, linears_batch_invariant


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def _layer(in_features=96, out_features=160, bias=True, seed=0) -> PackedLinear:
    torch.manual_seed(seed)
    return PackedLinear(in_features, out_features, bias=bias).eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (64, 96), (3, 5, 96)])
def test_packed_matches_f_linear(bias, shape):
    layer = _layer(bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = layer(x)
    ref = F.linear(x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    assert out.shape == (*shape[:-1], 160)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_repacks_when_weights_change_in_place():
    layer = _layer()
    x = torch.randn(4, 96)
    with torch.inference_mode():
        before = layer(x)
    other = _layer(seed=1)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        after = layer(x)
        ref = F.linear(x, other.weight, other.bias)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.bias.add_(1.0)  # an in-place change of the bias alone
        torch.testing.assert_close(layer(x), ref + 1.0, rtol=1e-5, atol=1e-5)


def test_autograd_calls_give_linear_gradients():
    layer = _layer()
    x = torch.randn(5, 96, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(5, -1))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (9, 96), (2, 3, 96)])
def test_autograd_forward_is_the_packed_kernel_and_backward_the_linear_gradient(bias, shape):
    """Train = serve: a forward that builds a graph gives serving's values to the bit; its
    gradients are F.linear's."""
    layer = _layer(bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        served = layer(x)
    x_grad = x.clone().requires_grad_(True)
    out = layer(x_grad)
    assert out.grad_fn is not None and torch.equal(out.detach(), served)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    ref_x = x.clone().requires_grad_(True)
    ref_w = layer.weight.detach().clone().requires_grad_(True)
    ref_b = None if layer.bias is None else layer.bias.detach().clone().requires_grad_(True)
    F.linear(ref_x, ref_w, ref_b).backward(upstream)
    torch.testing.assert_close(x_grad.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, ref_w.grad, rtol=1e-5, atol=1e-6)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref_b.grad, rtol=1e-5, atol=1e-6)
    # an optimizer step changes the weight in place: the next forward repacks
    with torch.no_grad():
        layer.weight.add_(0.5)
        stepped = layer(x)
    assert torch.equal(layer(x_grad).detach(), stepped)
    torch.testing.assert_close(stepped, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_state_dict_and_deepcopy_are_those_of_nn_linear():
    layer = _layer()
    with torch.inference_mode():
        layer(torch.randn(2, 96))  # packed once
    plain = nn.Linear(96, 160)
    assert layer.state_dict().keys() == plain.state_dict().keys()
    clone = copy.deepcopy(layer)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        assert torch.equal(clone(x), layer(x))


def test_batch_invariance_probe_is_truthful():
    """When the probe says invariant, rows agree bit for bit in calls it did not probe."""
    layer = _layer(in_features=256, out_features=512)
    invariant = layer.batch_invariant()
    print(f"\npacked linear batch-invariant on this CPU: {invariant}")
    if not invariant:
        assert not linears_batch_invariant(nn.Sequential(layer))
        return
    x = torch.randn(100, 256)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(100)])
        for rows in (3, 33, 64, 100):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert linears_batch_invariant(nn.Sequential(layer, nn.ReLU(), _layer(512, 8)))
    assert not linears_batch_invariant(nn.Sequential(layer, nn.Linear(512, 8)))
    assert not linears_batch_invariant(nn.ReLU())


def test_functional_linear_packs_a_plain_weight_like_packed_linear():
    """``linear(x, w, b)``: bit-identical to a ``PackedLinear`` holding ``w``, within float32
    rounding of ``F.linear``; one packed copy per weight, made again after an in-place change,
    dropped with the weight; autograd reaches the plain tensors with ``F.linear``'s gradient."""
    from omnistep.layers import linear as module

    layer = _layer()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(5, 96)
    with torch.inference_mode():
        got = module.linear(x, w, b)
        assert torch.equal(got, layer(x))
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    slot = (id(w), "linear")
    packed = module._COPIES[slot][2]
    module.linear(x, w, b)
    assert module._COPIES[slot][2] is packed  # kept while the weight is unchanged
    w.mul_(2.0)
    torch.testing.assert_close(module.linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert module._COPIES[slot][2] is not packed
    w.requires_grad_(True)
    module.linear(x, w, b).square().sum().backward()
    ref = w.detach().clone().requires_grad_(True)
    F.linear(x, ref, b).square().sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, atol=1e-4, rtol=1e-5)
    del w
    assert slot not in module._COPIES


def test_packed_copies_follow_data_assignment():
    """``w.data = new`` keeps the version counter, and a freed storage's addresses come back
    to the next one of its size: two assignments in a row once left ``linear()`` and
    ``PackedLinear`` on the first weight's packed copy (the probe's case, 19 of 20 tries).
    The pinned storage identity in ``tensor_version`` catches it."""
    from omnistep.layers.linear import linear

    torch.manual_seed(0)
    layer = _layer(64, 32)
    w = layer.weight.detach().clone()
    x = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(10):
            linear(x, w)
            layer(x)
            w.data = torch.randn(32, 64)
            w.data = torch.randn(32, 64)
            layer.weight.data = torch.randn(32, 64)
            layer.weight.data = torch.randn(32, 64)
            torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5
            )
