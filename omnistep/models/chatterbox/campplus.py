"""CAMPPlus, S3Gen's speaker encoder: 80-bin Kaldi fbank (16 kHz) -> a 192-d x-vector.

CAM++ (Wang et al., arXiv 2303.00332; 3D-Speaker's ``CAMPPlus`` as CosyVoice and Chatterbox's
``s3gen/xvector.py`` configure it), tensors under ``speaker_encoder.`` of ``s3gen.safetensors``:

- ``head`` (FCM): a 2-D convolution front over (frequency, time): conv 3x3 (32 channels), two
  stages of two residual blocks (the first of each strides 2 in frequency), a conv striding 2
  in frequency; flattened to ``32 * 80 / 8`` channels over time;
- ``xvector``: a TDNN layer (kernel 5, stride 2), three densely connected CAM blocks (12, 24, 16
  layers; kernel 3, dilation 1, 2, 2; growth 32, bottleneck 4 x 32), each followed by a
  transition halving the channels; every layer batch norm then ReLU before its convolution
  (``batchnorm-relu``). A CAM layer's output is gated by ``sigmoid(linear2(relu(linear1(mean
  over time + mean over its 100-frame segment))))``;
- statistics pooling (mean and unbiased std over time) and a 1x1 dense layer with a
  non-affine batch norm: the x-vector.

Batch norms run with their running statistics (inference). The input is the clip's fbank
minus its mean over time (``xvector.extract_feature``). Sizes (channels, growth, bottleneck,
layers per block, embedding) are read from the tensors.

Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FEAT_DIM = 80
BLOCK_KERNELS, BLOCK_DILATIONS = (3, 3, 3), (1, 2, 2)
SEGMENT = 100
"""Frames per CAM segment pooling window."""


@dataclass(frozen=True)
class CAMPPlusConfig:
    """Sizes (published: upstream ``CAMPPlus`` defaults).

    Attributes:
        head_channels: FCM channels (32).
        init_channels: the TDNN layer's width (128).
        growth: a CAM layer's output channels (32).
        bottleneck: a CAM layer's bottleneck width (4 x growth).
        block_layers: layers of the three CAM blocks (12, 24, 16).
        embedding: x-vector width (192).
    """

    head_channels: int = 32
    init_channels: int = 128
    growth: int = 32
    bottleneck: int = 128
    block_layers: tuple[int, int, int] = (12, 24, 16)
    embedding: int = 192

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str) -> CAMPPlusConfig:
        """Sizes read from the tensors under ``prefix``.

        Raises:
            KeyError: a tensor the sizes are read from is missing (named).
        """

        def get(name: str) -> torch.Tensor:
            if prefix + name not in state:
                raise KeyError(f"no tensor {prefix + name}")
            return state[prefix + name]

        layers = []
        for b in (1, 2, 3):
            head = f"{prefix}xvector.block{b}.tdnnd"
            layers.append(len({k[len(head) :].split(".")[0] for k in state if k.startswith(head)}))
        layer = "xvector.block1.tdnnd1."
        return cls(
            head_channels=get("head.conv1.weight").shape[0],
            init_channels=get("xvector.tdnn.linear.weight").shape[0],
            growth=get(layer + "cam_layer.linear_local.weight").shape[0],
            bottleneck=get(layer + "linear1.weight").shape[0],
            block_layers=(layers[0], layers[1], layers[2]),
            embedding=get("xvector.dense.linear.weight").shape[0],
        )


def _bn_relu(channels: int, affine: bool = True, relu: bool = True) -> nn.Sequential:
    """A ``batchnorm-relu`` nonlinearity (module names as upstream's ``get_nonlinear``)."""
    layers: dict[str, nn.Module] = {"batchnorm": nn.BatchNorm1d(channels, affine=affine)}
    if relu:
        layers["relu"] = nn.ReLU()
    seq = nn.Sequential()
    for name, module in layers.items():
        seq.add_module(name, module)
    return seq


class ResBlock2d(nn.Module):
    """FCM's residual block: two 3x3 convs with batch norm, the first striding in frequency."""

    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=(stride, 1), bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + self.shortcut(x))


class FCM(nn.Module):
    """The 2-D front (``speaker_encoder.head``): ``[B, 80, T]`` -> ``[B, C * 10, T]``."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(
            ResBlock2d(channels, channels, 2), ResBlock2d(channels, channels, 1)
        )
        self.layer2 = nn.Sequential(
            ResBlock2d(channels, channels, 2), ResBlock2d(channels, channels, 1)
        )
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_channels = channels * (FEAT_DIM // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x[:, None])))
        x = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(x)))))
        return x.flatten(1, 2)


class TDNNLayer(nn.Module):
    """A 1-D conv then ``batchnorm-relu``."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int):
        super().__init__()
        self.linear = nn.Conv1d(
            in_ch, out_ch, kernel, stride, padding=(kernel - 1) // 2, bias=False
        )
        self.nonlinear = _bn_relu(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x))


