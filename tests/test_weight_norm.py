"""``omnistep.layers.weight_norm``: the one weight-norm fold every family uses equals torch's
own (``torch.nn.utils.parametrizations.weight_norm``) bit for bit, in value and gradient, and
refuses a ``v`` whose output channel has norm 0 (it would fold to NaN), naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from omnistep.layers.weight_norm import (
    PARAMETRIZED_G,
    PARAMETRIZED_V,
    WeightNormError,
    checkpoint_dim,
    fold_parametrized,
    fold_weight_norm,
    weight_norm_problem,
)


def _modules() -> list[tuple[nn.Module, int]]:
    torch.manual_seed(0)
    return [
        (nn.Linear(33, 300, bias=False), 0),
        (nn.Linear(20, 7), 1),
        (nn.Conv1d(32, 64, 3), 0),
        (nn.Conv1d(16, 512, 7), 0),
        (nn.ConvTranspose1d(64, 32, 16, 8), 0),
        (nn.Conv2d(3, 5, (2, 3)), 3),
    ]


@pytest.mark.parametrize("index", range(6))
def test_fold_is_torchs_weight_norm_bit_for_bit(index):
    module, dim = _modules()[index]
    normed = weight_norm(module, dim=dim)
    with torch.no_grad():  # g away from ||v||, so a wrong formula shows
        normed.parametrizations.weight.original0.mul_(
            torch.rand_like(normed.parametrizations.weight.original0) + 0.5
        )
    g = normed.parametrizations.weight.original0
    v = normed.parametrizations.weight.original1
    got = fold_weight_norm(g, v, dim)
    assert got.shape == v.shape and torch.equal(got, normed.weight)
    # the gradients reach g and v as torch's do
    got.square().sum().backward()
    mine = (g.grad.clone(), v.grad.clone())
    g.grad, v.grad = None, None
    normed.weight.square().sum().backward()
    assert torch.equal(mine[0], g.grad) and torch.equal(mine[1], v.grad)


def test_g_may_come_flat_and_a_misfit_g_is_refused():
    v = torch.randn(6, 4, 3)
    g = torch.rand(6) + 0.5
    assert torch.equal(fold_weight_norm(g, v), fold_weight_norm(g.view(6, 1, 1), v))
    with pytest.raises(WeightNormError, match=r"'w\.v' \[6, 4, 3\] takes 6 magnitudes"):
        fold_weight_norm(torch.ones(4, 1, 1), v, name="w.v")
    for dim in (3, -1):  # torch's -1 (the whole tensor's norm) is no output dim
        with pytest.raises(WeightNormError, match=f"has no dim {dim}"):
            fold_weight_norm(g, v, dim=dim, name="w.v")


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_a_zero_or_nonfinite_channel_is_refused_by_name(bad):
    v = torch.randn(8, 4, 3)
    v[2] = 0.0
    v[5, 1, 1] = bad
    g = torch.ones(8, 1, 1)
    assert torch.isnan(torch._weight_norm(v, g, 0)[2]).all()  # what torch makes of it
    channels = "2" if bad == 0.0 else "2, 5"
    with pytest.raises(WeightNormError, match=rf"'dec\.0\.weight_v' .* \(dim 0: {channels}\)"):
        fold_weight_norm(g, v, 0, "dec.0.weight_v")
    try:
        fold_weight_norm(g, v, 0, "dec.0.weight_v")
    except WeightNormError as exc:
        assert exc.name == "dec.0.weight_v" and isinstance(exc, ValueError)
    # along another dim the zero slice is v[:, :, k]
    w = torch.randn(8, 4, 3)
    w[:, :, 1] = 0
    assert "(dim 2: 1)" in weight_norm_problem(w, 2, "w")
    assert weight_norm_problem(w, 0, "w") is None


def test_problem_takes_numpy_and_skips_tensors_without_values():
    v = np.ones((3, 2), dtype=np.float32)
    assert weight_norm_problem(v) is None
    v[1] = 0
    assert "1 of 3 output channel(s)" in weight_norm_problem(v, name="x")
    assert weight_norm_problem(torch.empty(3, 2, device="meta")) is None


def test_fold_parametrized_replaces_each_pair_by_its_weight():
    torch.manual_seed(1)
    net = nn.Sequential(weight_norm(nn.Conv1d(2, 4, 3)), nn.Conv1d(4, 4, 1))
    state = dict(net.state_dict())
    folded = fold_parametrized(state)
    assert sorted(folded) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(folded["0.weight"], net[0].weight)
    assert folded["1.weight"] is state["1.weight"]
    del state["0" + PARAMETRIZED_V]
    with pytest.raises(KeyError, match="0" + PARAMETRIZED_V):
        fold_parametrized(state)
    state["0" + PARAMETRIZED_V] = torch.zeros(4, 2, 3)
    with pytest.raises(WeightNormError, match=r"'0\.parametrizations\.weight\.original1'"):
        fold_parametrized(state)
    assert PARAMETRIZED_G == ".parametrizations.weight.original0"


def test_the_dim_is_read_from_g_as_the_checkpoint_stores_it():
    # HuBERT's positional conv: weight_norm(conv, dim=2), g [1, 1, K]
    torch.manual_seed(3)
    conv = weight_norm(nn.Conv1d(8, 8, 4, groups=2), dim=2)
    state = {f"pos.{k}": t for k, t in conv.state_dict().items()}
    assert state["pos" + PARAMETRIZED_G].shape == (1, 1, 4)
    assert checkpoint_dim(state["pos" + PARAMETRIZED_G], state["pos" + PARAMETRIZED_V]) == 2
    assert torch.equal(fold_parametrized(state)["pos.weight"], conv.weight)
    assert checkpoint_dim(torch.ones(6, 1), torch.ones(6, 1)) == 0  # both fit: the output dim
    with pytest.raises(WeightNormError, match=r"'x' \[4, 4, 4\]: its g \[4\] keeps no dim"):
        checkpoint_dim(torch.ones(4), torch.ones(4, 4, 4), "x")


def test_chatterbox_hift_folds_as_torchs_parametrization_and_refuses_a_zero_v():
    from omnistep.models.chatterbox.hift import HiFT, HiFTConfig

    def build() -> HiFT:  # alike (a deep copy would share the parametrized classes)
        torch.manual_seed(2)
        return HiFT(HiFTConfig(base_channels=16, f0_channels=8))

    hift, torchs, broken = build(), build(), build()
    for module in torchs.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    hift.fold_weight_norm()
    assert not any(parametrize.is_parametrized(m) for m in hift.modules())
    mine, want = hift.state_dict(), torchs.state_dict()
    assert mine.keys() == want.keys()
    assert all(torch.equal(mine[k], want[k]) for k in mine)

    with torch.no_grad():
        broken.ups[1].parametrizations.weight.original1[3].zero_()
    with pytest.raises(WeightNormError, match=r"'mel2wav\.ups\.1\.parametrizations\.weight"):
        broken.fold_weight_norm()
    # refused before any module changed
    assert all(parametrize.is_parametrized(broken.ups[i], "weight") for i in range(3))
    assert parametrize.is_parametrized(broken.conv_pre, "weight")
