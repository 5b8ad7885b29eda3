"""The Higgs Audio v2 tokenizer's encoder: a reference clip -> 8-codebook codes (voice cloning).

Our implementation of ``HiggsAudioV2TokenizerModel.encode`` (transformers
models/higgs_audio_v2_tokenizer/modeling_higgs_audio_v2_tokenizer.py), with transformers'
``HubertModel`` (the semantic model) and ``DacEncoder`` (the acoustic encoder) as modules::

    wave 24 kHz [N]
      semantic: resample to 16 kHz (torchaudio's sinc/Hann kernel, ``resample_sinc``), pad 160
                samples each side, HuBERT, the mean of all its hidden states (embeddings
                output included), every ``semantic_downsample_factor``-th frame
                -> SemanticEncoder (conv k 3; blocks of residual units (ELU, dilated conv,
                ELU, conv k 1, + input) and a strided conv)              [B, 768, T]
      acoustic: the DAC encoder on the wave (padded by hop/2 each side when its frame count
                differs from the semantic one's)                        [B, 256, T]
      -> concat -> fc -> residual VQ: per quantizer project_in, the nearest codebook vector
         (Euclidean), its project_out subtracted from the residual        codes [T, Q]

The resampler is torchaudio's default ``functional.resample`` (``sinc_interp_hann``,
``lowpass_filter_width`` 6, ``rolloff`` 0.99), written from its published formula; torchaudio
has no build for this torch, so it is checked against an analytic sine, not against torchaudio.

Imports: torch, transformers (``HubertModel``, ``DacEncoder`` and their configs), numpy,
``omnistep.audio.resample``, ``omnistep.core`` and this family's loader.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnistep.audio.resample import Resampler, as_mono_float32
from omnistep.core import InvalidRequestError
from omnistep.models.higgs_audio_v2.loader import HiggsCheckpoint, HiggsCheckpointError, take

MIN_CLIP_SECONDS = 0.5
MAX_CLIP_SECONDS = 60.0


@lru_cache(maxsize=8)
def _sinc_kernel(orig: int, new: int, width_factor: int = 6, rolloff: float = 0.99):
    base = min(orig, new) * rolloff
    width = math.ceil(width_factor * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new + idx
    t = (t * base).clamp(-width_factor, width_factor)
    window = torch.cos(t * math.pi / width_factor / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)
    return kernel.float(), width


def resample_sinc(wave: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    """torchaudio ``functional.resample`` (default sinc/Hann interpolation) of ``[B, N]``
    float32 from ``orig`` Hz to ``new`` Hz: ``[B, ceil(new * N / orig)]``."""
    if orig == new:
        return wave
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    kernel, width = _sinc_kernel(orig, new)
    n = wave.shape[-1]
    x = F.pad(wave[:, None], (width, width + orig))
    out = F.conv1d(x, kernel.to(wave)[:, None], stride=orig)  # [B, new, frames]
    out = out.transpose(1, 2).reshape(wave.shape[0], -1)
    return out[:, : math.ceil(new * n / orig)]


class SemanticResidualUnit(nn.Module):
    """ELU -> conv (dilated, same padding, no bias) -> ELU -> conv k 1 (no bias), + input."""

    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        pad = (kernel - 1) // 2 * dilation
        self.conv1 = nn.Conv1d(
            channels, channels, kernel, dilation=dilation, padding=pad, bias=False
        )
        self.conv2 = nn.Conv1d(channels, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class SemanticBlock(nn.Module):
    """Residual units, then a conv (k 3 at stride 1, else k ``2 * stride``)."""

    def __init__(self, cin: int, cout: int, stride: int, unit_kernel: int, dilations):
        super().__init__()
        self.res_units = nn.ModuleList(SemanticResidualUnit(cin, unit_kernel, d) for d in dilations)
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    """``encoder_semantic``: conv k ``kernel_size`` (no bias), then one block per stride."""

    def __init__(self, cfg: dict[str, Any], hidden: int):
        super().__init__()
        k = int(cfg.get("kernel_size", 3))
        self.conv = nn.Conv1d(hidden, hidden, k, padding=k // 2, bias=False)
        blocks, cin = [], hidden
        for ratio, stride in zip(
            cfg.get("channel_ratios", (1, 1)), cfg.get("strides", (1, 1)), strict=True
        ):
            cout = int(hidden * ratio)
            blocks.append(
                SemanticBlock(
                    cin,
                    cout,
                    stride,
                    int(cfg.get("unit_kernel_size", 3)),
                    tuple(cfg.get("block_dilations", (1, 1))),
                )
            )
            cin = cout
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


class HiggsCodecEncoder(nn.Module):
    """Clip -> codes (see the module docstring).

    Args:
        config: the audio tokenizer's ``config.json`` as a dict.
        num_codebooks: quantizers used (the LM's 8).
    """

    def __init__(self, config: dict[str, Any], num_codebooks: int):
        super().__init__()
        from transformers import DacConfig, HubertConfig, HubertModel
        from transformers.models.dac.modeling_dac import DacEncoder

        acoustic = {k: v for k, v in config["acoustic_model_config"].items() if k != "model_type"}
        semantic = {k: v for k, v in config["semantic_model_config"].items() if k != "model_type"}
        self.dac_config = DacConfig(**acoustic)
        self.sample_rate = int(config.get("sample_rate", 24000))
        self.semantic_rate = int(config.get("semantic_sample_rate", 16000))
        self.hop = math.prod(self.dac_config.downsampling_ratios)
        self.semantic_step = int(
            self.hop
            / (self.sample_rate / self.semantic_rate)
            / int(config.get("downsample_factor", 320))
        )
        self.semantic_model = HubertModel(
            HubertConfig(**{"mask_time_prob": 0.0, **semantic})
        ).eval()
        s_hidden = self.semantic_model.config.hidden_size
        self.encoder_semantic = SemanticEncoder(config, s_hidden)
        self.acoustic_encoder = DacEncoder(self.dac_config)
        hidden = self.dac_config.hidden_size + s_hidden
        self.fc = nn.Linear(hidden, hidden)
        size, dim = int(config.get("codebook_size", 1024)), int(config.get("codebook_dim", 64))
        self.num_codebooks = num_codebooks
        self.embed = nn.Parameter(torch.zeros(num_codebooks, size, dim))
        self.project_in_weight = nn.Parameter(torch.zeros(num_codebooks, dim, hidden))
        self.project_in_bias = nn.Parameter(torch.zeros(num_codebooks, dim))
        self.project_out_weight = nn.Parameter(torch.zeros(num_codebooks, hidden, dim))
        self.project_out_bias = nn.Parameter(torch.zeros(num_codebooks, hidden))

    def load(self, tensors: dict[str, torch.Tensor], where: object) -> None:
        """Copy the audio tokenizer's encoder-side tensors in (``semantic_model.*``,
        ``encoder_semantic.*``, ``acoustic_encoder.*``, ``fc.*``, the quantizers).

        Raises:
            HiggsCheckpointError: a missing tensor or one of another shape.
        """
        with torch.no_grad():
            for prefix in ("semantic_model.", "encoder_semantic.", "acoustic_encoder.", "fc."):
                module = getattr(self, prefix[:-1])
                for name, target in module.state_dict(keep_vars=True).items():
                    target.copy_(take(tensors, prefix + name, tuple(target.shape), where))
            for q in range(self.num_codebooks):
                p = f"quantizer.quantizers.{q}"
                for own, name in (
                    (self.embed, "codebook.embed"),
                    (self.project_in_weight, "project_in.weight"),
                    (self.project_in_bias, "project_in.bias"),
                    (self.project_out_weight, "project_out.weight"),
                    (self.project_out_bias, "project_out.bias"),
                ):
                    own[q].copy_(take(tensors, f"{p}.{name}", tuple(own[q].shape), where))

    def _conv_frames(self, n: int) -> int:
        for layer in self.acoustic_encoder.modules():
            if isinstance(layer, nn.Conv1d):
                n = int(
                    (n + 2 * layer.padding[0] - layer.dilation[0] * (layer.kernel_size[0] - 1) - 1)
                    / layer.stride[0]
                    + 1
                )
        return n

    @torch.inference_mode()
    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` float32 at ``sample_rate`` -> codes ``[B, T, num_codebooks]`` long."""
        semantic_in = resample_sinc(wave, self.sample_rate, self.semantic_rate)
        out = self.semantic_model(F.pad(semantic_in, (160, 160)), output_hidden_states=True)
        feats = torch.stack(out.hidden_states, dim=1).mean(dim=1)  # [B, frames, hidden]
        if self.semantic_step > 1:
            feats = feats[:, :: self.semantic_step]
        e_semantic = self.encoder_semantic(feats.transpose(1, 2))
        x = wave[:, None]
        if self._conv_frames(x.shape[-1]) != e_semantic.shape[-1]:
            x = F.pad(x, (self.hop // 2, self.hop // 2))
        e_acoustic = self.acoustic_encoder(x)
        emb = self.fc(torch.cat([e_acoustic, e_semantic], dim=1).transpose(1, 2))  # [B, T, H]
        residual, codes = emb, []
        for q in range(self.num_codebooks):
            h = F.linear(residual, self.project_in_weight[q], self.project_in_bias[q])
            flat = h.reshape(-1, h.shape[-1])
            embed = self.embed[q].t()
            dist = -(
                flat.pow(2).sum(1, keepdim=True)
                - 2 * flat @ embed
                + embed.pow(2).sum(0, keepdim=True)
            )
            index = dist.max(dim=-1).indices.view(h.shape[:-1])  # [B, T]
            quantized = F.linear(
                self.embed[q][index], self.project_out_weight[q], self.project_out_bias[q]
            )
            residual = residual - quantized
            codes.append(index)
        return torch.stack(codes, dim=-1)


class HiggsEncoderComponent:
    """The ``encoder`` component: no loop runs units on it; the card's ``voice_enroller``
    calls ``enroll`` (through ``omnistep.core.call_component``)."""

    def __init__(self, encoder: HiggsCodecEncoder):
        self.encoder = encoder

    def execute(self, kind: Any, payloads: Any) -> list[Any]:
        """Runs no units.

        Raises:
            ValueError: always.
        """
        raise ValueError("the Higgs audio encoder runs no work units; call enroll()")

    def enroll(self, audio: Any, sample_rate: Any, transcript: Any) -> str:
        """A saved voice's spec ``{"ref_text", "codes"}`` (the card's voice format) of a clip.

        Raises:
            InvalidRequestError: no transcript, a bad rate, a clip outside 0.5-60 s.
        """
        if not isinstance(transcript, str) or not transcript.strip():
            raise InvalidRequestError(
                "the transcript of the reference audio is required", param="transcript"
            )
        if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or sample_rate <= 0:
            raise InvalidRequestError(f"bad sample rate {sample_rate!r}", param="sample_rate")
        clip = as_mono_float32(np.asarray(audio, dtype=np.float32))
        seconds = len(clip) / sample_rate
        if not MIN_CLIP_SECONDS <= seconds <= MAX_CLIP_SECONDS:
            raise InvalidRequestError(
                f"the reference audio is {seconds:.2f} s; it must be "
                f"{MIN_CLIP_SECONDS}-{MAX_CLIP_SECONDS} s",
                param="ref_audio",
            )
        rate = self.encoder.sample_rate
        if sample_rate != rate:
            resampler = Resampler(sample_rate, rate)
            clip = np.concatenate([resampler.process(clip), resampler.flush()])
        device = self.encoder.embed.device
        codes = self.encoder(torch.from_numpy(clip)[None].to(device))[0]
        return json.dumps({"ref_text": transcript, "codes": codes.cpu().tolist()})


def encoder_from_checkpoint(checkpoint: HiggsCheckpoint, device: str | torch.device = "cpu"):
    """The loaded encoder component.

    Raises:
        HiggsCheckpointError: a missing tensor or one of another shape (named).
    """
    from safetensors.torch import load_file

    path = checkpoint.codec_root / "model.safetensors"
    try:
        tensors = load_file(str(path))
        config = json.loads((checkpoint.codec_root / "config.json").read_text())
    except OSError as exc:
        raise HiggsCheckpointError(f"{path}: unreadable ({exc})") from exc
    encoder = HiggsCodecEncoder(config, checkpoint.lm.num_codebooks)
    encoder.load(tensors, path)
    return HiggsEncoderComponent(encoder.to(device).eval())