class CAMLayer(nn.Module):
    """A local conv gated by the context of the whole clip and of the frame's segment."""

    def __init__(self, bn_ch: int, out_ch: int, kernel: int, dilation: int):
        super().__init__()
        pad = (kernel - 1) // 2 * dilation
        self.linear_local = nn.Conv1d(
            bn_ch, out_ch, kernel, padding=pad, dilation=dilation, bias=False
        )
        self.linear1 = nn.Conv1d(bn_ch, bn_ch // 2, 1)
        self.linear2 = nn.Conv1d(bn_ch // 2, out_ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        seg = F.avg_pool1d(x, SEGMENT, SEGMENT, ceil_mode=True)  # [B, C, ceil(T / 100)]
        seg = seg.repeat_interleave(SEGMENT, dim=-1)[..., :frames]
        context = x.mean(-1, keepdim=True) + seg
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(context))))
        return self.linear_local(x) * gate


class CAMDenseLayer(nn.Module):
    """``batchnorm-relu``, 1x1 bottleneck, ``batchnorm-relu``, CAM layer."""

    def __init__(self, in_ch: int, growth: int, bn_ch: int, kernel: int, dilation: int):
        super().__init__()
        self.nonlinear1 = _bn_relu(in_ch)
        self.linear1 = nn.Conv1d(in_ch, bn_ch, 1, bias=False)
        self.nonlinear2 = _bn_relu(bn_ch)
        self.cam_layer = CAMLayer(bn_ch, growth, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class CAMDenseBlock(nn.Module):
    """Dense connectivity: each layer's output is concatenated to its input."""

    def __init__(
        self, layers: int, in_ch: int, growth: int, bn_ch: int, kernel: int, dilation: int
    ):
        super().__init__()
        for i in range(layers):
            layer = CAMDenseLayer(in_ch + i * growth, growth, bn_ch, kernel, dilation)
            self.add_module(f"tdnnd{i + 1}", layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = torch.cat([x, layer(x)], dim=1)
        return x


class TransitLayer(nn.Module):
    """``batchnorm-relu`` then a 1x1 conv (no bias)."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.nonlinear = _bn_relu(in_ch)
        self.linear = nn.Conv1d(in_ch, out_ch, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.nonlinear(x))


class DenseLayer(nn.Module):
    """The x-vector projection: a 1x1 conv then a non-affine batch norm."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.linear = nn.Conv1d(in_ch, out_ch, 1, bias=False)
        self.nonlinear = _bn_relu(out_ch, affine=False, relu=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x[..., None])[..., 0])


class StatsPool(nn.Module):
    """Mean and unbiased standard deviation over time, concatenated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)


class CAMPPlus(nn.Module):
    """The speaker encoder (module docstring); tensors under ``speaker_encoder.``.

    Args:
        config: sizes (``CAMPPlusConfig.from_state_dict``).
    """

    def __init__(self, config: CAMPPlusConfig | None = None):
        super().__init__()
        c = config or CAMPPlusConfig()
        self.config = c
        self.head = FCM(c.head_channels)
        xvector = nn.Sequential()
        xvector.add_module("tdnn", TDNNLayer(self.head.out_channels, c.init_channels, 5, 2))
        channels = c.init_channels
        for i, layers in enumerate(c.block_layers):
            block = CAMDenseBlock(
                layers, channels, c.growth, c.bottleneck, BLOCK_KERNELS[i], BLOCK_DILATIONS[i]
            )
            xvector.add_module(f"block{i + 1}", block)
            channels += layers * c.growth
            xvector.add_module(f"transit{i + 1}", TransitLayer(channels, channels // 2))
            channels //= 2
        xvector.add_module("out_nonlinear", _bn_relu(channels))
        xvector.add_module("stats", StatsPool())
        xvector.add_module("dense", DenseLayer(2 * channels, c.embedding))
        self.xvector = xvector

    @torch.inference_mode()
    def forward(self, fbank: torch.Tensor) -> torch.Tensor:
        """The x-vector ``[embedding]`` float32 of one clip's Kaldi fbank ``[frames, 80]``
        (``clip_features.kaldi_fbank``; its mean over time is removed here).

        Raises:
            ValueError: fewer than 2 frames (the std pooling needs two), or not ``[T, 80]``.
        """
        if fbank.ndim != 2 or fbank.shape[1] != FEAT_DIM or fbank.shape[0] < 2:
            raise ValueError(f"CAMPPlus takes a [T >= 2, 80] fbank, got {tuple(fbank.shape)}")
        weight = self.head.conv1.weight
        feats = fbank - fbank.mean(dim=0, keepdim=True)
        x = feats.to(device=weight.device, dtype=weight.dtype).T[None]  # [1, 80, T]
        return self.xvector(self.head(x))[0].float()
